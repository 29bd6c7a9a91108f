"""Whole single-rank state dicts for the conversion tests: HF <-> megatron-core in one piece (with every tensor
checked against the name map), and the cut into / merge from the per-rank state dicts of a TP x PP x EP layout. The
product converts shard by shard (``convert_shard.hf_to_megatron_shard``, ``convert_ckpt``); these are the
references it is compared with. Torch only."""
from __future__ import annotations

from collections import defaultdict
from typing import Mapping

import torch

from nemo_dapo.megatron.convert import (check_padded_vocab, conversion_rules, hf_arch, megatron_tensor,
                                        megatron_to_hf_items)
from nemo_dapo.megatron.convert_shard import (_EMBEDDING, _OUTPUT, Parallel, _counts, _global_name, _Rank,
                                              tp_split_rule, tp_unshard)


def hf_to_megatron(hf_state: Mapping, hf_config, *, padded_vocab: int | None = None, spec: str = "local") -> dict:
    """Single-rank megatron state dict from a HF state dict (``model.state_dict()`` or the checkpoint's tensors).

    ``padded_vocab``: rows of the embedding / output layer after zero padding (default: no padding). With tied
    embeddings ``lm_head.weight`` may be present but must equal the embedding. Every HF tensor must be used: an
    unknown key is an error (a config / checkpoint mismatch), as is a missing one. Tensors that need no
    rearranging (norms, ``o_proj``, ``down_proj``, the router) are the HF tensors themselves, not copies.
    """
    arch = hf_arch(hf_config)
    padded_vocab = check_padded_vocab(arch, padded_vocab)
    out, used = {}, set()
    for rule in conversion_rules(arch, spec):
        out[rule.mc] = megatron_tensor(rule, hf_state, arch, padded_vocab)
        used.update(rule.hf)
    if arch.tied and "lm_head.weight" in hf_state:
        if not torch.equal(hf_state["lm_head.weight"], hf_state["model.embed_tokens.weight"]):
            raise ValueError("hf_to_megatron: hf_config.tie_word_embeddings=True but lm_head.weight differs from "
                             "model.embed_tokens.weight; fix the config")
        used.add("lm_head.weight")
    unused = sorted(set(hf_state) - used)
    if unused:
        raise KeyError(f"hf_to_megatron: HF tensors not covered by the {arch.family} map: {unused[:8]}"
                       f"{' ...' if len(unused) > 8 else ''}")
    return out


def megatron_to_hf(mc_state: Mapping, hf_config, *, spec: str = "local") -> dict:
    """HF state dict (un-padded vocabulary, as ``save_pretrained`` writes it: no ``lm_head.weight`` when tied)
    from a single-rank megatron state dict. Every megatron tensor of the map must be present."""
    arch = hf_arch(hf_config)
    missing = [r.mc for r in conversion_rules(arch, spec) if r.mc not in mc_state]
    if missing:
        raise KeyError(f"megatron_to_hf: {missing[:8]} missing from the megatron state dict; merge the shards "
                       "first (merge_state_dicts) or check spec=")
    return dict(megatron_to_hf_items(mc_state.items(), hf_config, spec=spec))


def shard_state_dict(full: Mapping, parallel: Parallel, *, tp_rank: int = 0, pp_rank: int = 0, ep_rank: int = 0,
                     gated: bool = True) -> dict:
    """The state dict of rank (tp_rank, pp_rank, ep_rank) from the single-rank state dict ``full``.

    ``gated``: the MLPs are SwiGLU (``linear_fc1`` = [gate; up]). Tied embeddings are recognised by the absence of
    ``output_layer.weight`` in ``full``. The returned tensors are copies.
    """
    rank = _Rank(parallel, tp_rank, pp_rank, ep_rank, *_counts(full))
    out = {}
    for name, tensor in full.items():
        local, expert = rank.local_name(name)
        if local is not None and not name.endswith("_extra_state"):
            out[local] = rank.cut(name, tensor, expert, gated)
    if rank.last_stage and parallel.pp > 1 and _OUTPUT not in full:  # tied: the last stage's embedding copy
        out[_OUTPUT] = rank.cut(_EMBEDDING, full[_EMBEDDING], False, gated)
    return out


def merge_state_dicts(shards: Mapping, parallel: Parallel, *, gated: bool = True, tied: bool = False) -> dict:
    """The single-rank state dict from per-rank ones, ``shards[(tp_rank, pp_rank, ep_rank)]`` (every rank of the
    layout). Replicated tensors (and TP shards repeated over EP) must agree exactly across ranks, else ValueError.
    ``tied``: the model shares embedding and output weights; the last stage's copy is checked and dropped."""
    p = parallel
    want = {(t, s, e) for t in range(p.tp) for s in range(p.pp) for e in range(p.ep)}
    if set(shards) != want:
        raise ValueError(f"merge_state_dicts: shards for {p} must be keyed by every (tp_rank, pp_rank, ep_rank); "
                         f"missing {sorted(want - set(shards))[:4]}, unexpected {sorted(set(shards) - want)[:4]}")
    per_stage, per_ep = _counts(shards[(0, 0, 0)])
    pieces = defaultdict(dict)  # full name -> {tp rank: [tensor from each ep rank / replica]}
    for (t, s, e), state in shards.items():
        for local, tensor in state.items():
            if local.endswith("_extra_state"):
                continue
            name, expert = _global_name(local, s, per_stage, e, per_ep)
            rank = t if not expert or p.expert_tp == p.tp else 0
            pieces[name].setdefault(rank, []).append((tensor, (t, s, e)))
    full = {}
    for name, by_rank in pieces.items():
        dim, stride = tp_split_rule(name, gated)
        groups = [[c for r in sorted(by_rank) for c in by_rank[r]]] if dim is None else list(by_rank.values())
        for copies in groups:  # copies that must be identical
            for tensor, where in copies[1:]:
                if not torch.equal(tensor, copies[0][0]):
                    raise ValueError(f"merge_state_dicts: {name!r} differs between ranks {copies[0][1]} and {where} "
                                     "although it is replicated there")
        firsts = [by_rank[r][0][0] for r in sorted(by_rank)]
        full[name] = firsts[0].clone() if dim is None else tp_unshard(firsts, dim, stride)
    if tied and _OUTPUT in full:
        if not torch.equal(full[_OUTPUT], full[_EMBEDDING]):
            raise ValueError("merge_state_dicts: tied=True but the last stage's output_layer.weight differs from the "
                             "embedding")
        del full[_OUTPUT]
    return full
