"""Drawing the next token from logits (torch only): the distribution after temperature / top-k / top-p, and draws
from it. One rule for every sampler of the project (the local sampler, the local engine, the Megatron debug sampler),
so their log-probs mean the same thing: the log-probability under the distribution the token was drawn from."""
from __future__ import annotations

from typing import Optional

import torch

from nemo_dapo.core.settings import MIN_TEMPERATURE


def sampling_logp(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """fp32 log-probs [N, V] of the distribution tokens are drawn from: logits / temperature, then all but the k
    largest masked (ties at the k-th value survive), then ``sample_next``'s top-p rule (the smallest prefix whose
    mass reaches top_p; the top token always survives)."""
    if not temperature >= MIN_TEMPERATURE:
        raise ValueError(f"sampling temperature {temperature!r} is below {MIN_TEMPERATURE} (0 is greedy: sample_next)")
    z = logits.float() / temperature
    if 0 < top_k < z.shape[-1]:
        z = z.masked_fill(z < z.topk(top_k, dim=-1).values[:, -1:], float("-inf"))
    if top_p < 1.0:
        sorted_z, order = z.sort(dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop_sorted[:, 0] = False  # a top_p that rounds to 0 in float32 would otherwise mask every token
        z = z.masked_fill(torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted), float("-inf"))
    return torch.log_softmax(z, dim=-1)


def inverse_cdf(logp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Tokens [N] drawn from log-probs [N, V] given uniforms ``u`` [N] in [0, 1): the first token whose cumulative
    mass exceeds u * total (a zero-mass token never is; u rounding up to 1 falls back to the last positive one)."""
    probs = logp.exp()
    cdf = probs.cumsum(-1)
    tok = torch.searchsorted(cdf, (u.to(cdf) * cdf[:, -1])[:, None], right=True).squeeze(1)
    last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(-1)
    return torch.minimum(tok, last)


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, generator: Optional[torch.Generator]):
    """Draw one token per row from fp32 ``logits`` [N, V]. Returns (tokens [N] long, log-prob [N] fp32).

    The log-prob is that of the distribution the token was drawn from (after temperature and top-p; what importance
    sampling against the sampler needs; equal to the model's log-prob at temperature 1, top_p 1).
    ``temperature == 0`` is greedy and reports the model's (temperature 1) log-prob of the argmax.
    """
    if temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        tok = logits.argmax(dim=-1)
        return tok, logp.gather(1, tok[:, None]).squeeze(1)
    logp = sampling_logp(logits, temperature, top_p, 0)
    tok = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
    return tok, logp.gather(1, tok[:, None]).squeeze(1)
