"""Checkpoint conversion between Hugging Face causal LMs and megatron-core ``GPTModel`` state dicts.

Families (HF ``model_type``): ``llama`` (incl. SmolLM2), ``qwen2`` (QKV bias), ``mixtral`` (MoE), ``qwen2_moe``
(MoE + a sigmoid-gated shared expert, QKV bias), ``qwen3`` (QK-norm: an RMSNorm over ``head_dim`` on every query and
key head, ``head_dim`` independent of hidden / heads) and ``qwen3_moe`` (QK-norm + MoE, no shared expert). A config
is a transformers ``PretrainedConfig`` or, where the installed transformers lacks the family (4.47 has no Qwen3),
:func:`load_hf_config`'s reading of ``config.json``. Everything here is torch only; sharding for TP/PP/EP is in
``convert_shard``, building the matching megatron model in ``convert_build``.

Megatron names are those of a model built on ONE rank (TP = PP = EP = 1; layer and expert indices global), as
``GPTModel.state_dict()`` gives them, without the ``_extra_state`` entries. Two layer specs are targeted:

* ``spec="local"`` (megatron-core's own modules, ``get_gpt_layer_local_spec``; what runs on CPU): the norms are
  modules of their own, ``decoder.layers.{i}.input_layernorm.weight`` and ``...pre_mlp_layernorm.weight``;
* ``spec="te"`` (Transformer Engine): the norms are fused into the following linear,
  ``self_attention.linear_qkv.layer_norm_weight`` and ``mlp.linear_fc1.layer_norm_weight``; an MoE layer keeps
  ``pre_mlp_layernorm.weight`` (its experts cannot fuse it). TE's grouped-GEMM experts
  (``mlp.experts.linear_fc1.weight{j}``) are the same tensors under other names: the refit reads them as
  SequentialMLP's (``model.sequential_expert_name``), and megatron-core checkpoints both under the same keys.

Layouts (``h`` hidden, ``d`` head dim, ``nq`` query heads, ``ng`` key/value heads = query groups):

* ``linear_qkv.weight`` ``[(nq + 2 ng) d, h]``: per query group g, its ``nq/ng`` query heads, then k_g, then v_g
  (TP splits whole groups, ``ng % tp == 0``, so rank r's shard is the r-th contiguous row block). Biases alike.
* ``linear_fc1.weight`` ``[2 f, h]`` = ``[gate; up]`` for SwiGLU (megatron: ``silu(x W_gate) * (x W_up)``).
* QK-norm: ``self_attention.q_layernorm.weight`` / ``k_layernorm.weight`` ``[d]`` = HF ``self_attn.q_norm`` /
  ``k_norm`` (the same names under both specs; replicated over TP: every head shares them).
* experts: ``mlp.experts.local_experts.{j}.linear_fc{1,2}.weight`` (SequentialMLP), router ``mlp.router.weight``
  ``[E, h]``; Qwen2-MoE's shared expert ``mlp.shared_experts.linear_fc{1,2}.weight`` and its gate
  ``mlp.shared_experts.gate_weight`` ``[1, h]`` (output scaled by ``sigmoid(x . gate)``, as in HF).
* vocabulary rows of ``embedding.word_embeddings.weight`` / ``output_layer.weight`` are zero-padded to
  ``padded_vocab_size`` (megatron's convention: a multiple of ``divisible_by * tp``); the padded logits are
  zero (not -inf) and must be cut off before any softmax (``[..., :vocab_size]``). With tied embeddings the
  single-rank model has no ``output_layer.weight``.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Iterable, Iterator, Mapping

import torch
import torch.nn.functional as F

SPECS = ("local", "te")
_FAMILIES = ("llama", "qwen2", "mixtral", "qwen2_moe", "qwen3", "qwen3_moe")
_QK_NORM = ("qwen3", "qwen3_moe")
_EXTRA_STATE = "_extra_state"


@dataclass(frozen=True)
class HFArch:
    """What the conversion needs from a HF config (validated by :func:`hf_arch`)."""

    family: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_groups: int
    head_dim: int
    vocab_size: int
    tied: bool
    qkv_bias: bool
    linear_bias: bool  # o_proj and MLP biases (megatron's add_bias_linear)
    num_experts: int = 0
    shared_expert: bool = False
    qk_norm: bool = False


def _biases(hf_config, family: str) -> tuple:
    """(QKV bias, o_proj + MLP bias) of ``family``."""
    if family in ("qwen2", "qwen2_moe"):
        return True, False
    if family in _QK_NORM:
        if getattr(hf_config, "attention_bias", False):
            raise ValueError(f"hf_config: {family} with attention_bias=True (biased q/k/v AND o_proj, unbiased MLP) "
                             "has no megatron equivalent (add_bias_linear covers o_proj and the MLP together)")
        return False, False
    if family != "llama":
        return False, False
    qkv_bias, linear_bias = bool(hf_config.attention_bias), bool(getattr(hf_config, "mlp_bias", False))
    if qkv_bias != linear_bias:
        raise ValueError(f"hf_config: attention_bias={qkv_bias} with mlp_bias={linear_bias} has no megatron "
                         "equivalent (add_bias_linear covers o_proj and the MLP together); set them equal")
    return qkv_bias, linear_bias


def _experts(hf_config, family: str) -> tuple:
    """(number of routed experts, has a shared expert) of ``family``; (0, False) for dense models."""
    if family == "mixtral":
        return hf_config.num_local_experts, False
    if family not in ("qwen2_moe", "qwen3_moe"):
        return 0, False
    if getattr(hf_config, "mlp_only_layers", None) or getattr(hf_config, "decoder_sparse_step", 1) != 1:
        raise ValueError(f"hf_config: {family} with dense layers (mlp_only_layers / decoder_sparse_step != 1) is "
                         "not supported: megatron-core 0.10.0's SequentialMLP needs one FFN size for all layers")
    if family == "qwen3_moe":
        return hf_config.num_experts, False
    return hf_config.num_experts, bool(getattr(hf_config, "shared_expert_intermediate_size", 0))


def hf_arch(hf_config) -> HFArch:
    """Validate ``hf_config`` (a transformers ``PretrainedConfig``) and extract its architecture."""
    family = getattr(hf_config, "model_type", None)
    if family not in _FAMILIES:
        raise ValueError(f"hf_config.model_type={family!r} is not supported; use one of {_FAMILIES}")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hf_config.hidden_act={hf_config.hidden_act!r}: only SwiGLU (silu) MLPs are supported")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("hf_config.use_sliding_window=True: megatron-core's local attention has no sliding window")
    heads = hf_config.num_attention_heads
    groups = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % groups:
        raise ValueError(f"hf_config: num_attention_heads={heads} is not a multiple of num_key_value_heads={groups}")
    (qkv_bias, linear_bias), (experts, shared) = _biases(hf_config, family), _experts(hf_config, family)
    return HFArch(family=family, num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
                  num_heads=heads, num_groups=groups,
                  head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
                  vocab_size=hf_config.vocab_size, tied=bool(getattr(hf_config, "tie_word_embeddings", False)),
                  qkv_bias=qkv_bias, linear_bias=linear_bias, num_experts=experts, shared_expert=shared,
                  qk_norm=family in _QK_NORM)


# transformers' defaults (Qwen3Config / Qwen3MoeConfig, 4.51+) for keys a Qwen3 config.json may leave out
_JSON_DEFAULTS = {"qwen3": dict(attention_bias=False, hidden_act="silu", tie_word_embeddings=False,
                                use_sliding_window=False, attention_dropout=0.0, initializer_range=0.02,
                                rms_norm_eps=1e-6),
                  "qwen3_moe": dict(attention_bias=False, hidden_act="silu", tie_word_embeddings=False,
                                    use_sliding_window=False, attention_dropout=0.0, initializer_range=0.02,
                                    rms_norm_eps=1e-6, decoder_sparse_step=1, mlp_only_layers=[],
                                    norm_topk_prob=False)}


def load_hf_config(path: str):
    """The HF config of checkpoint directory (or ``config.json`` file) ``path`` as an attribute namespace, with
    transformers' defaults for the keys that Qwen3 configs may omit; needs no transformers (4.47 has no Qwen3).
    ``num_local_experts`` is read as ``num_experts`` (transformers 5 writes both)."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{file}: no config.json; pass a Hugging Face checkpoint directory") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    family = raw.get("model_type")
    if family not in _FAMILIES:
        raise ValueError(f"{file}: model_type={family!r} is not supported; use one of {_FAMILIES}")
    values = dict(_JSON_DEFAULTS.get(family, {}), **raw)
    if family == "qwen3_moe" and "num_experts" not in raw and "num_local_experts" in raw:
        values["num_experts"] = raw["num_local_experts"]
    return SimpleNamespace(**values)


