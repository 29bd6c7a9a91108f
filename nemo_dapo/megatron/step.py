"""One Megatron training step on the packed layout (layout.py): micro-batches, the schedule, the loss, the skip.

The NeMo actor (aligner/actor.py) and a bare megatron-core GPTModel (tests/support/megatron_policy.py: the tests'
``Policy`` on megatron without NeMo) both run their forward-backward here; each supplies only its forward call
(NeMo builds its masks and moves the batch to its device; a bare GPTModel takes positions 0..S-1 and a causal mask)
and its optimizer step (NeMo's gradient clipping, or the bare model's own).

* Micro-batches (:func:`microbatches`): rows sorted by length and grouped under a token budget or a row count
  (``core.microbatch.plan_microbatches``); each group is cut to its own longest row and right-padded to a multiple
  of ``multiple`` (the sequence-parallel split); every DP rank runs the same number (the max over DP: expert
  all-to-alls and pipeline sends need it), short ranks add filler micro-batches of :func:`layout.blank_rows`.
* Forward: the last stage returns its final hidden states (:func:`hidden_states_only`), and log-prob / entropy of
  the next tokens come from the vocabulary-parallel output weight chunk by chunk (:func:`hidden_logprobs_entropy`);
  no [tokens x vocab] logits, no vocabulary gather.
* Loss: ``loss_fn`` returns each micro-batch's share of the mini-batch loss (global normaliser ``norm``);
  ``reduction.megatron_loss_scale`` undoes the schedule's division by num_microbatches and DDP's averaging.
* Skip (:func:`skip_update`): from the step's loss summed over DP and the gradient norm; every rank skips
  together.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config

from nemo_dapo.core.collective import collective_device
from nemo_dapo.core.microbatch import plan_microbatches
from nemo_dapo.megatron.layout import blank_rows, loss_input
from nemo_dapo.megatron.model import unwrap
from nemo_dapo.megatron.reduction import agreed_microbatches, scale_for_schedule
from nemo_dapo.megatron.vocab_parallel import vocab_parallel_logprobs_entropy


# ---- micro-batches -------------------------------------------------------------------------------------------------

def row_lengths(batch: dict) -> torch.Tensor:
    """[B] real tokens of each row: ``response_lengths`` (prompt + response, as pack_rollout writes it) when the
    batch has it, else the full width S (nothing known: no row is trimmed)."""
    b, s = batch["response_tokens"].shape
    if "response_lengths" in batch:
        return batch["response_lengths"].long().clamp(1, s)
    return torch.full((b,), s, dtype=torch.long)


def pad_seq_len(batch: dict, multiple: int, pad_id: int) -> tuple:
    """(batch, S): ``response_tokens`` [B, S] right-padded with ``pad_id`` to S' (a multiple of ``multiple``) and
    the shifted per-token fields [B, S-1] (mask, prev/engine log-probs) with zeros to [B, S'-1], so the added
    positions are masked out of the loss; causal attention keeps them from changing the real positions' outputs.
    Per-row fields ([B]) are unchanged. S is the original length (log-probs are cut back to S-1)."""
    s = batch["response_tokens"].shape[1]
    target = -(-s // multiple) * multiple
    if target == s:
        return batch, s
    out = {}
    for k, v in batch.items():
        if k == "response_tokens":
            out[k] = torch.cat([v, v.new_full((v.shape[0], target - s), pad_id)], 1)
        elif isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape[1] == s - 1:
            out[k] = torch.cat([v, v.new_zeros((v.shape[0], target - s))], 1)
        else:
            out[k] = v
    return out, s


def _take(batch: dict, rows: torch.Tensor, width: int) -> dict:
    """Rows ``rows`` of ``batch``, its [B, S] tokens cut to ``width`` columns and [B, S-1] fields to width - 1."""
    s = batch["response_tokens"].shape[1]
    out = {}
    for k, v in batch.items():
        v = v[rows]
        if k == "response_tokens":
            v = v[:, :width]
        elif v.dim() == 2 and v.shape[1] == s - 1:
            v = v[:, :width - 1]
        out[k] = v
    return out


def split_microbatches(batch: dict, groups: list, n_total: int, multiple: int, pad_id: int) -> list:
    """One batch dict per group of row indices: its rows trimmed to the group's longest row and right-padded to a
    multiple of ``multiple`` (pad_seq_len); then filler micro-batches (one blank row, layout.blank_rows, of
    ``multiple`` tokens, at least 2 and at most S) up to ``n_total`` (the DP-agreed count)."""
    lengths, s = row_lengths(batch), batch["response_tokens"].shape[1]
    out = []
    for g in groups:
        rows = torch.tensor(g, dtype=torch.long)
        out.append(pad_seq_len(_take(batch, rows, max(2, int(lengths[rows].max()))), multiple, pad_id)[0])
    if len(out) < n_total:
        filler = pad_seq_len(blank_rows(batch.keys(), 1, pad_id, max(2, min(s, multiple))), multiple, pad_id)[0]
        out += [filler] * (n_total - len(out))
    return out


def microbatches(batch: dict, *, multiple: int, pad_id: int, max_tokens: Optional[int] = None,
                 max_rows: Optional[int] = None) -> tuple:
    """(groups, micro): the plan of this rank's rows (longest first; at most ``max_tokens`` rows x padded length
    each, or ``max_rows`` rows each) and the micro-batch dicts, the same count on every DP rank (filler last).
    ``groups[i]`` are the rows of ``micro[i]``; the filler micro-batches have no group."""
    groups = plan_microbatches(row_lengths(batch).tolist(), multiple=multiple, max_tokens=max_tokens,
                               max_rows=max_rows)
    return groups, split_microbatches(batch, groups, agreed_microbatches(len(groups)), multiple, pad_id)


# ---- forward ---------------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def hidden_states_only(model):
    """Make the last stage's GPTModel return its final hidden states [S(/tp with SP), b, H] instead of logits:
    both 0.10.0 and 0.16.1 return them when ``post_process`` is False (the final norm belongs to the decoder and
    still runs). ``model`` may be wrapped (DDP, Float16Module: the latter casts them to fp32 on the last stage)."""
    inner = unwrap(model)
    saved = inner.post_process
    inner.post_process = False
    try:
        yield
    finally:
        inner.post_process = saved


def output_weight(model) -> torch.Tensor:
    """The last stage's output-layer weight shard [V/tp, H] (the shared embedding weight when tied)."""
    inner = unwrap(model)
    return inner.shared_embedding_or_output_weight() if inner.share_embeddings_and_output_weights \
        else inner.output_layer.weight


