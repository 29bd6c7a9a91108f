"""The closed-form training memory and FLOPs of `nemo-dapo plan` (the GPU, architecture and layout shapes are in
plan_shapes.py). Imports nothing of NeMo, Megatron or torch. All results are ESTIMATES.

Training state per GPU (Megatron, bf16 params): weights 2 B/param, main grads 4 B/param (2 with a bf16
``grad_sync_dtype``), Adam (fp32 master + m + v) 12 B/param divided by d with the distributed optimizer:
d = DP x CP for dense params, d = expert-DP = world / (EP x ETP x PP) for expert params (Megatron-LM's
distributed-optimizer note: "6 + 12/d" bytes per param). The worst pipeline stage holds ceil(L / PP) layers and one
vocab matrix (both when PP = 1 and the embeddings are untied). Expert weights of a layer are split over EP x ETP.

Activations of one micro-batch of s tokens: with full recompute only each layer's input, 2 s h / (t CP) bytes
(t = TP with sequence parallelism, else 1), times the micro-batches in flight on pipeline stage 0 under 1F1B; plus
one layer's working set c s h / (t CP) (c ~ 48 dense, ~ 66 MoE; an estimate); plus the log-prob logits: the actor
computes log-probs chunk by chunk from the last hidden states (``model.dapo.logprob_chunk_size`` tokens: peak ~3 x
chunk x V / TP x 4 B), or the whole micro-batch's fp32 logits s / CP x V / TP x 4 B when the chunk is null.

Training FLOPs per token: forward 2N, backward 4N, full recompute another forward 2N (so 6N without recompute, 8N
with it), N = active params, plus causal attention 4 L heads d (S / 2) per forward (x3 fwd+bwd, x4 with recompute).
Each log-prob pass (old policy; a KL reference policy where the recipe has one, DAPO has none) is a forward, 2N.
Time = FLOPs / (GPUs x peak x utilisation), the update at ``hfu`` and the forward-only log-prob passes at
``logprob_hfu``, with the 1F1B pipeline bubble (PP - 1) / m on m micro-batches per optimizer step.

MoE token all-to-all across nodes, charged apart from the utilisation (which covers a node's own traffic):
megatron-core 0.10's alltoall dispatcher sends each of a GPU's tokens (its sequence-parallel shard) once per routed
expert, top-k x hidden x 2 B, to the EP rank holding that expert, in every MoE layer of its stage, and the combine
sends them back: 2 such sends per forward, 2 more per backward (and per recompute forward). Its expert ranks are
ordered ETP first (``RankGenerator(tp=ETP, ep=EP, ..., order="tp-cp-ep-dp-pp")``), so an EP group is EP ranks ETP
apart in a block of EP x ETP consecutive ranks, nodes hold ``devices`` consecutive ranks, and with routing spread
evenly over the experts 1 - (EP peers on the node) / EP of the sent bytes leave it, at ``gb_per_s`` per GPU.
"""
from __future__ import annotations

import math
from typing import Optional

from nemo_dapo.cluster.plan_shapes import ARCH_KEYS, ARCH_PRESETS, GPUS, Arch, Gpu, Layout

__all__ = ["ARCH_KEYS", "ARCH_PRESETS", "GPUS", "Arch", "Gpu", "Layout", "params_per_gpu",
           "training_memory", "default_hfu", "update_flops_per_token", "expert_alltoall", "FORWARD_SENDS",
           "update_sends", "training_seconds"]


def params_per_gpu(arch: Arch, layout: Layout) -> tuple[float, float]:
    """(dense, expert) params held by one GPU of the worst pipeline stage."""
    layers = math.ceil(arch.num_layers / layout.pp)
    embeddings = arch.num_embedding_matrices() if layout.pp == 1 else 1
    dense = (layers * arch.dense_layer_params() + embeddings * arch.embedding_params()) / layout.tp
    expert = layers * arch.expert_layer_params() / (layout.ep * layout.expert_tp)
    return dense, expert