def padded_vocab_size(vocab_size: int, tp: int = 1, divisible_by: int = 128) -> int:
    """Megatron's padded vocabulary: the next multiple of ``divisible_by * tp`` (>= ``vocab_size``)."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def check_padded_vocab(arch: HFArch, padded_vocab: int | None) -> int:
    """``padded_vocab`` (default: the HF vocabulary), refused if smaller than the HF vocabulary."""
    padded_vocab = padded_vocab or arch.vocab_size
    if padded_vocab < arch.vocab_size:
        raise ValueError(f"padded_vocab={padded_vocab} is smaller than hf_config.vocab_size={arch.vocab_size}")
    return padded_vocab


def _rope_parameters(hf_config) -> dict:
    """Rope settings under either transformers layout: 4.x keeps ``rope_theta`` and ``rope_scaling`` as attributes,
    5.x moves both into ``rope_parameters``; a silent default of 10000 would corrupt every converted model."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    params.update(getattr(hf_config, "rope_scaling", None) or {})
    theta = getattr(hf_config, "rope_theta", None)
    if theta is not None:
        params.setdefault("rope_theta", theta)
    return params


def _rope_kwargs(hf_config) -> dict:
    scaling = {k: v for k, v in _rope_parameters(hf_config).items() if k != "rope_theta"}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return {}
    if kind == "linear":
        return {"seq_len_interpolation_factor": float(scaling["factor"])}
    llama31 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    if kind == "llama3" and all(float(scaling.get(k, -1)) == v for k, v in llama31.items()):
        return {"rope_scaling": True}  # megatron-core's rope_scaling hard-codes exactly these numbers
    raise ValueError(f"hf_config.rope_scaling={scaling!r} has no megatron-core equivalent (supported: default, "
                     f"linear, llama3 with {llama31})")