def hidden_logprobs_entropy(model, hidden: torch.Tensor, targets: torch.Tensor, *,
                            positions: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None,
                            chunk_size: int = 1024, temperature: float = 1.0,
                            valid_vocab: Optional[int] = None) -> tuple:
    """fp32 (logp, entropy) [b, T] of ``targets`` [b, T] from the final hidden states of ``model``'s last stage.

    hidden [S, b, H] ([S/tp, b, H] with sequence parallelism: gathered here, and the gather's backward
    reduce-scatter sums the TP partial gradients, so the log-prob backward does not all-reduce them again).
    Target t of row b is predicted at ``positions[b, t]`` (default: position t, i.e. T <= S). ``mask`` [b, T]:
    only positions with mask != 0 are computed (the others are 0). The logits never exist beyond one chunk of
    ``chunk_size`` tokens x V/tp (vocab_parallel.vocab_parallel_logprobs_entropy)."""
    inner = unwrap(model)
    sp = bool(inner.config.sequence_parallel)
    if sp:
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)
    weight = output_weight(inner)
    h = hidden.transpose(0, 1).to(weight.dtype)  # Float16Module hands fp32 copies of bf16 values: exact cast back
    if positions is None:
        h = h[:, :targets.shape[1]]
    else:
        h = h.gather(1, positions[..., None].expand(*positions.shape, h.shape[-1]))
    return vocab_parallel_logprobs_entropy(h, weight, targets, mask=mask, chunk_size=chunk_size,
                                           temperature=temperature, reduce_grad_hidden=not sp,
                                           valid_vocab=valid_vocab)


