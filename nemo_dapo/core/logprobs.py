"""Log-prob of the taken token and entropy of the next-token distribution, without materialising the logits.

For hidden states ``h`` [N, H] and an output layer ``W`` [V, H] the logits are ``z = h @ W.T / temperature`` [N, V].
A policy-gradient loss needs two numbers per token from them: ``logp = log_softmax(z)[target]`` and the entropy
``-sum(softmax(z) * log_softmax(z))``. At N = 8k tokens and V = 152k the fp32 logits alone take 5 GB, and autograd
keeps several tensors of that size for backward. Here the tokens are processed in chunks: forward keeps only the
per-token log-sum-exp and entropy (8 bytes a token) and backward recomputes each chunk's logits, so no tensor larger
than ``chunk_size x V`` ever exists.

All softmax arithmetic is fp32 (fp64 for fp64 inputs), whatever the dtype of ``h`` and ``W`` (their matmuls run in
their own dtype, like the reference's); outputs are fp32 (fp64 for fp64 inputs).

Vocabulary sharding (tensor parallelism): the same code runs when ``W`` holds only the rows
``[start, start + V_local)`` of the full output layer. A :class:`VocabShard` says where the shard sits and injects
the reductions that combine the per-shard partial results; core itself never calls ``torch.distributed``.

Vocabulary padding: Megatron pads the output layer to a multiple of 128 x TP rows, and those rows are trained like
the others, so by default they take part in the softmax (as in megatron's ``vocab_parallel_cross_entropy``). A
rollout engine built from the Hugging Face checkpoint has no such rows and samples from a softmax over the real
vocabulary only; ``VocabShard.valid_vocab`` excludes the padding rows so that training log-probs and the engine's
describe the same distribution (else every importance ratio is off by the probability mass on the padding).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

Reduce = Callable[[torch.Tensor], None]  # reduces a tensor IN PLACE across the shards


def _no_reduce(t: torch.Tensor) -> None:
    return None


@dataclass(frozen=True)
class VocabShard:
    """Where this process's rows of the output layer sit in the full vocabulary, and how shards combine.

    ``start``: index of the shard's first row in the full vocabulary. ``vocab_size``: full V (None: unsharded).
    ``all_reduce_max`` / ``all_reduce_sum``: in-place max / sum over the shards of a small per-token fp32 tensor.
    ``reduce_grad_hidden``: in-place reduction of the fp32 gradient w.r.t. the hidden states, which every shard
    computes only partially (sum over its vocabulary rows). With tensor parallelism the hidden states are replicated,
    so this is a sum over the shards; leave it a no-op when something outside sums the partials (e.g. the
    reduce-scatter in the backward of a sequence-parallel gather).
    ``valid_vocab``: ids >= it are vocabulary padding, left out of the softmax (None: every row counts).
    """

    start: int = 0
    vocab_size: Optional[int] = None
    all_reduce_max: Reduce = _no_reduce
    all_reduce_sum: Reduce = _no_reduce
    reduce_grad_hidden: Reduce = _no_reduce
    valid_vocab: Optional[int] = None


_UNSHARDED = VocabShard()
# a finite "minus infinity": exp() of it is 0 and 0 * it is 0, so the entropy sums stay NaN-free
_PADDING_LOGIT = -1e30


def _drop_padding(z: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """Set the logits of this shard's padding rows (global id >= ``shard.valid_vocab``) to ``_PADDING_LOGIT``."""
    if shard.valid_vocab is not None:
        cut = max(shard.valid_vocab - shard.start, 0)
        if cut < z.shape[1]:
            z[:, cut:] = _PADDING_LOGIT
    return z


# ---------------------------------------------------------------------------------------------------------------
# per-chunk math shared by the two autograd functions; ``z`` is a writable fp32 chunk of (scaled) logits [c, V_local]
# ---------------------------------------------------------------------------------------------------------------