def megatron_config_from_hf(hf_config) -> dict:
    """``TransformerConfig`` keyword arguments describing the same network as ``hf_config``.

    Only architecture fields (sizes, norm, eps, activation, biases, MoE routing); parallel sizes, dtypes, fusions
    and training knobs are the caller's. MoE routing: Mixtral renormalises the top-k softmax, which equals
    megatron's top-k-then-softmax (``moe_router_pre_softmax=False``); Qwen2-MoE with ``norm_topk_prob=False`` takes
    the top-k of the full softmax (``moe_router_pre_softmax=True``). ``moe_shared_expert_gate`` is a
    TransformerConfig field in newer megatron-core (0.16.1) but not in 0.10.0, where ``convert_build`` moves it
    into the layer spec.
    """
    arch = hf_arch(hf_config)
    kw = dict(num_layers=arch.num_layers, hidden_size=arch.hidden_size, num_attention_heads=arch.num_heads,
              num_query_groups=arch.num_groups, kv_channels=arch.head_dim, ffn_hidden_size=hf_config.intermediate_size,
              normalization="RMSNorm", layernorm_epsilon=float(hf_config.rms_norm_eps), gated_linear_unit=True,
              activation_func=F.silu, add_bias_linear=arch.linear_bias, add_qkv_bias=arch.qkv_bias,
              attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0)), hidden_dropout=0.0,
              init_method_std=float(getattr(hf_config, "initializer_range", 0.02)), qk_layernorm=arch.qk_norm)
    if arch.family == "mixtral":
        kw.update(num_moe_experts=arch.num_experts, moe_router_topk=hf_config.num_experts_per_tok,
                  moe_router_pre_softmax=False, moe_ffn_hidden_size=hf_config.intermediate_size)
    elif arch.family in ("qwen2_moe", "qwen3_moe"):
        pre_softmax = not hf_config.norm_topk_prob
        if not pre_softmax and hf_config.num_experts_per_tok == 1:
            pre_softmax = True  # top-1 renormalised is weight 1 either way; megatron demands pre-softmax for k=1
        kw.update(num_moe_experts=arch.num_experts, moe_router_topk=hf_config.num_experts_per_tok,
                  moe_router_pre_softmax=pre_softmax, ffn_hidden_size=hf_config.moe_intermediate_size,
                  moe_ffn_hidden_size=hf_config.moe_intermediate_size)
        if arch.shared_expert:
            kw.update(moe_shared_expert_intermediate_size=hf_config.shared_expert_intermediate_size,
                      moe_shared_expert_gate=True)
    return kw


