"""A small megatron-core GPTModel from a plain :class:`GPTSpec` for the multi-process tests (torchrun, gloo), the
parallel state around it, and full <-> sharded parameters (``load_full_state_dict``, the inverse of
``nemo_dapo.megatron.refit_gather``). At scale the model comes from the NeMo checkpoint (the aligner layer) or from
``nemo_dapo.megatron.convert_build`` (a Hugging Face config)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

from nemo_dapo.megatron.convert_shard import tp_shard
from nemo_dapo.megatron.model import _layout, gpt_layer_spec, tp_group_of, unwrap


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


def build_gpt_model(spec: GPTSpec) -> GPTModel:
    """This rank's part of the model (its pipeline stage, its TP/EP shards). Call after initialize_parallel."""
    return GPTModel(config=transformer_config(spec), transformer_layer_spec=gpt_layer_spec(num_experts=spec.num_experts),
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
                           "tests.support.megatron_reduction.full_state_dict instead")
    return {n: p.detach().clone() for n, p in unwrap(model).named_parameters()}
