"""The Megatron side of a rollout-engine weight update in Hugging Face names, streamed in bounded buckets.

Rollout engines (vLLM's ``load_weights``, TensorRT-LLM's PyTorch backend) take ``(HF name, tensor)`` pairs, a bucket
at a time. :func:`hf_weight_buckets` chains the two halves the repository already has:

* ``refit_gather.iter_refit_buckets(..., infer_tp_size=1)``: every weight of the model, all-gathered over TP and
  expert-TP, experts sent from their EP rank, pipeline stages broadcast (megatron full single-rank names, the
  vocabulary still padded). It is asked for ONE tensor per step (``bucket_bytes=1``), so nothing is buffered twice;
* ``convert``'s name map (:func:`convert.conversion_rules`, the rules behind ``megatron_to_hf_items``): megatron
  name -> HF names, fused QKV split per query group into ``q/k/v_proj``, ``linear_fc1`` into ``gate/up_proj``
  (Mixtral: ``w1/w3``), the vocabulary padding cut off (HF shapes).

HF names are exactly those of :func:`convert.megatron_to_hf_items` (``save_pretrained``'s set: with tied
embeddings there is no ``lm_head.weight``, which an engine built from a config with ``tie_word_embeddings`` shares
with the embedding; vLLM's Llama / Qwen2 ``load_weights`` skip it then). Experts carry their GLOBAL index, e.g.
``model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight`` (Mixtral; ``w3`` gate-up partner, ``w2`` down) and
``model.layers.{i}.mlp.experts.{j}.gate_proj.weight`` (Qwen2-MoE, plus ``mlp.shared_expert.*`` and
``mlp.shared_expert_gate.weight``; Qwen3-MoE the same without the shared expert, router ``mlp.gate.weight``).
Qwen3 / Qwen3-MoE QK-norm: megatron-core 0.10's ``self_attention.q_layernorm.weight`` / ``k_layernorm.weight``
(``get_gpt_layer_local_spec(qk_layernorm=True)``; ``[head_dim]``, replicated over TP) -> ``self_attn.q_norm.weight``
/ ``k_norm.weight``. These are the names vLLM 0.32's loaders take: ``Qwen3MoeModel.hf_to_vllm_mapper`` stacks
``q/k/v_proj`` into ``qkv_proj`` and the dense ``mlp.gate/up_proj`` into ``gate_up_proj``, its MoE runner maps
``experts.{e}.gate_proj / up_proj / down_proj`` (Mixtral: ``w1 / w3 / w2``) by global expert index, and the
norms load by name (tests/megatron/test_refit_vllm.py loads them into vLLM's CPU engine).
"""
from __future__ import annotations

from typing import Iterable, Iterator, Optional

import torch

from nemo_dapo.megatron.convert import _EXTRA_STATE, _to_hf, conversion_rules, hf_arch
from nemo_dapo.megatron.model import sequential_expert_name, unwrap
from nemo_dapo.megatron.refit_gather import RefitStats, iter_refit_buckets


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _hf_pieces(rule, tensor: torch.Tensor, arch) -> Iterator[tuple]:
    """(HF name, tensor) of one megatron tensor, one piece at a time: the same tensors as ``convert._to_hf``, but
    the Q/K/V copies are made one after the other (``split_qkv`` makes all three at once). Other pieces are views
    of ``tensor`` (or ``tensor`` itself)."""
    if rule.kind != "qkv":
        yield from zip(rule.hf, _to_hf(rule, tensor, arch))
        return
    tail = tensor.shape[1:]
    per_group = tensor.reshape(arch.num_groups, -1, *tail)
    start = 0
    for name, size in zip(rule.hf, (arch.num_heads // arch.num_groups * arch.head_dim, arch.head_dim,
                                    arch.head_dim)):
        yield name, per_group[:, start:start + size].reshape(-1, *tail)  # a copy unless there is one group
        start += size