def gpt_model_kwargs_from_hf(hf_config, *, padded_vocab: int | None = None) -> dict:
    """``GPTModel`` keyword arguments (besides config, spec, pre/post_process) for ``hf_config``.

    ``padded_vocab``: the (padded) vocabulary the model is built with, see :func:`padded_vocab_size`; default the
    HF vocabulary unpadded. Rope: ``rope_theta`` -> ``rotary_base``, ``partial_rotary_factor`` -> ``rotary_percent``
    and the scaling of :func:`_rope_kwargs`; tied embeddings -> ``share_embeddings_and_output_weights``.
    """
    arch = hf_arch(hf_config)
    return dict(vocab_size=check_padded_vocab(arch, padded_vocab),
                max_sequence_length=hf_config.max_position_embeddings, position_embedding_type="rope",
                rotary_base=float(_rope_parameters(hf_config).get("rope_theta", 10000.0)),
                rotary_percent=float(getattr(hf_config, "partial_rotary_factor", 1.0)),
                share_embeddings_and_output_weights=arch.tied, **_rope_kwargs(hf_config))


# ---------------------------------------------------------------------------------------------------------------
# the name map: one rule per megatron tensor, used in both directions
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rule:
    """Megatron tensor ``mc`` is made of the HF tensors ``hf`` by ``kind``: ``copy`` (one tensor), ``vocab``
    (one tensor, rows padded), ``qkv`` (q, k, v fused per query group), ``fc1`` ([gate; up])."""

    mc: str
    hf: tuple
    kind: str


def _mlp_rules(mc: str, hf: str, names: tuple, bias: bool) -> list:
    gate, up, down = (f"{hf}.{n}" for n in names)
    rules = [Rule(f"{mc}.linear_fc1.weight", (f"{gate}.weight", f"{up}.weight"), "fc1"),
             Rule(f"{mc}.linear_fc2.weight", (f"{down}.weight",), "copy")]
    if bias:
        rules += [Rule(f"{mc}.linear_fc1.bias", (f"{gate}.bias", f"{up}.bias"), "fc1"),
                  Rule(f"{mc}.linear_fc2.bias", (f"{down}.bias",), "copy")]
    return rules


def _layer_rules(arch: HFArch, i: int, spec: str) -> list:
    hf, mc = f"model.layers.{i}", f"decoder.layers.{i}"
    attn, moe = f"{hf}.self_attn", arch.num_experts > 0
    in_norm = f"{mc}.self_attention.linear_qkv.layer_norm_weight" if spec == "te" else f"{mc}.input_layernorm.weight"
    fused_mlp_norm = spec == "te" and not moe
    mlp_norm = f"{mc}.mlp.linear_fc1.layer_norm_weight" if fused_mlp_norm else f"{mc}.pre_mlp_layernorm.weight"
    rules = [Rule(in_norm, (f"{hf}.input_layernorm.weight",), "copy"),
             Rule(f"{mc}.self_attention.linear_qkv.weight", tuple(f"{attn}.{p}_proj.weight" for p in "qkv"), "qkv"),
             Rule(f"{mc}.self_attention.linear_proj.weight", (f"{attn}.o_proj.weight",), "copy"),
             Rule(mlp_norm, (f"{hf}.post_attention_layernorm.weight",), "copy")]
    if arch.qk_norm:
        rules += [Rule(f"{mc}.self_attention.{p}_layernorm.weight", (f"{attn}.{p}_norm.weight",), "copy") for p in "qk"]
    if arch.qkv_bias:
        qkv_bias = tuple(f"{attn}.{p}_proj.bias" for p in "qkv")
        rules.append(Rule(f"{mc}.self_attention.linear_qkv.bias", qkv_bias, "qkv"))
    if arch.linear_bias:
        rules.append(Rule(f"{mc}.self_attention.linear_proj.bias", (f"{attn}.o_proj.bias",), "copy"))
    proj = ("gate_proj", "up_proj", "down_proj")
    if not moe:
        return rules + _mlp_rules(f"{mc}.mlp", f"{hf}.mlp", proj, arch.linear_bias)
    block, expert_proj = (f"{hf}.block_sparse_moe", ("w1", "w3", "w2")) if arch.family == "mixtral" else (
        f"{hf}.mlp", proj)
    rules.append(Rule(f"{mc}.mlp.router.weight", (f"{block}.gate.weight",), "copy"))
    for j in range(arch.num_experts):
        rules += _mlp_rules(f"{mc}.mlp.experts.local_experts.{j}", f"{block}.experts.{j}", expert_proj, False)
    if arch.shared_expert:
        rules += _mlp_rules(f"{mc}.mlp.shared_experts", f"{block}.shared_expert", proj, False)
        rules.append(Rule(f"{mc}.mlp.shared_experts.gate_weight", (f"{block}.shared_expert_gate.weight",), "copy"))
    return rules