def _chunk_forward(z: torch.Tensor, local_target: torch.Tensor, in_range: torch.Tensor, shard: VocabShard):
    """Consumes ``z``. Returns fp32 (lse, logp, entropy), each [c], for the full (all-shard) distribution."""
    m = z.amax(dim=-1)
    shard.all_reduce_max(m)
    z.sub_(m[:, None])
    stats = z.new_empty(3, z.shape[0])
    picked = z.gather(1, local_target.clamp(0, z.shape[1] - 1)[:, None]).squeeze(1)
    stats[2] = torch.where(in_range, picked, torch.zeros_like(picked))
    e = torch.exp(z)
    stats[0] = e.sum(dim=-1)
    stats[1] = e.mul_(z).sum(dim=-1)  # sum exp(z - m) * (z - m): entropy without cancellation at large logits
    shard.all_reduce_sum(stats)
    log_s = stats[0].log()
    return m + log_s, stats[2] - log_s, log_s - stats[1] / stats[0]


def _chunk_grad_logits(z, lse, entropy, g_logp, g_ent, local_target, in_range):
    """Consumes ``z``; returns d loss / d z [c, V_local] (fp32).

    With p = softmax(z): d logp / d z = onehot(target) - p and d entropy / d z = -p * (log p + entropy).
    ``g_logp`` / ``g_ent`` [c] are the incoming gradients (either may be None: that output was unused).
    """
    z.sub_(lse[:, None])  # log p on this shard
    if g_ent is None:  # entropy only logged (DAPO's default): one [c, V_local] buffer suffices
        grad = z.exp_().mul_(-g_logp[:, None])
    else:
        p = torch.exp(z)
        z.add_(entropy[:, None]).mul_(g_ent[:, None])
        if g_logp is not None:
            z.add_(g_logp[:, None])
        grad = p.mul_(z).neg_()
    if g_logp is not None:
        rows = torch.nonzero(in_range).squeeze(1)
        grad.index_put_((rows, local_target[rows]), g_logp[rows], accumulate=True)
    return grad


def _local_targets(target: torch.Tensor, shard: VocabShard, v_local: int):
    local = target - shard.start
    return local, (local >= 0) & (local < v_local)


def _scaled_grads(g_logp, g_ent, temperature: float):
    # z = raw / temperature, so d/d raw = (d/d z) / temperature; the map is linear in the incoming gradients
    if temperature == 1.0:
        return g_logp, g_ent
    return tuple(None if g is None else g / temperature for g in (g_logp, g_ent))


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(h_c: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    z = (h_c @ weight.t()).to(_math_dtype(h_c.dtype))  # a fresh tensor: the matmul output, or its fp32 copy
    return z.div_(temperature) if temperature != 1.0 else z


def _logits_copy(logits_c: torch.Tensor, temperature: float) -> torch.Tensor:
    z = logits_c.to(_math_dtype(logits_c.dtype), copy=True)  # the per-chunk math writes into it
    return z.div_(temperature) if temperature != 1.0 else z


def _add_weight_grad(acc: torch.Tensor, grad: torch.Tensor, h_c: torch.Tensor) -> None:
    """acc [V_local, H] (fp32) += grad.T @ h_c, without rounding the chunk's contribution to bf16.

    On CUDA a low-precision GEMM with fp32 output keeps the tensor cores (an fp32 GEMM would be ~15x slower there);
    elsewhere, or where torch lacks that variant, the GEMM runs in fp32 (exact; CPU is for tests and small runs).
    """
    if acc.is_cuda and h_c.dtype in (torch.bfloat16, torch.float16):
        try:
            acc += torch.mm(grad.t().to(h_c.dtype), h_c, out_dtype=torch.float32)
            return
        except (TypeError, RuntimeError, NotImplementedError):
            pass
    acc.addmm_(grad.t(), h_c.to(acc.dtype))


class _LinearLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, chunk_size: int, temperature: float, shard: VocabShard):
        n, v_local = hidden.shape[0], weight.shape[0]
        local_target, in_range = _local_targets(target, shard, v_local)
        lse, logp, ent = (hidden.new_empty(n, dtype=_math_dtype(hidden.dtype)) for _ in range(3))
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            z = _drop_padding(_chunk_logits(hidden[s:e], weight, temperature), shard)
            lse[s:e], logp[s:e], ent[s:e] = _chunk_forward(z, local_target[s:e], in_range[s:e], shard)
        ctx.save_for_backward(hidden, weight, local_target, in_range, lse, ent.clone())
        ctx.chunk_size, ctx.temperature, ctx.shard = chunk_size, temperature, shard
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, local_target, in_range, lse, ent = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_logp is None and g_ent is None) or not (need_h or need_w):
            return None, None, None, None, None, None
        g_logp, g_ent = _scaled_grads(g_logp, g_ent, ctx.temperature)
        n, chunk = hidden.shape[0], ctx.chunk_size
        # fp32 accumulators: a bf16 grad_W summed over many chunks would round at every chunk
        acc = _math_dtype(hidden.dtype)
        grad_h = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            z = _drop_padding(_chunk_logits(hidden[s:e], weight, ctx.temperature), ctx.shard)
            grad = _chunk_grad_logits(z, lse[s:e], ent[s:e], None if g_logp is None else g_logp[s:e],
                                      None if g_ent is None else g_ent[s:e], local_target[s:e], in_range[s:e])
            if need_h:  # a bf16 matmul rounds each shard's partial sum, as Megatron's ColumnParallelLinear does
                grad_h[s:e] = grad.to(weight.dtype) @ weight
            if need_w:
                _add_weight_grad(grad_w, grad, hidden[s:e])
        if need_h:
            ctx.shard.reduce_grad_hidden(grad_h)
            grad_h = grad_h.to(hidden.dtype)
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None


