"""Exact token-level loss reduction under megatron-core's pipeline schedules and DDP.

DAPO's token-mean loss of one optimizer step is ``sum over all valid tokens of l_t / N`` where N is the GLOBAL
valid-token count of the step: summed over its micro-batches, its data-parallel (DP) ranks and, with context
parallelism (CP), over the sequence shards. ``nemo_dapo.core.loss`` returns each micro-batch's contribution
``c = sum_{t in micro-batch} l_t / N``, so the wanted gradient is the plain sum of ``grad c`` over micro-batches and
ranks. Megatron does not sum; what it does to the value ``loss_func`` returns (read in megatron-core 0.10.0, the
version NeMo-Aligner 0.7.0 pins, and in 0.16.1):

* ``pipeline_parallel/schedules.py::forward_step`` (0.16.1: ``forward_step_calc_loss``), on the last pipeline stage:
  - a 2-tuple ``(loss, metrics)``: ``loss / num_microbatches`` (0.16.1 first multiplies by the CP size);
  - a 3-tuple ``(loss, num_tokens, metrics)``: ``loss / num_tokens / num_microbatches``, or, when
    ``config.calculate_per_token_loss`` is set, the loss untouched and the token counts summed over micro-batches.
  Non-last stages never see the loss; their gradients follow through the pipeline.
* ``distributed/DistributedDataParallel``: gradients are AVERAGED over the DP x CP group (a pre-scale of 1/(DP*CP)
  before a sum, or an AVG collective; expert parameters: 1/EP before an AVG over the expert-DP group, i.e. again
  1/(DP*CP) in total), except under ``calculate_per_token_loss``, where they are summed.
* ``distributed/finalize_model_grads.py``: under ``calculate_per_token_loss`` the summed token count is broadcast
  from the last stage, all-reduced over the DP group (0.10.0: WITHOUT the CP ranks; 0.16.1: DP x CP) and every
  gradient is divided by it.

This module uses the 2-tuple path and undoes both averagings explicitly: ``loss_func`` returns
``c * num_microbatches * DP * CP`` (``* DP`` only where the schedule already multiplies by CP), so that after the
schedule's division and DDP's average the gradient is exactly ``sum grad c``. It is chosen over the per-token path
because (1) it works for any loss that is a sum of per-micro-batch contributions, including the sequence-mean
baselines of the paper's ablation, not only token sums; (2) 0.10.0's per-token path under-counts tokens with CP;
(3) the per-token path rescales the MoE auxiliary loss differently in each version (0.10.0 divides it by the global
token count too); (4) it needs megatron's DDP, while the 2-tuple scaling also holds with a manual gradient average.
Both paths are proven equal to a single-process reference in tests/megatron/test_token_reduction.py (the per-token
path at CP = 1). The MoE auxiliary loss keeps megatron's own convention (mean over micro-batches and DP ranks).

The step loop computes N through its Reducer (``DPReducer`` below) and passes it to ``Policy.train_step`` as
``norm``. The per-token path's 3-tuple and a mask-based N, which only the equality tests use, are in
tests/support/megatron_reduction.py.
"""
from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from nemo_dapo.core.collective import collective_device


@lru_cache(maxsize=None)
def schedule_multiplies_by_cp() -> bool:
    """True when the installed megatron-core multiplies a 2-tuple loss by the CP size before dividing by
    num_microbatches (0.16.1 does, 0.10.0 does not). Read from the schedule's source: the behaviour has no flag."""
    from megatron.core.pipeline_parallel import schedules
    src = inspect.getsource(schedules)
    return "output_tensor *= cp_group_size" in src or \
        "output_tensor *= parallel_state.get_context_parallel_world_size()" in src


def schedule_loss_scale(num_microbatches: int, dp_size: int, cp_size: int = 1, *,
                        multiplies_by_cp: Optional[bool] = None) -> float:
    """Factor for a micro-batch's loss contribution returned as a 2-tuple to megatron's schedule, so that the
    schedule's division by ``num_microbatches`` and DDP's average over ``dp_size * cp_size`` ranks leave the plain
    sum of contributions. ``dp_size`` is the data-parallel size WITHOUT CP (megatron's
    ``get_data_parallel_world_size()``); ``multiplies_by_cp`` defaults to the installed version's behaviour."""
    for name, v in (("num_microbatches", num_microbatches), ("dp_size", dp_size), ("cp_size", cp_size)):
        if int(v) < 1:
            raise ValueError(f"schedule_loss_scale: {name} must be >= 1, got {v}")
    if multiplies_by_cp is None:
        multiplies_by_cp = schedule_multiplies_by_cp()
    return float(num_microbatches * dp_size * (1 if multiplies_by_cp else cp_size))


