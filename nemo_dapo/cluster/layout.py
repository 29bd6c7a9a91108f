"""The NeMo-Aligner actor's batch layout and its conversion from / to the core layout (core/types.py).

Core layout: prompts LEFT-padded [B, P], responses RIGHT-padded [B, R]. NeMo-Aligner / Megatron layout: each row's
real prompt tokens and then its response from position 0 (so positions and the causal mask need no padding
information), right-padded: ``response_tokens`` [B, S]; per-token values aligned with the SHIFTED log-probs
[B, S-1] (entry t belongs to token t + 1), so response token j of row b sits at index ``p_b - 1 + j``.
Torch only: importable without NeMo.
"""
from __future__ import annotations

import torch

from nemo_dapo.core.packing import pack_rows, response_positions
from nemo_dapo.core.types import RolloutBatch


def prompt_lengths_of(batch: RolloutBatch) -> torch.Tensor:
    lengths = batch.prompt_mask.long().sum(-1)
    if len(lengths) and int(lengths.min()) < 1:
        raise ValueError("every prompt needs at least one real token (prompt_mask has an all-zero row)")
    return lengths


def pack_tokens(batch: RolloutBatch, pad_id: int) -> tuple:
    """(tokens [B, S], prompt_lengths [B]): core.packing.pack_rows of the batch, S = max prompt length + R."""
    p = prompt_lengths_of(batch)
    return pack_rows(batch.prompt_ids, p, batch.response_ids, pad_id), p


def to_shifted(values: torch.Tensor, prompt_lengths: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[B, R] response-aligned values -> [B, seq_len - 1] aligned with the shifted log-probs (0 elsewhere)."""
    out = values.new_zeros(values.shape[0], seq_len - 1)
    return out.scatter_(1, response_positions(prompt_lengths, values.shape[1], -1), values)


def unpack_response(values: torch.Tensor, prompt_lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[B, S-1] shifted per-token values -> [B, width] aligned with ``response_ids`` (inverse of to_shifted)."""
    return values.gather(1, response_positions(prompt_lengths, width, -1))


def pack_rollout(batch: RolloutBatch, pad_id: int) -> dict:
    """The actor's batch dict for a core RolloutBatch; optional per-token fields are packed when present."""
    tokens, p = pack_tokens(batch, pad_id)
    s = tokens.shape[1]
    out = {"response_tokens": tokens, "mask": to_shifted(batch.response_mask.float(), p, s),
           "is_end": (~batch.truncated.bool()).float(), "prompt_lengths": p,
           "response_lengths": p + batch.lengths}
    if batch.old_logp is not None:
        out["prev_logprobs"] = to_shifted(batch.old_logp.float(), p, s)
    if batch.engine_logp is not None:
        out["engine_logprobs"] = to_shifted(batch.engine_logp.float(), p, s)
    if batch.advantages is not None:
        out["advantages"] = batch.advantages.float()
    return out


def as_rollout(mb: dict) -> RolloutBatch:
    """A micro-batch in the packed layout viewed as a RolloutBatch (the loss only reads per-token fields + flags)."""
    tokens = mb["response_tokens"]
    b = tokens.shape[0]
    return RolloutBatch(prompt_ids=tokens[:, :1], prompt_mask=torch.ones_like(tokens[:, :1]),
                        response_ids=tokens[:, 1:], response_mask=mb["mask"],
                        group_ids=torch.zeros(b, dtype=torch.long, device=tokens.device),
                        truncated=mb["is_end"] < 0.5, engine_logp=mb.get("engine_logprobs"),
                        old_logp=mb.get("prev_logprobs"), advantages=mb.get("advantages"))


def pad_rows(batch: dict, multiple: int, pad_id: int, min_rows: int = 0) -> tuple:
    """(batch, n_real): rows appended (all-masked, ``pad_id`` tokens, ended) until B is a multiple of ``multiple``
    and at least ``min_rows``; an empty batch gets one micro-batch of padding so that the caller still joins every
    collective."""
    n = batch["response_tokens"].shape[0]
    target = max(multiple, -(-n // multiple) * multiple, min_rows)
    if target == n:
        return batch, n
    out = {}
    for k, v in batch.items():
        if k == "response_tokens":
            fill = v.new_full((target - n,) + tuple(v.shape[1:]), pad_id)
        elif k == "is_end":
            fill = v.new_ones((target - n,) + tuple(v.shape[1:]))
        else:
            fill = v.new_zeros((target - n,) + tuple(v.shape[1:]))
        out[k] = torch.cat([v, fill], 0)
    return out, n