def hf_buckets(items: Iterable, hf_config, *, bucket_bytes: int, spec: str = "local",
               stats: Optional[RefitStats] = None) -> Iterator[list]:
    """Re-bucket a stream of (megatron full single-rank name, tensor) pairs as buckets ``[(HF name, tensor), ...]``
    of at most ``bucket_bytes`` (a tensor larger than that comes alone). Torch only; :func:`hf_weight_buckets` feeds
    it from the distributed gather, the tests from a converted state dict.

    The HF pieces of one fused megatron tensor (q/k/v of ``linear_qkv``, gate/up or ``w1``/``w3`` of a
    ``linear_fc1``) share a bucket whenever they fit in one together; only a group larger than ``bucket_bytes``
    is split across buckets.

    TE's grouped-GEMM expert names (``mlp.experts.linear_fc1.weight{j}``) are read as SequentialMLP's
    (``model.sequential_expert_name``). Every megatron tensor of ``hf_config``'s map must come exactly once (else
    ValueError at the end: the model and the config disagree); an unknown name is a KeyError. ``_extra_state``
    entries and a tied model's ``output_layer.weight`` are skipped, as in ``megatron_to_hf_items``.

    A piece that is a view of a larger tensor (a ``[:vocab]`` cut, a ``gate``/``up`` half) is copied when it fits
    in a bucket, so a bucket never pins more memory than it counts; a larger one is sent alone as that view. Pieces
    can be the input tensors themselves (norms, ``o_proj``, ...): inputs must not alias anything the caller will
    change (``iter_refit_buckets`` guarantees that for the model's parameters). Memory held by this generator: the
    pending bucket (<= ``bucket_bytes``) + the input tensor being converted + the piece being copied (counted in the
    bucket if it fits; a split Q/K/V piece larger than the bucket is a new tensor on top, <= the QKV tensor).
    Input references are dropped before the next one is pulled, so a lazy input stream never has two alive.
    """
    if bucket_bytes < 1:
        raise ValueError(f"need bucket_bytes >= 1, got {bucket_bytes}")
    arch = hf_arch(hf_config)
    rules = {rule.mc: rule for rule in conversion_rules(arch, spec)}
    tied_output = "output_layer.weight" if arch.tied else None
    stats = stats if stats is not None else RefitStats()
    seen, bucket, held = set(), [], 0
    for name, full in items:
        if name.endswith(_EXTRA_STATE) or name == tied_output:
            del full
            continue
        name = sequential_expert_name(name)  # TE grouped-GEMM experts: the map's SequentialMLP names
        rule = rules.get(name)
        if rule is None:
            raise KeyError(f"hf_buckets: {name!r} is not a tensor of the {arch.family} map (spec={spec!r}); is "
                           "hf_config the model's config, and spec its layer spec ('local' or 'te')?")
        if name in seen:
            raise ValueError(f"hf_buckets: {name!r} came twice")
        seen.add(name)
        full_bytes = _nbytes(full)
        stats.max_tensor_bytes = max(stats.max_tensor_bytes, full_bytes)
        full_storage = full.untyped_storage().data_ptr()
        if len(rule.hf) > 1 and bucket and held + full_bytes > bucket_bytes >= full_bytes:
            # An engine fuses q/k/v and gate/up (w1/w3) on load and holds a group until it is complete: start a
            # new bucket rather than split a group that fits in one (TRT-LLM's per-expert w3_w1, qkv_proj).
            yield _emit(bucket, stats)
            bucket, held = [], 0
        for hf_name, piece in _hf_pieces(rule, full, arch):
            nbytes = _nbytes(piece)
            if bucket and held + nbytes > bucket_bytes:  # flush BEFORE a piece is copied in
                yield _emit(bucket, stats)
                bucket, held = [], 0
            new = piece.untyped_storage().data_ptr() != full_storage  # a Q/K/V copy
            copy = piece.untyped_storage().nbytes() > nbytes and nbytes <= bucket_bytes
            stats.peak_buffered_bytes = max(stats.peak_buffered_bytes,
                                            held + full_bytes + (nbytes if new or copy else 0))
            bucket.append((hf_name, piece.clone() if copy else piece))
            held += nbytes
            del piece  # no reference may outlive the bucket (a view would pin ``full``)
            if held >= bucket_bytes:
                yield _emit(bucket, stats)
                bucket, held = [], 0
        del full  # before the next input is pulled (the gather of the next tensor)
    if bucket:
        yield _emit(bucket, stats)
    missing = [mc for mc in rules if mc not in seen]
    if missing:
        raise ValueError(f"hf_buckets: {len(missing)} tensor(s) of the {arch.family} map never came, e.g. "
                         f"{missing[:4]}; the model does not match hf_config (layers, experts, biases?)")