class _LogitsLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, chunk_size: int, temperature: float, shard: VocabShard):
        n = logits.shape[0]
        local_target, in_range = _local_targets(target, shard, logits.shape[1])
        lse, logp, ent = (logits.new_empty(n, dtype=_math_dtype(logits.dtype)) for _ in range(3))
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            z = _drop_padding(_logits_copy(logits[s:e], temperature), shard)
            lse[s:e], logp[s:e], ent[s:e] = _chunk_forward(z, local_target[s:e], in_range[s:e], shard)
        ctx.save_for_backward(logits, local_target, in_range, lse, ent.clone())
        ctx.chunk_size, ctx.temperature, ctx.shard = chunk_size, temperature, shard
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, local_target, in_range, lse, ent = ctx.saved_tensors
        if (g_logp is None and g_ent is None) or not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        g_logp, g_ent = _scaled_grads(g_logp, g_ent, ctx.temperature)
        grad_logits = torch.empty_like(logits)
        for s in range(0, logits.shape[0], ctx.chunk_size):
            e = min(s + ctx.chunk_size, logits.shape[0])
            z = _drop_padding(_logits_copy(logits[s:e], ctx.temperature), ctx.shard)
            grad_logits[s:e] = _chunk_grad_logits(z, lse[s:e], ent[s:e], None if g_logp is None else g_logp[s:e],
                                                  None if g_ent is None else g_ent[s:e], local_target[s:e],
                                                  in_range[s:e])
        return grad_logits, None, None, None, None


# ---------------------------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------------------------

