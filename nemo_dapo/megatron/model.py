"""megatron-core's GPT layer spec with QK-norm (``gpt_layer_spec``), and the map between a GPTModel's sharded and
full parameters (``param_layouts``). The small test model built from a plain spec lives in
tests/support/megatron_model.py; at scale the model comes from the NeMo checkpoint (the aligner layer).

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
expert-parallel (EP) group, and each expert over the expert-tensor-parallel group (ETP, = TP unless set). Their
``linear_fc2`` weight is row-parallel (dim 1) whatever its attribute says: megatron-core 0.10's TE wrappers
(``TELinear``, ``TEGroupedLinear``) leave an expert's communication to the token dispatcher and build TE's layer
with ``parallel_mode=None``, and TE then labels every weight ``partition_dim=0`` (its ``reset_parameters``: ``dim=1
if parallel_mode == "row" else 0``). So are the grouped-GEMM experts (``moe_grouped_gemm`` on the TE spec) and the
fp8 ones; the other TE-spec experts are megatron's own linears in 0.10, labelled right (0.11 builds every TE-spec
expert from TE's linears: the same rule covers them).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                      get_gpt_layer_with_transformer_engine_spec)

from nemo_dapo.megatron.qk_norm import with_torch_qk_norm
from nemo_dapo.megatron.te_check import qk_norm_is_apex, te_version


def gpt_layer_spec(*, num_experts: Optional[int] = None, moe_grouped_gemm: bool = False, qk_layernorm: bool = False,
                   use_te: bool = False, fp8=None):
    """megatron-core 0.10's GPT layer spec, Transformer Engine's (``use_te``) or its local one, with ``qk_layernorm``
    (Qwen3: a norm over ``head_dim`` on each query / key head, after the QKV projection, before RoPE).

    The QK-norm class is megatron-core's choice, which follows ``TransformerConfig.normalization``: TE spec ->
    ``TENorm`` (``te.pytorch.RMSNorm`` for "RMSNorm"; below TE 1.9 megatron-core takes apex's ``FusedLayerNorm``,
    which refuses RMSNorm at build time, so ``qk_norm.QKNorm`` is put there instead); local spec -> ``LNImpl`` =
    ``WrappedTorchNorm`` without apex (``torch.nn.RMSNorm``), apex's ``FusedLayerNorm`` with it (again refuses
    RMSNorm). Both are built with ``hidden_size = kv_channels``.
    Two fixes to 0.10's local spec: with experts it asks for TE's grouped linear (NameError without TE), so its MoE
    block is built with ``use_te=False``; and its checkpoint rename ``pre_mlp_layernorm. ->
    mlp.linear_fc1.layer_norm_`` (for TE's fused dense MLP) is dropped for MoE layers, whose TE spec keeps
    ``pre_mlp_layernorm`` as a module of its own, so a local-spec MoE checkpoint loads into the TE spec.
    """
    if use_te:
        layer = get_gpt_layer_with_transformer_engine_spec(num_experts, moe_grouped_gemm, qk_layernorm=qk_layernorm,
                                                           fp8=fp8)
        # below TE 1.9 megatron-core's QK-norm is apex's FusedLayerNorm, which refuses RMSNorm (qk_norm.py)
        return with_torch_qk_norm(layer) if qk_layernorm and qk_norm_is_apex(te_version()) else layer
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
    if expert is not None and tp_dim is not None and re.search(r"linear_fc2\.weight\d*$", name):
        tp_dim = 1  # TE labels it 0 (module doc)
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


def sequential_expert_name(full_name: str) -> str:
    """``full_name`` with a TE grouped-GEMM expert weight (``mlp.experts.linear_fc1.weight{j}``, TEGroupedMLP)
    spelled as SequentialMLP's (``mlp.experts.local_experts.{j}.linear_fc1.weight``); other names unchanged. The
    two hold the same tensor (one ``[out, in]`` GEMM per expert, split the same way), and megatron-core saves them
    under the same checkpoint keys (``TEGroupedMLP.sharded_state_dict``: "interchangeable with SequentialMLP's")."""
    m = _TE_EXPERT.search(full_name)
    if m is None:
        return full_name
    fc, kind, j = m.groups()
    return f"{full_name[:m.start()]}.mlp.experts.local_experts.{j}.{fc}.{kind}"


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