def training_memory(arch: Arch, layout: Layout, *, seq_tokens: int, in_flight: int, recompute: Optional[str],
                    distributed_optimizer: bool, grad_bytes: int, logprob_chunk: Optional[int] = None) -> dict:
    """Bytes per GPU of the training state and one step's activations (see the module docstring)."""
    dense, expert = params_per_gpu(arch, layout)
    params = dense + expert
    if distributed_optimizer:
        optimizer = 12 * (dense / (layout.dp * layout.cp) + expert / layout.expert_dp)
    else:
        optimizer = 12 * params
    t = layout.tp if layout.sequence_parallel else 1
    per_token_hidden = seq_tokens * arch.hidden_size / (t * layout.cp)
    c = 66 if arch.is_moe else 48
    layers = math.ceil(arch.num_layers / layout.pp)
    if recompute == "full":
        activations = layers * 2 * per_token_hidden * in_flight + c * per_token_hidden
    else:
        activations = layers * c * per_token_hidden * in_flight
    tokens = seq_tokens / layout.cp if logprob_chunk is None else 3 * min(logprob_chunk, seq_tokens / layout.cp)
    logits = tokens * arch.vocab_size / layout.tp * 4
    return {"weights": 2 * params, "grads": grad_bytes * params, "optimizer": optimizer,
            "activations": activations, "logits": logits}


def default_hfu(arch: Arch) -> float:
    """Update-pass utilisation: 0.40 dense (calibrated, see benchmarks/calibration/), 0.25 MoE (GUESS, no MoE row)."""
    return 0.25 if arch.is_moe else 0.40


def update_flops_per_token(arch: Arch, seq_len: float, recompute: bool) -> float:
    """Forward + backward (+ recompute forward) FLOPs of one trained token: 6N (8N with full recompute) + attention."""
    return (8 if recompute else 6) * arch.active_params() + (4 if recompute else 3) * \
        arch.attention_flops_per_token(seq_len)


def expert_alltoall(arch: Arch, layout: Layout, *, tokens: float, devices: int, gb_per_s: float) -> dict:
    """One send of the MoE all-to-all (a dispatch or a combine, every MoE layer of a stage) for ``tokens`` tokens
    over ``layout``'s world, per GPU (module docstring): ``nodes`` an EP group spans, ``off_node`` the share of the
    sent bytes that leaves the node, ``bytes`` that cross it and ``seconds`` at ``gb_per_s``. Zeros for a dense
    model or an EP group inside one node."""
    span = layout.ep * layout.expert_tp
    if not arch.is_moe or layout.ep == 1 or span <= devices:
        return {"nodes": 1, "off_node": 0.0, "bytes": 0.0, "seconds": 0.0}
    peers = min(layout.ep, max(1, devices // layout.expert_tp))  # EP ranks on one node, itself included
    off_node = 1.0 - peers / layout.ep
    t = layout.tp if layout.sequence_parallel else 1
    per_gpu = tokens / (layout.dp * layout.cp * t)
    sent = per_gpu * math.ceil(arch.num_layers / layout.pp) * arch.moe_router_topk * arch.hidden_size * 2
    crossing = sent * off_node
    return {"nodes": math.ceil(layout.ep / peers), "off_node": off_node, "bytes": crossing,
            "seconds": crossing / (gb_per_s * 1e9)}


FORWARD_SENDS = 2  # a dispatch and a combine per MoE layer


def update_sends(recompute: bool) -> int:
    """All-to-all sends of one update: a forward's and the backward's (twice a forward's), + a recompute forward."""
    return FORWARD_SENDS * (3 if recompute else 2)


def training_seconds(arch: Arch, gpu: Gpu, *, world: int, tokens: float, seq_len: float, hfu: float,
                     logprob_hfu: float, recompute: bool, logprob_passes: int = 1, bubble: float = 0.0,
                     alltoall_s: float = 0.0, epochs: int = 1) -> dict:
    """Seconds of the log-prob passes and the update for ``tokens`` trained tokens of mean length ``seq_len``:
    ``logprob_passes`` forwards (old policy, + a reference policy) at ``logprob_hfu``, the update (``epochs`` passes
    over the tokens, trainer.dapo.ppo_epochs) at ``hfu``, plus
    the MoE all-to-all's ``alltoall_s`` (expert_alltoall's seconds of one send; FORWARD_SENDS a forward,
    update_sends an update), all stretched by the pipeline ``bubble`` fraction."""
    stretch = (1.0 + bubble) / (world * gpu.bf16_tflops * 1e12)  # seconds per FLOP at utilisation 1
    forward = tokens * (2 * arch.active_params() + arch.attention_flops_per_token(seq_len))
    a2a = (1.0 + bubble) * alltoall_s
    return {"old_logprob": forward * stretch / logprob_hfu + FORWARD_SENDS * a2a,
            "reference_logprob": (logprob_passes - 1) * (forward * stretch / logprob_hfu + FORWARD_SENDS * a2a),
            "training": epochs * (tokens * update_flops_per_token(arch, seq_len, recompute) * stretch / hfu
                                  + update_sends(recompute) * a2a)}