def megatron_loss_scale(num_microbatches: int) -> float:
    """:func:`schedule_loss_scale` with DP and CP sizes read from megatron's parallel state."""
    return schedule_loss_scale(num_microbatches, parallel_state.get_data_parallel_world_size(),
                               parallel_state.get_context_parallel_world_size())


def scale_for_schedule(loss: torch.Tensor, metrics: dict, scale: float) -> tuple:
    """The 2-tuple a megatron ``loss_func`` returns: the contribution times ``scale`` (for the gradient) and the
    metrics with the unscaled contribution under ``"loss"``."""
    kept = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}  # no graph kept alive
    return loss * scale, {**kept, "loss": loss.detach()}


def agreed_microbatches(n_local: int, group: Optional[dist.ProcessGroup] = None) -> int:
    """Micro-batches every rank of ``group`` (default: megatron's DP group) runs: the max of the local counts, at
    least 1. Expert-parallel all-to-alls and the DP gradient reduction span the DP ranks, so all of them must run
    the same number of forwards; a short rank completes its share with fully masked filler rows."""
    if group is None and parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_data_parallel_group()
    n = torch.tensor(max(1, int(n_local)), dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        n = n.to(collective_device(group))
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
    return int(n)


def from_last_pipeline_stage(obj: Any) -> Any:
    """A small picklable object (the metrics) of this rank's last pipeline stage, on every stage of this rank's own
    pipeline (megatron's last stage computes the loss; the others hold None). Identity without pipelining."""
    if not parallel_state.model_parallel_is_initialized() or \
            parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                               group=parallel_state.get_pipeline_model_parallel_group())
    return box[0]


def sum_grads_over_tp(grads: list) -> None:
    """Sum ``grads`` (tensors, changed in place) over the tensor-parallel group: the gradients of a parameter every
    TP rank holds whole while each rank's forward used it on its own part only (Qwen3's QK-norm weights: each rank
    normalises its own heads), so each rank's gradient is a partial sum. megatron-core's ``finalize_model_grads``
    does this for ``qk_layernorm`` (``_allreduce_layernorm_grads``); NeMo 2.1's own reductions only for parameters
    marked ``sequence_parallel`` when sequence parallelism is on. One coalesced all-reduce, as both do."""
    if not grads or parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=parallel_state.get_tensor_model_parallel_group())
    for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


class DPReducer:
    """The core ``Reducer`` over megatron's data-parallel group: the step loop runs once per DP rank, and the
    ranks of one TP/PP/CP group see the same data. ``rank`` / ``world_size`` are the DP rank and size.

    ``wait_group``: a gloo group of the same ranks (``core.collective.cpu_wait_group``) that ``gather_objects`` meets
    in first: the loop gathers right after each rank generated its share, so a replica that finished early waits
    for the others there, on the CPU, rather than inside the NCCL gather (core/collective.py)."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None, wait_group: Optional[dist.ProcessGroup] = None):
        if group is None and not parallel_state.model_parallel_is_initialized():
            raise RuntimeError("DPReducer: megatron's parallel state is not initialised; call "
                               "model.initialize_parallel(...) (or initialize_model_parallel) first, or pass group=")
        self.group = group if group is not None else parallel_state.get_data_parallel_group()
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.wait_group = wait_group

    def _reduce(self, x: torch.Tensor, op) -> torch.Tensor:
        x = torch.as_tensor(x)
        if self.world_size == 1:
            return x.detach().clone()
        wire = torch.float64 if x.is_floating_point() else torch.int64  # gloo: no bool / int32 reductions
        out = x.detach().to(device=collective_device(self.group), dtype=wire, copy=True)  # the input stays as given
        dist.all_reduce(out, op=op, group=self.group)
        return out.to(device=x.device, dtype=x.dtype)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduce(x, dist.ReduceOp.SUM)

    def max(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduce(x, dist.ReduceOp.MAX)

    def gather_objects(self, obj: Any) -> list:
        if self.world_size == 1:
            return [obj]
        if self.wait_group is not None:
            dist.barrier(group=self.wait_group)
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out