def _emit(bucket: list, stats: RefitStats) -> list:
    stats.buckets += 1
    stats.tensors += len(bucket)
    stats.bytes += sum(_nbytes(t) for _, t in bucket)
    return bucket


def _one_at_a_time(buckets: Iterable) -> Iterator[tuple]:
    """Items of a bucket stream, each bucket list emptied as soon as it is taken (``iter_refit_buckets`` keeps a
    reference to its bucket until resumed; emptying the shared list lets a consumed tensor go right away)."""
    for bucket in buckets:
        items = bucket[::-1]
        bucket.clear()
        del bucket
        while items:
            yield items.pop()


def layer_spec_name(model) -> str:
    """``"te"`` if ``model`` (this rank's GPTModel, wrappers looked through) has Transformer Engine's fused norms
    (``linear_qkv.layer_norm_weight``), else ``"local"``: the ``spec`` argument of the conversion."""
    names = (n for n, _ in unwrap(model).named_parameters())
    return "te" if any(n.endswith("self_attention.linear_qkv.layer_norm_weight") for n in names) else "local"


def hf_weight_buckets(model, hf_config, *, bucket_bytes: int, spec: str = "local",
                      dtype: Optional[torch.dtype] = None, stats: Optional[RefitStats] = None) -> Iterator[list]:
    """Yield buckets ``[(HF name, tensor), ...]`` holding the WHOLE model under Hugging Face names and shapes.

    ``model``: this rank's GPTModel (any TP x PP x EP layout, DDP / Float16Module wrappers looked through) built
    for ``hf_config`` (Llama, Qwen2, Mixtral, Qwen2-MoE, Qwen3 or Qwen3-MoE; see ``convert``) with layer spec
    ``spec`` (``"local"`` or ``"te"``; :func:`layer_spec_name` tells). ``dtype``: cast every tensor (e.g. the
    engine's bf16).

    Collectives: EVERY training rank must call it and consume it to the end, in step (TP all-gathers, per-expert
    EP broadcasts, PP broadcasts). Every rank receives the full model (``infer_tp_size=1``: no engine-TP cut; an
    engine with its own TP size cuts the full HF tensors on load, as vLLM's weight loaders do).

    Buckets: at most ``bucket_bytes`` each (counted in the output dtype); a tensor larger than that comes alone
    (possibly as a view of its gathered megatron tensor, e.g. the embedding cut to the HF vocabulary). Vocabulary
    padding is removed, fused QKV / ``linear_fc1`` are split, experts are named with their global index. Yielded
    tensors never alias the model's parameters: the trainer may keep training once a bucket is consumed, and
    changing a yielded tensor changes nothing in the model.

    Memory: the generator holds at most the pending bucket plus ONE gathered tensor, so the peak is
    <= ``bucket_bytes`` + the largest gathered tensor (typically the embedding or output layer, padded vocabulary
    x hidden), as in ``iter_refit_buckets``. On top: with ``dtype``, the uncast gathered tensor while its cast is
    converted; a split Q/K/V piece that alone exceeds the bucket (<= the fused QKV tensor); and the collective
    scratch of one gather (the TP shards before they are joined). The caller's consumed buckets are its own:
    drop each one before pulling the next to keep the bound. ``stats`` (a ``RefitStats``) receives the bucket
    count, bytes, the largest gathered tensor and the measured peak of this generator's buffers.
    """
    if bucket_bytes < 1:
        raise ValueError(f"need bucket_bytes >= 1, got {bucket_bytes}")
    megatron = iter_refit_buckets(model, bucket_bytes=1, infer_tp_size=1, infer_tp_rank=0, dtype=dtype)
    yield from hf_buckets(_one_at_a_time(megatron), hf_config, bucket_bytes=bucket_bytes, spec=spec, stats=stats)