def _check_common(target: torch.Tensor, n: int, v_local: int, chunk_size: int, temperature: float,
                  shard: VocabShard) -> None:
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int (tokens per chunk), got {chunk_size!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (it divides the logits), got {temperature!r}")
    if target.dtype not in (torch.int64, torch.int32) or target.shape != (n,):
        raise ValueError(f"target must be an integer tensor of shape [{n}] (one token id per row of the input), "
                         f"got {tuple(target.shape)} {target.dtype}")
    vocab = shard.vocab_size if shard.vocab_size is not None else v_local
    if shard.valid_vocab is not None:
        if not 0 < shard.valid_vocab <= vocab:
            raise ValueError(f"valid_vocab must lie in [1, {vocab}] (the padded vocabulary), got {shard.valid_vocab}")
        vocab = shard.valid_vocab
    if n and (int(target.min()) < 0 or int(target.max()) >= vocab):
        raise ValueError(f"target ids must lie in [0, {vocab}) (the vocabulary size); got min {int(target.min())}, "
                         f"max {int(target.max())}. Replace padding ids by a valid id (e.g. 0) and mask the outputs.")


def linear_logprobs_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                            chunk_size: int = 1024, temperature: float = 1.0,
                            shard: Optional[VocabShard] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``log_softmax(hidden @ weight.T / temperature)``: taken-token log-prob and entropy, chunked over tokens.

    hidden [N, H] and weight [V, H] (or a vocabulary shard [V_local, H], see ``shard``) of one dtype; target [N] ids
    in the full vocabulary. Returns fp32 ``(logp [N], entropy [N])``; gradients flow to ``hidden`` and ``weight``
    (``temperature`` is a fixed divisor). Peak extra memory: about 3 x chunk_size x V_local x 4 bytes, plus in
    backward an fp32 accumulator for the weight's gradient (V_local x H x 4 bytes) when the weight is bf16/fp16.
    """
    shard = shard or _UNSHARDED
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be [N, H] and weight [V, H] with the same H; got hidden "
                         f"{tuple(hidden.shape)}, weight {tuple(weight.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must have one dtype; cast one of them")
    _check_common(target, hidden.shape[0], weight.shape[0], chunk_size, temperature, shard)
    return _LinearLogprobEntropy.apply(hidden, weight, target.long(), chunk_size, float(temperature), shard)


def logits_logprobs_entropy(logits: torch.Tensor, target: torch.Tensor, *, chunk_size: int = 1024,
                            temperature: float = 1.0,
                            shard: Optional[VocabShard] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same as :func:`linear_logprobs_entropy` from logits [N, V] (or a vocabulary shard [N, V_local]) that already
    exist; keeps no fp32 copy of them (backward recomputes the softmax chunk by chunk). Returns fp32 [N] each."""
    shard = shard or _UNSHARDED
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V]; got {tuple(logits.shape)} (flatten leading dims first)")
    _check_common(target, logits.shape[0], logits.shape[1], chunk_size, temperature, shard)
    return _LogitsLogprobEntropy.apply(logits, target.long(), chunk_size, float(temperature), shard)


def fused_logprobs_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                           mask: Optional[torch.Tensor] = None, chunk_size: int = 1024, temperature: float = 1.0,
                           shard: Optional[VocabShard] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`linear_logprobs_entropy` for any leading shape: hidden [..., H] (e.g. [B, T, H]), targets [...].

    ``mask`` [...] (bool or 0/1): only positions with mask != 0 are computed (padding costs nothing); the others get
    logp = entropy = 0 and no gradient. Returns fp32 ``(logp [...], entropy [...])``. With a ``shard``, every shard
    must pass the same hidden states, targets and mask.
    """
    lead = targets.shape
    if hidden.shape[:-1] != lead:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be targets' shape {tuple(lead)} plus a hidden dim")
    if mask is not None and mask.shape != lead:
        raise ValueError(f"mask must have the targets' shape {tuple(lead)}, got {tuple(mask.shape)}")
    h, t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    if mask is None:
        logp, ent = linear_logprobs_entropy(h, weight, t, chunk_size=chunk_size, temperature=temperature,
                                            shard=shard)
        return logp.view(lead), ent.view(lead)
    idx = torch.nonzero(mask.reshape(-1)).squeeze(1)
    logp, ent = linear_logprobs_entropy(h.index_select(0, idx), weight, t[idx], chunk_size=chunk_size,
                                        temperature=temperature, shard=shard)
    zeros = logp.new_zeros(t.shape[0])
    return zeros.index_copy(0, idx, logp).view(lead), zeros.index_copy(0, idx, ent).view(lead)


def reference_logprobs_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                               temperature: float = 1.0,
                               valid_vocab: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The obvious version: materialises the full logits. hidden [..., H], weight [V, H], target [...] ->
    fp32 (logp [...], entropy [...]). ``valid_vocab``: only the first rows of ``weight`` form the vocabulary."""
    if valid_vocab is not None:
        weight = weight[:valid_vocab]
    logp_all = torch.log_softmax((hidden @ weight.t()).to(_math_dtype(hidden.dtype)) / temperature, dim=-1)
    logp = logp_all.gather(-1, target.long().unsqueeze(-1)).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)