# ---- the schedule ----------------------------------------------------------------------------------------------------

def forward_backward(model, forward: Callable, micro: list, *, forward_only: bool, data_iterator=None, **kw) -> list:
    """megatron's schedule over the micro-batch dicts ``micro`` (shapes may differ between them; with pipeline
    parallelism the stages then exchange activation shapes, ``variable_seq_lengths``). ``forward(mb, model)``
    returns (last-stage output, loss_func) as megatron's forward step does. ``data_iterator``: the iterator (or a
    list of them, one per model chunk) over ``micro`` when the caller wraps it; default ``iter(micro)``."""
    chunks = model if isinstance(model, list) else [model]
    config = get_model_config(chunks[0])
    saved = config.variable_seq_lengths
    config.variable_seq_lengths = saved or parallel_state.get_pipeline_model_parallel_world_size() > 1
    try:
        return get_forward_backward_func()(
            forward_step_func=lambda it, m: forward(next(it), m),
            data_iterator=iter(micro) if data_iterator is None else data_iterator, model=chunks,
            num_microbatches=len(micro), forward_only=forward_only,
            seq_length=max(mb["response_tokens"].shape[1] for mb in micro),
            micro_batch_size=max(mb["response_tokens"].shape[0] for mb in micro), **kw)
    finally:
        config.variable_seq_lengths = saved


def normalizer_share(loss_fn, micro: list) -> torch.Tensor:
    """0-dim float: this rank's share of ``loss_fn``'s global normaliser over its micro-batches (filler adds 0)."""
    return torch.stack([loss_fn.normalizer(loss_input(mb)).float() for mb in micro]).sum()


def loss_share(loss_fn, logp: torch.Tensor, entropy: torch.Tensor, mb: dict, norm, scale: float) -> tuple:
    """The 2-tuple a micro-batch's loss_func returns: ``loss_fn``'s (core.types.LossFn) share of the mini-batch
    loss for the packed micro-batch ``mb`` (logp / entropy [b, S-1] on its shifted grid; ``norm`` the global
    normaliser) times ``scale`` (reduction.megatron_loss_scale), and the metrics, the unscaled share under
    ``"loss"``."""
    loss, metrics = loss_fn(logp, entropy, loss_input(mb), norm)
    return scale_for_schedule(loss, {k: torch.as_tensor(v).float() for k, v in metrics.items()}, scale)


# ---- the update ------------------------------------------------------------------------------------------------------

def skip_update(local_loss: float, grad_norm: Optional[float]) -> tuple:
    """(step loss, skipped): this DP rank's loss share summed over megatron's DP group, and whether the update must
    be skipped (a non-finite loss on any rank or a non-finite gradient norm). The same on every rank."""
    group = parallel_state.get_data_parallel_group()
    total = torch.tensor([local_loss], dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(total, group=group)
    total = float(total.item())
    return total, not math.isfinite(total) or (grad_norm is not None and not math.isfinite(grad_norm))


def megatron_grad_norm(optimizer) -> Optional[float]:
    """The global L2 gradient norm megatron-core's ``optimizer`` (a ``MegatronOptimizer``, or the ``ChainedOptimizer``
    of dense and expert parameters that MoE models get) clips with in its ``step``, read before that step.

    megatron-core 0.10's step checks for inf / NaN only through a loss scaler, which bf16 training does not have, and
    its clipping skips a NaN norm (``coeff < 1`` is false), so a non-finite gradient would reach the weights: callers
    give this norm to :func:`skip_update`. Collective (every rank calls it). ``prepare_grads`` copies the model
    gradients to the main gradients, which the step repeats (a plain copy); None with a loss scaler (fp16), whose step
    unscales, checks and skips on its own."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    if any(getattr(part, "grad_scaler", None) is not None for part in parts):
        return None
    optimizer.prepare_grads()
    return math.sqrt(sum(float(part.get_grad_norm() or 0.0) ** 2 for part in parts))
