"""Slow, obvious reference implementations the tests compare the product's fused paths against (full logits, then
log_softmax). Test support only: no product code calls them."""
from __future__ import annotations

from typing import Optional

import torch

from nemo_dapo.core.logprobs import _math_dtype
from nemo_dapo.core.types import RolloutBatch
from nemo_dapo.local.model import position_ids_from_mask
from nemo_dapo.local.policy import _sequence


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


def reference_logprobs(model, batch: RolloutBatch) -> tuple:
    """Slow obvious reference: full logits from ``model(...)``, then log_softmax. (logp, entropy) [B, R], no grad."""
    ids, mask = _sequence(batch)
    P, R = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits.float()
    logp_all = torch.log_softmax(logits[:, P - 1:P + R - 1], dim=-1)
    valid = batch.response_mask > 0
    logp = logp_all.gather(-1, batch.response_ids[..., None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return torch.where(valid, logp, torch.zeros_like(logp)), torch.where(valid, ent, torch.zeros_like(ent))
