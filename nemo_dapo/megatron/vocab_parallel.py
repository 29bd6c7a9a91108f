"""Taken-token log-prob and entropy from a vocabulary-parallel output layer, without gathering the vocabulary.

Megatron's output layer is a ColumnParallelLinear: tensor-parallel (TP) rank r holds rows
``[r * V_local, (r + 1) * V_local)`` of the weight [V, H] (V padded to a multiple of the TP size), and its logits are
the matching shard [..., V_local]. Gathering them to [..., V] (what NeMo-Aligner's entropy does) costs
tokens x V x 4 bytes per rank; here every rank keeps its shard and the softmax statistics are combined with one max
and one sum all-reduce of a few numbers per token, over the TP group only. The chunked math lives in
``nemo_dapo.core.logprobs``; this module only supplies the collectives.

Gradient collectives, mirroring ColumnParallelLinear: the hidden states are replicated over TP, and each rank's
gradient w.r.t. them is a partial sum over its vocabulary rows, so backward all-reduces it over TP (the role of
``copy_to_tensor_model_parallel_region``). With sequence parallelism the hidden states come from
``gather_from_sequence_parallel_region``, whose backward reduce-scatters, i.e. already sums the partials: pass
``reduce_grad_hidden=False`` there or the gradient is counted TP times. The weight shard's gradient is local.
Rows that pad the vocabulary to a multiple of the TP size take part in the softmax, as in megatron's own
``vocab_parallel_cross_entropy``, unless ``valid_vocab`` (the engine's vocabulary size, e.g. the Hugging Face
config's ``vocab_size``) says where the real vocabulary ends: then they are left out, as the rollout engine does.

Works with megatron-core 0.10.0 (the version NeMo-Aligner 0.7.0 pins) and 0.16.1: it uses only
``parallel_state.get_tensor_model_parallel_group``.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from nemo_dapo.core.logprobs import VocabShard, fused_logprobs_entropy, logits_logprobs_entropy


def tp_vocab_shard(v_local: int, group: Optional[dist.ProcessGroup] = None, *,
                   reduce_grad_hidden: bool = True, valid_vocab: Optional[int] = None) -> VocabShard:
    """The :class:`VocabShard` of this rank for a vocabulary split evenly over ``group`` (default: megatron's TP
    group). ``v_local`` is the number of vocabulary rows on this rank; ids >= ``valid_vocab`` are padding."""
    if group is None:
        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError("megatron's model parallel state is not initialised: call "
                               "parallel_state.initialize_model_parallel(...) first, or pass group=")
        group = parallel_state.get_tensor_model_parallel_group()
    world = dist.get_world_size(group)
    if world == 1:
        return VocabShard(start=0, vocab_size=v_local, valid_vocab=valid_vocab)

    def all_reduce_max(t: torch.Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)

    def all_reduce_sum(t: torch.Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)

    shard = VocabShard(start=dist.get_rank(group) * v_local, vocab_size=v_local * world,
                       all_reduce_max=all_reduce_max, all_reduce_sum=all_reduce_sum, valid_vocab=valid_vocab)
    return replace(shard, reduce_grad_hidden=all_reduce_sum) if reduce_grad_hidden else shard


def vocab_parallel_logprobs_entropy(hidden: torch.Tensor, weight_shard: torch.Tensor, targets: torch.Tensor, *,
                                    mask: Optional[torch.Tensor] = None, chunk_size: int = 1024,
                                    temperature: float = 1.0, group: Optional[dist.ProcessGroup] = None,
                                    reduce_grad_hidden: bool = True,
                                    valid_vocab: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of ``targets`` and entropy under ``softmax(hidden @ W.T / temperature)``, W split over TP.

    hidden [..., H] (e.g. megatron's [S, B, H]; identical on every TP rank), weight_shard [V/tp, H] (e.g.
    ``output_layer.weight`` or, with tied embeddings, ``shared_embedding_or_output_weight()``), targets [...] ids in
    the full vocabulary, ``mask`` [...] as in ``core.logprobs.fused_logprobs_entropy``. Returns fp32
    ``(logp [...], entropy [...])``, identical on every TP rank. Peak extra memory ~3 x chunk_size x V/tp x 4 bytes.
    """
    shard = tp_vocab_shard(weight_shard.shape[0], group, reduce_grad_hidden=reduce_grad_hidden,
                           valid_vocab=valid_vocab)
    return fused_logprobs_entropy(hidden, weight_shard, targets, mask=mask, chunk_size=chunk_size,
                                  temperature=temperature, shard=shard)


def vocab_parallel_logits_logprobs_entropy(logits_shard: torch.Tensor, targets: torch.Tensor, *,
                                           chunk_size: int = 1024, temperature: float = 1.0,
                                           group: Optional[dist.ProcessGroup] = None,
                                           valid_vocab: Optional[int] = None
                                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same from vocab-parallel logits [..., V/tp] that already exist (e.g. GPTModel's output without labels,
    [S, B, V/tp]); targets [...]. Its backward is local: the output layer's own backward does the TP all-reduce."""
    if logits_shard.shape[:-1] != targets.shape:
        raise ValueError(f"logits_shard {tuple(logits_shard.shape)} must be targets' shape {tuple(targets.shape)} "
                         f"plus a vocabulary dim")
    shard = tp_vocab_shard(logits_shard.shape[-1], group, valid_vocab=valid_vocab)
    logp, ent = logits_logprobs_entropy(logits_shard.reshape(-1, logits_shard.shape[-1]), targets.reshape(-1),
                                        chunk_size=chunk_size, temperature=temperature, shard=shard)
    return logp.view(targets.shape), ent.view(targets.shape)
