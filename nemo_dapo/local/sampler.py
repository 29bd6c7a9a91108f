"""Batched sampling with a KV cache for the small ``transformers`` decoders (the local ``Generator``).

The decode loop is ours rather than ``model.generate``: it returns the log-probability of every sampled token, takes a
per-row token budget, uses the same position convention as the trainer (positions count real tokens, so left padding
does not shift them) and drops finished rows from the batch and the cache as it goes (responses of very different
lengths cost what the unfinished rows cost).
"""
from __future__ import annotations

import random
from typing import Optional, Union

import torch

from nemo_dapo.core.loop_data import mix_seed
from nemo_dapo.core.sampling import inverse_cdf, sample_next, sampling_logp
from nemo_dapo.core.types import Generation
from nemo_dapo.models.decoder import position_ids_from_mask


def _budget(max_new_tokens: Union[int, torch.Tensor], batch: int) -> torch.Tensor:
    if isinstance(max_new_tokens, torch.Tensor):
        budget = max_new_tokens.to(torch.long).reshape(-1)
        if budget.numel() == 1:
            budget = budget.expand(batch)
        if budget.numel() != batch:
            raise ValueError(f"max_new_tokens has {budget.numel()} entries for {batch} prompts; pass an int or a "
                             "[B] tensor")
    else:
        budget = torch.full((batch,), int(max_new_tokens), dtype=torch.long)
    if (budget < 0).any():
        raise ValueError("max_new_tokens must be >= 0")
    return budget.clone()


