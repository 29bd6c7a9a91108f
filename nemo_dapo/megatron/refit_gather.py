"""Expert-aware weight gather for refitting a rollout engine, streamed in bounded buckets.

A model trained with TP x EP (x PP) holds, on each rank, TP shards of its pipeline stage's dense weights and of its
local experts. A generation engine with its own tensor-parallel size ``infer_tp_size`` needs, on inference rank
``infer_tp_rank``, every weight of the model cut for ITS TP layout. NeMo-Aligner 0.7.0's TRT-LLM refit gathers only
TP/PP (NEMO_ALIGNER.md section 7); this module also gathers the experts:

* dense weights: all-gathered over TP (megatron's split rule, ``model.ParamLayout``), then re-split for the engine;
* expert weights: all-gathered over expert-TP, then sent expert by expert from each EP rank (a broadcast per
  expert, so only one expert tensor is in flight), named with their GLOBAL index, then re-split for the engine's TP
  (every inference rank keeps a slice of every expert: TRT-LLM's "experts split over TP" MoE mode);
* pipeline stages: the owner stage broadcasts each finished tensor to the other stages.
Every training rank must call the generator and consume it to the end (it drives collectives); each rank receives
the whole model cut for its inference rank. Names are megatron's full (single-rank) names; renaming to the engine's
checkpoint format (and splitting fused QKV) is the converter's job and can be applied tensor by tensor on the stream.

Memory: tensors are yielded in buckets ``[(name, tensor), ...]`` of at most ``bucket_bytes`` (a tensor larger than
that comes alone, as a view of the gathered tensor). The generator holds at most the pending bucket plus ONE gathered
full tensor: the bucket is flushed before a slice is copied in, so the peak is <= bucket_bytes + the largest
gathered tensor (a dtype cast of a slice larger than the bucket adds that slice). Collective scratch while gathering
one tensor (the TP shards before they are joined) comes on top, at most one more tensor. Yielded tensors never
alias the model's parameters. :class:`RefitStats` reports the measured peak.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from nemo_dapo.megatron.convert_shard import tp_shard, tp_unshard
from nemo_dapo.megatron.model import ParamLayout, param_layouts, tp_group_of, unwrap, with_expert_index


@dataclass
class RefitStats:
    """Filled while the generator runs. ``peak_buffered_bytes``: max over time of (bytes in the pending bucket +
    bytes of the gathered tensor being cut); ``max_tensor_bytes``: the largest gathered tensor."""

    buckets: int = 0
    tensors: int = 0
    bytes: int = 0
    peak_buffered_bytes: int = 0
    max_tensor_bytes: int = 0


@dataclass(frozen=True)
class _Entry:
    """One local parameter of some pipeline stage, as every rank needs to know it."""

    local_name: str
    names: tuple  # full names produced: 1 for dense, EP of them for an expert weight (one per EP rank)
    tp_dim: Optional[int]
    stride: int
    expert: bool
    shape: tuple  # after the (expert-)TP gather
    dtype: torch.dtype


def _stage_entries(model) -> list:
    inner = unwrap(model)
    ep, ep_rank = parallel_state.get_expert_model_parallel_world_size(), \
        parallel_state.get_expert_model_parallel_rank()
    entries, layouts = [], param_layouts(inner)
    for name, p in inner.named_parameters():
        lay = layouts[name]
        if lay.shared:  # tied-embedding copy on the last stage: the first stage sends the embedding
            continue
        names = (lay.full_name,)
        if lay.expert is not None:
            names = _expert_names(inner, name, lay, ep, ep_rank)
        shape = list(p.shape)
        if lay.tp_dim is not None:
            shape[lay.tp_dim] *= tp_group_of(lay)[1]
        entries.append(_Entry(name, names, lay.tp_dim, lay.stride, lay.expert is not None, tuple(shape), p.dtype))
    return entries


def _expert_names(inner, name: str, lay: ParamLayout, ep: int, ep_rank: int) -> tuple:
    """Full names of this local expert's weight on EP ranks 0..ep-1 (megatron places experts contiguously:
    EP rank e holds experts e * n_local .. (e + 1) * n_local - 1)."""
    layer = inner.decoder.layers[int(name.split(".")[2])]
    n_local = len(layer.mlp.local_expert_indices)
    j = lay.expert - ep_rank * n_local
    if not 0 <= j < n_local or int(layer.mlp.local_expert_indices[j]) != lay.expert:
        raise RuntimeError(f"{name}: expert {lay.expert} is not local expert {j} of EP rank {ep_rank}; "
                           "refit_gather assumes megatron's contiguous expert placement")
    return tuple(with_expert_index(lay.full_name, e * n_local + j) for e in range(ep))


def _all_entries(model) -> list:
    """[(stage, entry)] for every pipeline stage, in stage order (metadata exchanged over the PP group)."""
    mine = _stage_entries(model)
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if pp == 1:
        return [(0, e) for e in mine]
    per_stage = [None] * pp
    dist.all_gather_object(per_stage, mine, group=parallel_state.get_pipeline_model_parallel_group())
    return [(s, e) for s, entries in enumerate(per_stage) for e in entries]


def _tp_gather(t: torch.Tensor, entry: _Entry) -> torch.Tensor:
    if entry.tp_dim is None:
        return t
    lay = ParamLayout(full_name="", tp_dim=entry.tp_dim, stride=entry.stride, expert=0 if entry.expert else None)
    group, size, _ = tp_group_of(lay)
    if size == 1:
        return t
    shards = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(shards, t.contiguous(), group=group)
    return tp_unshard(shards, entry.tp_dim, entry.stride)


def _full_tensors(params: dict, stage: int, entry: _Entry) -> Iterator[tuple]:
    """(full name, full tensor) for one entry on every rank, one tensor alive at a time."""
    my_stage = parallel_state.get_pipeline_model_parallel_rank()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    ep_group = parallel_state.get_expert_model_parallel_group()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    for e, name in enumerate(entry.names):
        full = None
        if my_stage == stage:
            if not entry.expert or len(entry.names) == 1:
                full = _tp_gather(params[entry.local_name].detach(), entry)
            else:  # EP rank e sends its local expert; the others receive it
                full = _tp_gather(params[entry.local_name].detach(), entry) if e == ep_rank else \
                    torch.empty(entry.shape, dtype=entry.dtype, device=params[entry.local_name].device)
                dist.broadcast(full, src=dist.get_process_group_ranks(ep_group)[e], group=ep_group)
        if pp > 1:
            if full is None:
                full = torch.empty(entry.shape, dtype=entry.dtype, device=next(iter(params.values())).device)
            dist.broadcast(full, src=dist.get_process_group_ranks(pp_group)[stage], group=pp_group)
        yield name, full


def iter_refit_buckets(model, *, bucket_bytes: int, infer_tp_size: int = 1, infer_tp_rank: Optional[int] = None,
                       dtype: Optional[torch.dtype] = None,
                       stats: Optional[RefitStats] = None) -> Iterator[list]:
    """Yield buckets ``[(full name, tensor), ...]`` holding every weight of the model cut for inference TP rank
    ``infer_tp_rank`` of ``infer_tp_size`` (default: this rank's global rank modulo ``infer_tp_size``, the
    co-located convention), cast to ``dtype`` if given. All training ranks must run it to the end, in step."""
    if bucket_bytes < 1 or infer_tp_size < 1:
        raise ValueError(f"need bucket_bytes >= 1 and infer_tp_size >= 1, got {bucket_bytes}, {infer_tp_size}")
    if infer_tp_rank is None:
        infer_tp_rank = dist.get_rank() % infer_tp_size
    if not 0 <= infer_tp_rank < infer_tp_size:
        raise ValueError(f"infer_tp_rank must be in [0, {infer_tp_size}), got {infer_tp_rank}")
    stats = stats if stats is not None else RefitStats()
    params = dict(unwrap(model).named_parameters())
    param_storage = {p.untyped_storage().data_ptr() for p in params.values()}
    bucket, held = [], 0
    for stage, entry in _all_entries(model):
        for name, full in _full_tensors(params, stage, entry):
            piece = full if entry.tp_dim is None or infer_tp_size == 1 else \
                tp_shard(full, entry.tp_dim, entry.stride, infer_tp_size, infer_tp_rank, name=name)
            out_dtype = dtype or piece.dtype
            nbytes = piece.numel() * torch.empty((), dtype=out_dtype).element_size()
            full_bytes = full.numel() * full.element_size()
            aliases_param = full.untyped_storage().data_ptr() in param_storage
            stats.max_tensor_bytes = max(stats.max_tensor_bytes, full_bytes)
            if bucket and held + nbytes > bucket_bytes:  # flush BEFORE a slice is copied in
                yield _emit(bucket, stats)
                bucket, held = [], 0
            # A copy gives the slice its own storage (the full tensor can go) and never aliases a parameter; a
            # slice larger than the bucket is sent alone as a view of the gathered tensor instead.
            copy = out_dtype != piece.dtype or aliases_param or \
                (piece.untyped_storage().nbytes() > nbytes and nbytes <= bucket_bytes)
            stats.peak_buffered_bytes = max(stats.peak_buffered_bytes, held + (0 if aliases_param else full_bytes)
                                            + (nbytes if copy else 0))
            if copy:
                piece = piece.to(out_dtype) if out_dtype != piece.dtype else piece.clone()
            bucket.append((name, piece))
            held += nbytes
            del full, piece  # no reference may outlive the bucket (a view would pin the gathered tensor)
            if held >= bucket_bytes:
                yield _emit(bucket, stats)
                bucket, held = [], 0
    if bucket:
        yield _emit(bucket, stats)


def _emit(bucket: list, stats: RefitStats) -> list:
    stats.buckets += 1
    stats.tensors += len(bucket)
    stats.bytes += sum(t.numel() * t.element_size() for _, t in bucket)
    return bucket
