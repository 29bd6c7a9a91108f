"""The slow, obvious log-probs of a transformers model (full logits, then log_softmax) that the tests compare the
local policy's and the engines' fused paths against. Test support only: no product code calls it (the hidden-state
reference, core.logprobs.reference_logprobs_entropy, stays in the product: benchmarks/fused_logprobs.py measures
against it)."""
from __future__ import annotations

import torch

from nemo_dapo.core.types import RolloutBatch
from nemo_dapo.models.decoder import position_ids_from_mask
from nemo_dapo.local.policy import _sequence


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