def conversion_rules(arch: HFArch, spec: str = "local") -> list:
    """Every megatron tensor of the single-rank model with the HF tensors it is made of, in model order."""
    if spec not in SPECS:
        raise ValueError(f"spec={spec!r}: use one of {SPECS}")
    rules = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab")]
    for i in range(arch.num_layers):
        rules += _layer_rules(arch, i, spec)
    rules.append(Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "copy"))
    if not arch.tied:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",), "vocab"))
    return rules


# ---------------------------------------------------------------------------------------------------------------
# tensor transforms
# ---------------------------------------------------------------------------------------------------------------

def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_groups: int) -> torch.Tensor:
    """HF q ``[nq d, ...]``, k, v ``[ng d, ...]`` -> megatron's ``[(nq + 2 ng) d, ...]`` grouped [q_g..., k_g, v_g]."""
    tail = q.shape[1:]
    grouped = [t.reshape(num_groups, -1, *tail) for t in (q, k, v)]
    return torch.cat(grouped, dim=1).reshape(-1, *tail)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_groups: int, head_dim: int) -> tuple:
    """Inverse of :func:`fuse_qkv`: (q, k, v) in HF layout."""
    tail = qkv.shape[1:]
    per_group = qkv.reshape(num_groups, -1, *tail)
    q, k, v = per_group.split([num_heads // num_groups * head_dim, head_dim, head_dim], dim=1)
    return tuple(t.reshape(-1, *tail).contiguous() for t in (q, k, v))


def megatron_tensor(rule: Rule, hf_state: Mapping, arch: HFArch, padded_vocab: int) -> torch.Tensor:
    """The megatron tensor of ``rule`` from the HF tensors it names (read from ``hf_state`` only now, so a lazy
    mapping over checkpoint files is read tensor by tensor)."""
    missing = [n for n in rule.hf if n not in hf_state]
    if missing:
        raise KeyError(f"{missing} missing from the HF state dict (needed for {rule.mc!r}); does it match the HF "
                       f"config ({arch.family}, {arch.num_layers} layers)?")
    parts = [hf_state[n] for n in rule.hf]
    if rule.kind == "qkv":
        return fuse_qkv(*parts, arch.num_groups)
    if rule.kind == "fc1":
        return torch.cat(parts, dim=0)
    if rule.kind == "vocab" and padded_vocab > parts[0].shape[0]:
        pad = parts[0].new_zeros(padded_vocab - parts[0].shape[0], *parts[0].shape[1:])
        return torch.cat([parts[0], pad], dim=0)
    return parts[0]


def _to_hf(rule: Rule, tensor: torch.Tensor, arch: HFArch) -> tuple:
    if rule.kind == "qkv":
        return split_qkv(tensor, arch.num_heads, arch.num_groups, arch.head_dim)
    if rule.kind == "fc1":
        return tuple(t.contiguous() for t in tensor.chunk(2, dim=0))
    if rule.kind == "vocab":
        return (tensor[:arch.vocab_size],)
    return (tensor,)


# ---------------------------------------------------------------------------------------------------------------
# megatron -> HF, tensor by tensor
# ---------------------------------------------------------------------------------------------------------------

def megatron_to_hf_items(items: Iterable, hf_config, *, spec: str = "local") -> Iterator:
    """HF tensors of megatron ones: (megatron full name, tensor) -> (HF name, tensor) pairs, one megatron tensor
    at a time (a refit stream, a checkpoint export; un-padded vocabulary, no ``lm_head.weight`` when tied).
    ``_extra_state`` entries are skipped; unknown names are an error."""
    arch = hf_arch(hf_config)
    by_name = {rule.mc: rule for rule in conversion_rules(arch, spec)}
    tied_output = "output_layer.weight" if arch.tied else None
    for name, tensor in items:
        if name.endswith(_EXTRA_STATE) or name == tied_output:  # tied copy on the last pipeline stage
            continue
        rule = by_name.get(name)
        if rule is None:
            raise KeyError(f"megatron_to_hf: {name!r} is not a tensor of the {arch.family} map (spec={spec!r})")
        yield from zip(rule.hf, _to_hf(rule, tensor, arch))
