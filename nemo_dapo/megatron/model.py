"""A small megatron-core GPTModel from a plain config, and the map between its sharded and full parameters.

``build_gpt_model`` builds the model for the current ``parallel_state`` (TP, PP, EP) from a :class:`GPTSpec`. It is
what the tests and small runs use; at scale the model comes from the NeMo checkpoint (the aligner layer).

Parameter layout (``param_layouts``): every local parameter has a *full name*, the name it has in the same model
built on one rank (layer and expert indices made global), and a tensor-parallel split rule read from the
attributes megatron sets on it (``tensor_model_parallel``, ``partition_dim``, ``partition_stride``):

* TP-sharded along ``partition_dim`` (column-parallel weights and biases, vocabulary rows of the embedding and the
  output layer: dim 0; row-parallel weights: dim 1). The fused QKV weight needs nothing special: its rows are grouped
  per query group and TP splits whole groups.
* ``stride`` > 1: the full tensor is cut into ``stride * tp`` pieces and rank r holds pieces r, tp + r, ... The
  gated MLP (SwiGLU) ``linear_fc1`` is such a tensor with stride 2: rank r holds [gate_r; up_r]. megatron-core 0.16.1
  records the stride on the parameter; 0.10.0 records 1 although its layout is the same, so the stride of a gated
  ``linear_fc1`` is taken as 2 from the config.
* replicated otherwise (norms, row-parallel biases, the router).
Experts (``mlp.experts.local_experts.{j}``, or TE's grouped ``linear_fc*.weight{j}``) are split over the
expert-parallel (EP) group, and each expert over the expert-tensor-parallel group (ETP, = TP unless set).

``load_full_state_dict`` cuts a full state dict into this rank's shards (the inverse of ``refit_gather``).
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                      get_gpt_layer_with_transformer_engine_spec)
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass(frozen=True)
class GPTSpec:
    """Architecture of a small GPT (Llama-like by default: RoPE, RMSNorm, SwiGLU, no biases)."""

    vocab_size: int
    hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None  # GQA; None = multi-head attention
    ffn_hidden_size: Optional[int] = None  # None = 4 * hidden_size
    max_sequence_length: int = 512
    swiglu: bool = True
    normalization: str = "RMSNorm"
    add_bias_linear: bool = False
    add_qkv_bias: bool = False  # Qwen2-style QKV bias
    tie_embeddings: bool = False
    rotary_base: int = 10000
    init_std: float = 0.02
    params_dtype: torch.dtype = torch.float32
    num_experts: Optional[int] = None  # MoE when set (every layer)
    moe_router_topk: int = 2
    moe_token_dispatcher: str = "alltoall"  # or "allgather"
    moe_aux_loss_coeff: float = 0.0


def transformer_config(spec: GPTSpec) -> TransformerConfig:
    """TransformerConfig for ``spec`` in the current parallel state. Kernel fusions that need apex/TE are off;
    dropout is 0 (RL log-probs must not be noisy)."""
    if spec.num_experts and spec.add_bias_linear:
        raise ValueError("GPTSpec: MoE needs add_bias_linear=False (megatron-core 0.10.0's alltoall dispatcher "
                         "rejects biased experts)")
    kw = dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups, ffn_hidden_size=spec.ffn_hidden_size or 4 * spec.hidden_size,
        gated_linear_unit=spec.swiglu, activation_func=torch.nn.functional.silu if spec.swiglu else
        torch.nn.functional.gelu, normalization=spec.normalization, add_bias_linear=spec.add_bias_linear,
        add_qkv_bias=spec.add_qkv_bias, init_method_std=spec.init_std, params_dtype=spec.params_dtype,
        pipeline_dtype=spec.params_dtype, bf16=spec.params_dtype == torch.bfloat16,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False)
    if spec.num_experts:
        kw.update(num_moe_experts=spec.num_experts, moe_router_topk=spec.moe_router_topk,
                  moe_token_dispatcher_type=spec.moe_token_dispatcher, moe_aux_loss_coeff=spec.moe_aux_loss_coeff,
                  moe_router_load_balancing_type="aux_loss" if spec.moe_aux_loss_coeff > 0 else "none",
                  moe_grouped_gemm=False)
    return TransformerConfig(**kw)


def gpt_layer_spec(*, num_experts: Optional[int] = None, moe_grouped_gemm: bool = False, qk_layernorm: bool = False,
                   use_te: bool = False, fp8=None):
    """megatron-core 0.10's GPT layer spec, Transformer Engine's (``use_te``) or its local one, with ``qk_layernorm``
    (Qwen3: a norm over ``head_dim`` on each query / key head, after the QKV projection, before RoPE).

    The QK-norm class is megatron-core's choice, which follows ``TransformerConfig.normalization``: TE spec ->
    ``TENorm`` (``te.pytorch.RMSNorm`` for "RMSNorm"; TE < 1.9 gets apex's ``FusedLayerNorm``, which refuses
    RMSNorm at build time); local spec -> ``LNImpl`` = ``WrappedTorchNorm`` without apex (``torch.nn.RMSNorm``),
    apex's ``FusedLayerNorm`` with it (again refuses RMSNorm). Both are built with ``hidden_size = kv_channels``.
    Two fixes to 0.10's local spec: with experts it asks for TE's grouped linear (NameError without TE), so its MoE
    block is built with ``use_te=False``; and its checkpoint rename ``pre_mlp_layernorm. ->
    mlp.linear_fc1.layer_norm_`` (for TE's fused dense MLP) is dropped for MoE layers, whose TE spec keeps
    ``pre_mlp_layernorm`` as a module of its own, so a local-spec MoE checkpoint loads into the TE spec.
    """
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(num_experts, moe_grouped_gemm, qk_layernorm=qk_layernorm,
                                                          fp8=fp8)
    if not num_experts:
        return get_gpt_layer_local_spec(qk_layernorm=qk_layernorm)
    try:
        layer = get_gpt_layer_local_spec(num_experts, moe_grouped_gemm, qk_layernorm=qk_layernorm)
    except NameError:  # megatron-core 0.10.0 without TE
        from megatron.core.models.gpt.gpt_layer_specs import _get_moe_module_spec
        layer = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm)
        layer.submodules.mlp = _get_moe_module_spec(use_te=False, num_experts=num_experts,
                                                    moe_grouped_gemm=moe_grouped_gemm)
    keys = {k: v for k, v in (layer.submodules.sharded_state_dict_keys_map or {}).items()
            if k != "pre_mlp_layernorm."}
    layer.submodules = dataclasses.replace(layer.submodules, sharded_state_dict_keys_map=keys)
    return layer


def layer_spec(spec: GPTSpec):
    """megatron-core's local (no TE) layer spec. 0.10.0's local spec asks for TE's grouped linear when given
    experts (NameError without TE), so its MoE block is rebuilt with ``use_te=False`` there."""
    if not spec.num_experts:
        return get_gpt_layer_local_spec()
    try:
        return get_gpt_layer_local_spec(num_experts=spec.num_experts, moe_grouped_gemm=False)
    except NameError:
        from megatron.core.models.gpt.gpt_layer_specs import _get_moe_module_spec
        layer = get_gpt_layer_local_spec()
        layer.submodules.mlp = _get_moe_module_spec(use_te=False, num_experts=spec.num_experts,
                                                    moe_grouped_gemm=False)
        return layer


def build_gpt_model(spec: GPTSpec) -> GPTModel:
    """This rank's part of the model (its pipeline stage, its TP/EP shards). Call after initialize_parallel."""
    return GPTModel(config=transformer_config(spec), transformer_layer_spec=layer_spec(spec),
                    vocab_size=spec.vocab_size, max_sequence_length=spec.max_sequence_length,
                    position_embedding_type="rope", rotary_base=spec.rotary_base,
                    share_embeddings_and_output_weights=spec.tie_embeddings,
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage())


def initialize_parallel(tp: int = 1, pp: int = 1, ep: int = 1, *, seed: int = 1234, backend: str = "gloo") -> None:
    """torch.distributed (from the torchrun environment) + megatron's parallel groups + its RNG tracker."""
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise RuntimeError("torch.distributed is not initialised and RANK is unset: launch with torchrun, or "
                               "call torch.distributed.init_process_group first")
        dist.init_process_group(backend)
    world = dist.get_world_size()
    if world % (tp * pp) or (world // (tp * pp)) % ep:
        raise ValueError(f"world size {world} does not fit tp={tp} x pp={pp} with ep={ep} dividing the "
                         f"data-parallel size {world // max(tp * pp, 1)}")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(seed)


_STALE_AFTER_DESTROY = ("_EMBEDDING_GLOBAL_RANKS", "_POSITION_EMBEDDING_GLOBAL_RANKS", "_PIPELINE_GLOBAL_RANKS",
                        "_MODEL_PARALLEL_GLOBAL_RANKS", "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS",
                        "_DATA_PARALLEL_GLOBAL_RANKS", "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP")


def destroy_parallel() -> None:
    """Drop megatron's groups (torch.distributed stays up) so another layout can be initialised.

    megatron-core 0.10.0's ``destroy_model_parallel`` leaves the ``*_GLOBAL_RANKS`` lists behind; a later layout in
    which this rank is no longer in the (position) embedding group then finds a stale list and asserts in
    ``finalize_model_grads``. They are cleared here too.
    """
    parallel_state.destroy_model_parallel()
    for name in _STALE_AFTER_DESTROY:
        if hasattr(parallel_state, name):
            setattr(parallel_state, name, None)


def unwrap(model) -> GPTModel:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module") and not isinstance(model, GPTModel):
        model = model.module
    return model


# ---------------------------------------------------------------------------------------------------------------
# parameter layout
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ParamLayout:
    """How one local parameter relates to the full (single-rank) model.

    ``full_name``: its name in the single-rank model. ``tp_dim``: dim split over tensor parallelism (None:
    replicated). ``stride``: pieces per rank along ``tp_dim`` (see module doc). ``expert``: global expert index for
    expert weights, else None (they are split over EP and, along ``tp_dim``, over ETP instead of TP).
    ``shared``: the last pipeline stage's copy of a tied embedding (full name: the embedding's; megatron keeps the
    two equal, so it is loaded from the embedding and never gathered twice).
    """

    full_name: str
    tp_dim: Optional[int]
    stride: int = 1
    expert: Optional[int] = None
    shared: bool = False


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_SEQ_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
_TE_EXPERT = re.compile(r"\.mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")


def _layout(model: GPTModel, name: str, param: torch.Tensor) -> ParamLayout:
    full, expert = name, None
    m = _LAYER.match(name)
    if m:
        layer = model.decoder.layers[int(m.group(1))]
        full = f"decoder.layers.{layer.layer_number - 1}." + name[m.end():]
        e = _SEQ_EXPERT.search(full) or _TE_EXPERT.search(full)
        if e:
            local = int(e.group(e.lastindex))
            expert = int(layer.mlp.local_expert_indices[local])
            full = full[:e.start(e.lastindex)] + str(expert) + full[e.end(e.lastindex):]
    tp_dim = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
    stride = int(getattr(param, "partition_stride", 1))
    if tp_dim is not None and model.config.gated_linear_unit and re.search(r"linear_fc1\.(weight|bias)\d*$", name):
        stride = 2
    shared = bool(getattr(param, "shared", False))
    if shared:  # the last stage's copy of a tied embedding IS the embedding in the single-rank model
        full = "embedding.word_embeddings.weight"
    return ParamLayout(full_name=full, tp_dim=tp_dim, stride=stride, expert=expert, shared=shared)


def with_expert_index(full_name: str, expert: int) -> str:
    """``full_name`` of an expert weight with its (global) expert index replaced by ``expert``."""
    m = _SEQ_EXPERT.search(full_name) or _TE_EXPERT.search(full_name)
    if m is None:
        raise ValueError(f"{full_name!r} is not an expert weight")
    return full_name[:m.start(m.lastindex)] + str(expert) + full_name[m.end(m.lastindex):]


def param_layouts(model) -> dict:
    """{local name: ParamLayout} for every parameter of this rank's model (DDP wrappers are looked through)."""
    model = unwrap(model)
    return {n: _layout(model, n, p) for n, p in model.named_parameters()}


def tp_group_of(layout: ParamLayout):
    """(process group, size, rank) of the tensor-parallel split that applies to this parameter."""
    if layout.expert is not None:
        return (parallel_state.get_expert_tensor_parallel_group(),
                parallel_state.get_expert_tensor_parallel_world_size(),
                parallel_state.get_expert_tensor_parallel_rank())
    return (parallel_state.get_tensor_model_parallel_group(), parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_rank())


def tp_shard(full: torch.Tensor, dim: int, stride: int, size: int, rank: int, *, name: str = "") -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` split ``size`` ways along ``dim`` with ``stride`` pieces per rank (a view
    when stride is 1)."""
    if full.shape[dim] % (size * stride):
        raise ValueError(f"{name or 'tensor'}: dim {dim} of size {full.shape[dim]} cannot be split into {size} "
                         f"tensor-parallel shards of {stride} piece(s); choose a TP size that divides it")
    pieces = full.chunk(size * stride, dim)
    if stride == 1:
        return pieces[rank]
    return torch.cat([pieces[k * size + rank] for k in range(stride)], dim)


def tp_unshard(shards: list, dim: int, stride: int) -> torch.Tensor:
    """Inverse of :func:`tp_shard`: the full tensor from the shards of ranks 0..size-1."""
    if stride == 1:
        return torch.cat(shards, dim)
    per_rank = [s.chunk(stride, dim) for s in shards]
    return torch.cat([per_rank[r][k] for k in range(stride) for r in range(len(shards))], dim)


@torch.no_grad()
def load_full_state_dict(model, full: dict, *, strict: bool = True) -> None:
    """Copy this rank's shards of the single-rank parameters ``full`` ({full name: tensor}) into ``model``.

    The last stage's copy of a tied embedding is filled from the embedding too.
    ``strict``: every local parameter must be in ``full``.
    """
    inner = unwrap(model)
    for name, param in inner.named_parameters():
        lay = _layout(inner, name, param)
        key = lay.full_name
        if key not in full:
            if strict:
                raise KeyError(f"load_full_state_dict: {key!r} (local {name!r}) is missing from the state dict")
            continue
        src = full[key]
        if lay.tp_dim is not None:
            _, size, rank = tp_group_of(lay)
            src = tp_shard(src, lay.tp_dim, lay.stride, size, rank, name=key)
        if src.shape != param.shape:
            raise ValueError(f"load_full_state_dict: {key!r} gives a {tuple(src.shape)} shard for local {name!r} "
                             f"of shape {tuple(param.shape)}; was the state dict made for another architecture?")
        param.copy_(src)


def single_rank_state_dict(model) -> dict:
    """{name: detached clone} of a model built on one rank (TP = PP = EP = 1), i.e. already full."""
    sizes = (parallel_state.get_tensor_model_parallel_world_size(),
             parallel_state.get_pipeline_model_parallel_world_size(),
             parallel_state.get_expert_model_parallel_world_size())
    if sizes != (1, 1, 1):
        raise RuntimeError(f"single_rank_state_dict needs TP = PP = EP = 1, got {sizes}; gather with "
                           "refit_gather.full_state_dict instead")
    return {n: p.detach().clone() for n, p in unwrap(model).named_parameters()}