class LocalSampler:
    """``Generator`` over a ``transformers`` causal LM (Llama / Qwen2 layout: ``model.model`` + ``model.lm_head``).

    Share the policy's module (``LocalSampler(policy.model, ...)``) and ``update_weights`` is a no-op; give it a
    separate copy and ``update_weights`` copies the policy's weights in.

    Randomness: row i of a call draws from its own stream, a ``random.Random`` seeded with
    ``mix_seed(seed, first_row + i)`` (one uniform per token, turned into a token by inverse CDF). A row's draws
    therefore do not depend on how a batch is split between processes (``run_parallel.ParallelSampler`` passes each
    block's ``first_row``), nor on the batch around it, up to floating-point round-off of its logits.
    """

    def __init__(self, model, *, eos_id: int, pad_id: int):
        self.model = model
        self.eos_id = int(eos_id)
        self.pad_id = int(pad_id)

    def update_weights(self, policy) -> None:
        source = getattr(policy, "model", policy)
        if source is not self.model:
            self.model.load_state_dict(source.state_dict())

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *,
                 max_new_tokens: Union[int, torch.Tensor], temperature: float = 1.0, top_p: float = 1.0,
                 seed: Optional[int] = None, first_row: int = 0) -> Generation:
        """One response per row of LEFT-padded ``prompt_ids`` [B, P].

        ``max_new_tokens``: int or [B] tensor, the per-row budget (EOS included). A row stops at EOS or at its budget
        (then ``truncated``). ``seed`` fixes the draws (None: drawn from torch's global RNG, so seeding that
        reproduces it too); ``first_row``: the index of row 0 in the whole batch this call is a block of (see the
        class docstring). Returns responses [B, R] right-padded with ``pad_id``, R = the longest response.
        """
        if prompt_ids.dim() != 2 or prompt_ids.shape != prompt_mask.shape:
            raise ValueError(f"prompt_ids {tuple(prompt_ids.shape)} and prompt_mask {tuple(prompt_mask.shape)} "
                             "must both be [B, P]")
        if prompt_ids.shape[1] == 0 or not bool(prompt_mask[:, -1].bool().all()):
            raise ValueError("prompts must be LEFT-padded with at least one real token each (prompt_mask[:, -1] "
                             "== 1); pad on the left, e.g. tokenizer.padding_side = 'left'")
        if temperature < 0 or not 0.0 < top_p <= 1.0:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
        B = prompt_ids.shape[0]
        budget = _budget(max_new_tokens, B)
        if seed is None:
            seed = int(torch.randint(0, 2 ** 62, (1,)).item())
        # decoding runs on the model's device; the result comes back on the prompts' device
        device = next(self.model.parameters()).device
        streams = [random.Random(mix_seed(int(seed), int(first_row) + i)) for i in range(B)]
        budget = budget.to(device)
        was_training = self.model.training
        self.model.eval()
        try:
            tokens, logps, lengths, hit_eos = self._decode(prompt_ids.to(device), prompt_mask.to(device).long(),
                                                           budget, temperature, top_p, streams)
        finally:
            self.model.train(was_training)
        width = int(lengths.max().item()) if B else 0
        mask = (torch.arange(width, device=device)[None, :] < lengths[:, None]).float()
        out = prompt_ids.device
        return Generation(response_ids=tokens[:, :width].to(out), response_mask=mask.to(out),
                          truncated=(~hit_eos & (lengths >= budget)).to(out), logprobs=logps[:, :width].to(out))

    def _decode(self, prompt_ids, prompt_mask, budget, temperature, top_p, streams):
        from nemo_dapo.models.kv_cache import InPlaceCache

        B, limit = prompt_ids.shape[0], int(budget.max().item()) if prompt_ids.shape[0] else 0
        device = prompt_ids.device
        tokens = torch.full((B, limit), self.pad_id, dtype=torch.long, device=device)
        logps = torch.zeros(B, limit, device=device)
        lengths = torch.zeros(B, dtype=torch.long, device=device)
        hit_eos = torch.zeros(B, dtype=torch.bool, device=device)
        rows = torch.nonzero(budget > 0).squeeze(1)  # original indices of the rows in the running batch
        if limit == 0 or rows.numel() == 0:
            return tokens, logps, lengths, hit_eos
        cache = InPlaceCache(capacity=prompt_ids.shape[1] + limit)  # K/V written in place, prompt + budget columns
        mask = prompt_mask[rows]
        out = self.model.model(input_ids=prompt_ids[rows], attention_mask=mask,
                               position_ids=position_ids_from_mask(mask), past_key_values=cache, use_cache=True)
        hidden, next_pos = out.last_hidden_state[:, -1], mask.sum(-1)
        # finished rows ride along until the next compaction
        alive = torch.ones(rows.numel(), dtype=torch.bool, device=device)
        for t in range(limit):
            tok, lp = _draw(self.model.lm_head(hidden).float(), temperature, top_p, [streams[r] for r in rows.tolist()])
            live = rows[alive]
            tokens[live, t], logps[live, t] = tok[alive], lp[alive]
            lengths[live] += 1
            eos = alive & (tok == self.eos_id)
            hit_eos[rows[eos]] = True
            alive &= ~eos & (lengths[rows] < budget[rows])
            n_alive = int(alive.sum())
            if n_alive == 0:
                break
            if n_alive <= 0.75 * alive.numel():  # compact rarely: each compaction copies the whole cache
                idx = torch.nonzero(alive).squeeze(1)
                cache.select_rows(idx)
                rows, tok, mask, next_pos, alive = rows[idx], tok[idx], mask[idx], next_pos[idx], alive[idx]
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            out = self.model.model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                                   past_key_values=cache, use_cache=True)
            hidden, next_pos = out.last_hidden_state[:, -1], next_pos + 1
        return tokens, logps, lengths, hit_eos


def _draw(logits: torch.Tensor, temperature: float, top_p: float, streams: list):
    """One token per row of fp32 ``logits`` [N, V], row i drawing one uniform from ``streams[i]``. Returns (tokens [N],
    log-probs [N]) with ``sample_next``'s meaning (greedy at temperature 0 reports the temperature-1 log-prob)."""
    if temperature == 0:
        return sample_next(logits, 0.0, 1.0, None)
    logp = sampling_logp(logits, temperature, top_p, 0)
    u = torch.tensor([s.random() for s in streams], dtype=torch.float64, device=logits.device)
    tok = inverse_cdf(logp, u)
    return tok, logp.gather(1, tok[:, None]).squeeze(1)
