"""The NeMo actor's whole training state off the GPU while the colocated engine generates
(``model.dapo.offload_training_state``, conf/gpt_dapo_actor.yaml; ``nemo-dapo plan`` reads the same key).

The mechanism is ``nemo_dapo.megatron.state_offload.StateOffload`` (what moves and why views stay valid: its module
doc) over the actor's model chunks (``actor.model``: megatron-core DDP chunks with ``mcore_distributed_optim``,
NeMo's own wrapping otherwise) and its optimizer (``actor._optimizer``: NeMo's ``McoreDistributedOptimizer`` around
megatron-core's distributed optimizer, or NeMo's O2 ``MainParamsOptimizerWrapper`` / a plain torch optimizer). What
NeMo-Aligner 0.7.0 offers (``offload_adam_states``) moves only apex distributed-Adam states; this moves weights,
main grads and the optimizer states of any of these optimizers. Apex's ``distributed_fused_adam`` keeps its states
and gradients in bucket objects this does not walk: the validator refuses that combination.

Where it runs (aligner/engine_generation.AlignerEngineGenerator, the phases of its module doc):
  refit      grads + optimizer states leave BEFORE the refit's HF gather (which reads only the weights), and the
             weights after it: the refit holds the weights beside the engine's, generation holds neither;
  sleep      before the next update (DAPOLoop.step calls it), the engine frees its KV cache first, then every rank
             onloads (after a barrier: a non-owner rank's GPU belongs to an engine its owner puts to sleep);
  save       DAPOTrainer.save puts the engine to sleep, onloads, saves and refits again (a checkpoint reads
             every tensor; see ``DAPOTrainer.save``).
``ActorPolicy`` onloads too (``onload_for_use``) when something reaches the old-log-prob pass or an update with the
state still offloaded: a no-op in the loop's order, a guard against reading a 0-byte storage otherwise.

Metrics per rollout step (``pop_metrics``): ``timing/offload_s``, ``timing/onload_s`` (seconds of this rank's
copies) and ``memory/offloaded_gb`` (bytes held on the host at the fullest point, 1e9 B).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from nemo_dapo.cluster.config_load import required
from nemo_dapo.megatron.state_offload import GB, PARTS, StateOffload

log = logging.getLogger("nemo_dapo")

KEY = "model.dapo.offload_training_state"
BEFORE_REFIT = ("grads", "optimizer")  # the refit gather reads the weights only
AFTER_REFIT = ("weights",)


def offload_enabled(model_cfg) -> bool:
    """``model.dapo.offload_training_state`` of the model config, read strictly (its default is in the YAML)."""
    return bool(required(model_cfg, KEY[len("model."):], "model"))


def _chunks(actor) -> list:
    return list(actor.model) if isinstance(actor.model, (list, tuple)) else [actor.model]


def training_state_offload(actor, device: Optional[torch.device] = None) -> StateOffload:
    """A ``StateOffload`` over ``actor``'s model chunks and optimizer (``actor._optimizer``, set by NeMo's
    ``configure_optimizers`` once the PTL trainer is initialised: build this after ``init_using_ptl``)."""
    return StateOffload(_chunks(actor), getattr(actor, "_optimizer", None), device=device)


def onload_for_use(actor) -> None:
    """Onload ``actor``'s training state if it is still offloaded (``actor.training_state_offload``, set by the
    engine generator): the guard before the old-log-prob pass and the update. Logged when it acts: in the loop's
    order the engine's sleep has onloaded already, and here the engine may still hold its KV cache."""
    offload = getattr(actor, "training_state_offload", None)
    if offload is not None and offload.offloaded_parts:
        log.warning("the training state (%s) was still offloaded when the actor needed it: onloaded now, beside "
                    "whatever the engine holds", ", ".join(offload.offloaded_parts))
        offload.onload()


def pop_metrics(offload: Optional[StateOffload]) -> dict:
    """This step's moves as flat metrics (module doc); {} without an offload."""
    if offload is None:
        return {}
    s = offload.pop_stats()
    return {"timing/offload_s": float(s.get("offload_s", 0.0)), "timing/onload_s": float(s.get("onload_s", 0.0)),
            "memory/offloaded_gb": float(s.get("offloaded_bytes", 0)) / GB}


__all__ = ["KEY", "PARTS", "BEFORE_REFIT", "AFTER_REFIT", "offload_enabled", "training_state_offload",
           "onload_for_use", "pop_metrics"]
