"""The per-rank state dicts of a TP x PP x EP layout: ``hf_to_megatron_shard`` converts a HF checkpoint straight
into one rank's state dict, reading only its tensors; ``tp_shard`` / ``tp_unshard`` cut and join one tensor. Torch
only: the split rules come from the parameter names, not from a built model.

Per-rank names are those of ``GPTModel.state_dict()`` on that rank (local layer and expert indices; no
``_extra_state`` entries: megatron's linears fill those in on load). Rules, for the local (and TE) spec names of
``convert``:

* PP: stage p holds layers ``[p L/pp, (p+1) L/pp)`` renumbered from 0 (megatron-core's even split; uneven first /
  last stages are not covered); the embedding lives on the first stage, ``final_layernorm`` and ``output_layer`` on
  the last. With tied embeddings and PP > 1 the last stage also holds ``output_layer.weight``, a copy of the
  embedding (megatron keeps it in sync through the embedding group).
* EP: expert ``e`` lives on EP rank ``e // (E/ep)`` as local expert ``e % (E/ep)``.
* TP (experts: expert-TP, ``etp``, equal to TP unless set to 1): column-parallel weights and biases
  (``linear_qkv``, ``linear_fc1``, vocabulary rows of the embedding / output layer) split along dim 0, row-parallel
  weights (``linear_proj``, ``linear_fc2``) along dim 1; everything else (norms, row-parallel biases, the router,
  the shared-expert gate) is replicated. ``linear_qkv`` rows are grouped per query group, so contiguous row blocks
  are whole groups (needs ``num_query_groups % tp == 0``). A gated ``linear_fc1`` ``[gate; up]`` is split with
  stride 2: rank r holds ``[gate_r; up_r]``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from nemo_dapo.megatron.convert import check_padded_vocab, conversion_rules, hf_arch, megatron_tensor

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^(mlp\.experts\.local_experts\.)(\d+)\.(.*)$")
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")
_EMBEDDING, _OUTPUT = _VOCAB


@dataclass(frozen=True)
class Parallel:
    """Model-parallel sizes. ``etp``: expert tensor-parallel size, None = ``tp`` (megatron-core's default)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: Optional[int] = None

    def __post_init__(self):
        if min(self.tp, self.pp, self.ep, self.etp or 1) < 1:
            raise ValueError(f"{self}: every size must be >= 1")
        if self.etp not in (None, 1, self.tp):
            raise ValueError(f"{self}: etp must be 1 or equal to tp (other expert-TP sizes are not covered)")

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp


def tp_split_rule(name: str, gated: bool = True) -> tuple:
    """(dim, stride) of the tensor-parallel split of megatron tensor ``name``; dim None = replicated."""
    if name in _VOCAB:
        return 0, 1
    module, _, param = name.rpartition(".")
    module = module.rpartition(".")[2]
    if param in ("weight", "bias") and module == "linear_qkv":
        return 0, 1
    if param in ("weight", "bias") and module == "linear_fc1":
        return 0, 2 if gated else 1
    if param == "weight" and module in ("linear_proj", "linear_fc2"):
        return 1, 1
    return None, 1


def tp_shard(full: torch.Tensor, dim: int, stride: int, size: int, rank: int, *, name: str = "") -> torch.Tensor:
    """Rank ``rank``'s slice: ``full`` cut into ``stride * size`` blocks along ``dim``; rank r keeps blocks
    r, size + r, ... (stride 1: the r-th contiguous block, returned as a VIEW of ``full``; stride > 1: a new
    tensor). A caller that keeps the slice beyond ``full`` (a state dict to save) clones it."""
    if full.shape[dim] % (size * stride):
        raise ValueError(f"{name or 'tensor'}: dim {dim} of size {full.shape[dim]} does not split into {size} "
                         f"tensor-parallel shards x {stride} block(s); pick a TP size that divides it")
    blocks = full.chunk(size * stride, dim)
    if stride == 1:
        return blocks[rank]
    return torch.cat([blocks[k * size + rank] for k in range(stride)], dim)


def tp_unshard(shards: list, dim: int, stride: int) -> torch.Tensor:
    """Inverse of :func:`tp_shard` from the slices of ranks 0 .. size-1."""
    if stride == 1:
        return torch.cat(shards, dim)
    blocks = [s.chunk(stride, dim) for s in shards]
    return torch.cat([blocks[r][k] for k in range(stride) for r in range(len(shards))], dim)


def _counts(full: Mapping) -> tuple:
    layers, experts = set(), set()
    for name in full:
        m = _LAYER.match(name)
        if m:
            layers.add(int(m.group(1)))
            e = _EXPERT.match(m.group(2))
            if e:
                experts.add(int(e.group(2)))
    return len(layers), len(experts)


@dataclass(frozen=True)
class _Rank:
    """Where one rank sits in a layout of a model with ``num_layers`` layers and ``num_experts`` experts."""

    parallel: Parallel
    tp_rank: int
    pp_rank: int
    ep_rank: int
    num_layers: int
    num_experts: int

    def __post_init__(self):
        p = self.parallel
        for what, r, size in (("tp_rank", self.tp_rank, p.tp), ("pp_rank", self.pp_rank, p.pp),
                              ("ep_rank", self.ep_rank, p.ep)):
            if not 0 <= r < size:
                raise ValueError(f"{what}={r} is outside [0, {size}) for {p}")
        if self.num_layers % p.pp or self.num_experts % p.ep or (p.ep > 1 and not self.num_experts):
            raise ValueError(f"{p} does not fit a model with {self.num_layers} layers and {self.num_experts} "
                             "experts: pp must divide the layers and ep the experts")

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.parallel.pp - 1

    def local_name(self, name: str) -> tuple:
        """(this rank's name for full name ``name`` or None if another rank holds it, is an expert tensor)."""
        m = _LAYER.match(name)
        if not m:
            held = self.pp_rank == 0 if name.startswith("embedding.") else self.last_stage
            return (name if held else None), False
        per_stage = self.num_layers // self.parallel.pp
        layer, rest = int(m.group(1)) - self.pp_rank * per_stage, m.group(2)
        if not 0 <= layer < per_stage:
            return None, False
        e = _EXPERT.match(rest)
        if e:
            per_ep = self.num_experts // self.parallel.ep
            j = int(e.group(2)) - self.ep_rank * per_ep
            if not 0 <= j < per_ep:
                return None, True
            rest = f"{e.group(1)}{j}.{e.group(3)}"
        return f"decoder.layers.{layer}.{rest}", bool(e)

    def cut(self, name: str, tensor: torch.Tensor, expert: bool, gated: bool) -> torch.Tensor:
        """This rank's (expert-)tensor-parallel slice of full tensor ``name`` (a copy)."""
        dim, stride = tp_split_rule(name, gated)
        if dim is None:
            return tensor.clone()
        p = self.parallel
        size, rank = (p.expert_tp, self.tp_rank if p.expert_tp == p.tp else 0) if expert else (p.tp, self.tp_rank)
        piece = tp_shard(tensor, dim, stride, size, rank, name=name)
        return piece.clone() if stride == 1 else piece  # a view would keep (and torch.save write) the whole tensor


def hf_to_megatron_shard(hf_state: Mapping, hf_config, parallel: Parallel, *, tp_rank: int = 0, pp_rank: int = 0,
                         ep_rank: int = 0, padded_vocab: Optional[int] = None, spec: str = "local") -> dict:
    """This rank's megatron state dict converted from a HF one, only its own tensors: with a lazy
    ``hf_state`` (e.g. a mapping over safetensors files) each rank reads just the HF tensors it holds, one megatron
    tensor at a time. It does not check for HF tensors outside the map (the tests' whole-dict reference,
    tests/support/megatron_convert.py, does)."""
    arch = hf_arch(hf_config)
    padded_vocab = check_padded_vocab(arch, padded_vocab)
    rank = _Rank(parallel, tp_rank, pp_rank, ep_rank, arch.num_layers, arch.num_experts)
    rules, out = conversion_rules(arch, spec), {}
    for rule in rules:
        local, expert = rank.local_name(rule.mc)
        if local is not None:
            out[local] = rank.cut(rule.mc, megatron_tensor(rule, hf_state, arch, padded_vocab), expert, True)
    if arch.tied and rank.last_stage and parallel.pp > 1:
        embedding = next(r for r in rules if r.mc == _EMBEDDING)
        out[_OUTPUT] = rank.cut(_EMBEDDING, megatron_tensor(embedding, hf_state, arch, padded_vocab), False, True)
    return out


def _global_name(local: str, pp_rank: int, per_stage: int, ep_rank: int, per_ep: int) -> tuple:
    """(full name, is expert) of a per-rank name."""
    m = _LAYER.match(local)
    if not m:
        return local, False
    rest, e = m.group(2), _EXPERT.match(m.group(2))
    if e:
        rest = f"{e.group(1)}{int(e.group(2)) + ep_rank * per_ep}.{e.group(3)}"
    return f"decoder.layers.{int(m.group(1)) + pp_rank * per_stage}.{rest}", bool(e)
