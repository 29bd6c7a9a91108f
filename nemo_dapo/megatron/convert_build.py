"""The megatron-core GPTModel (local spec) that matches a Hugging Face config, for the current parallel state.

Pair with ``convert_shard.hf_to_megatron_shard``: the per-rank state dict loads into this
model with ``load_state_dict(strict=True)``. Version notes: megatron-core 0.10.0's local spec asks for Transformer
Engine when given experts (NameError), so its MoE block is rebuilt with ``use_te=False``; its TransformerConfig has
no ``moe_shared_expert_gate`` (0.11+), so the gate is switched on in the shared-expert spec instead.
"""
from __future__ import annotations

import dataclasses

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from nemo_dapo.megatron.convert import gpt_model_kwargs_from_hf, hf_arch, megatron_config_from_hf
from nemo_dapo.megatron.model import gpt_layer_spec

_HAS_GATE_FIELD = "moe_shared_expert_gate" in {f.name for f in dataclasses.fields(TransformerConfig)}


def transformer_config_from_hf(hf_config, **overrides) -> TransformerConfig:
    """``megatron_config_from_hf`` + this process's TP/PP/EP sizes + kernel choices that need neither apex nor TE;
    ``overrides`` (e.g. ``params_dtype``, ``use_cpu_initialization``) win."""
    kw = megatron_config_from_hf(hf_config)
    if not _HAS_GATE_FIELD:
        kw.pop("moe_shared_expert_gate", None)  # carried by layer_spec_from_hf instead
    kw.update(tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
              pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
              expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
              bias_dropout_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
              apply_rope_fusion=False, persist_layer_norm=False)
    if kw.get("num_moe_experts"):
        kw.update(moe_grouped_gemm=False)
    kw.update(overrides)
    kw.setdefault("pipeline_dtype", kw.get("params_dtype", torch.float32))  # PP > 1 demands it
    return TransformerConfig(**kw)


def layer_spec_from_hf(hf_config):
    """megatron-core's local layer spec for ``hf_config`` (SequentialMLP experts, gated shared expert if any,
    QK-norm for Qwen3; ``model.gpt_layer_spec``)."""
    arch = hf_arch(hf_config)
    spec = gpt_layer_spec(num_experts=arch.num_experts or None, qk_layernorm=arch.qk_norm)
    if not arch.num_experts:
        return spec
    shared = getattr(spec.submodules.mlp.submodules, "shared_experts", None)
    if arch.shared_expert and not _HAS_GATE_FIELD and shared is not None:
        spec.submodules.mlp.submodules.shared_experts = dataclasses.replace(shared, params={**shared.params,
                                                                                            "gate": True})
    return spec


def gpt_model_from_hf(hf_config, *, padded_vocab: int | None = None, parallel_output: bool = True,
                      **config_overrides) -> GPTModel:
    """This rank's GPTModel (its pipeline stage, TP/EP shards) for ``hf_config``; call after
    ``initialize_model_parallel``. ``parallel_output=False`` gathers the vocabulary-parallel logits."""
    return GPTModel(config=transformer_config_from_hf(hf_config, **config_overrides),
                    transformer_layer_spec=layer_spec_from_hf(hf_config),
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage(), parallel_output=parallel_output,
                    **gpt_model_kwargs_from_hf(hf_config, padded_vocab=padded_vocab))
