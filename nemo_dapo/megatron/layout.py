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
from nemo_dapo.core.types import LossInput, RolloutBatch


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


def loss_input(mb: dict) -> LossInput:
    """The loss input (core/types.py) of a batch in this layout: per-token fields on its shifted grid [B, S-1], so
    the loss is called with the log-probs of tokens 1..S-1 (T = S - 1); the mask is 0 on prompt and padding."""
    missing = [k for k in ("prev_logprobs", "advantages") if k not in mb]
    if missing:
        raise ValueError(f"the packed batch has no {missing}: pack_rollout writes them from RolloutBatch.old_logp "
                         "/ advantages, which the step must fill before the update")
    return LossInput(old_logp=mb["prev_logprobs"], advantages=mb["advantages"], mask=mb["mask"],
                     truncated=mb["is_end"] < 0.5, engine_logp=mb.get("engine_logprobs"))


# The fields of the packed layout: (kind, dtype). kind "tokens": [B, S]; "shifted": [B, S-1] on the shifted
# log-prob grid; "row": [B]. Filler rows (blank_rows) are built from this table, so every builder agrees.
FIELDS = {"response_tokens": ("tokens", torch.long), "mask": ("shifted", torch.float32),
          "prev_logprobs": ("shifted", torch.float32), "engine_logprobs": ("shifted", torch.float32),
          "is_end": ("row", torch.float32), "advantages": ("row", torch.float32),
          "prompt_lengths": ("row", torch.long), "response_lengths": ("row", torch.long)}


def blank_rows(keys, n: int, pad_id: int, width: int) -> dict:
    """``n`` fully masked rows of the packed layout with the fields ``keys`` (names of :data:`FIELDS`):
    ``response_tokens`` [n, width] of ``pad_id``, ``is_end`` 1 (an ended row: no overlong term), every other field
    0 (shifted fields [n, width - 1], per-row fields [n]). On such rows every loss term, metric share and
    normaliser share is 0 (mask 0; ended, so overlong filtering does not touch them); a
    rank with no sample runs them so that it still joins every collective of the step. ``n`` may be 0."""
    out = {}
    for k in keys:
        if k not in FIELDS:
            raise KeyError(f"blank_rows: {k!r} is not a field of the packed layout ({sorted(FIELDS)})")
        kind, dtype = FIELDS[k]
        shape = {"tokens": (n, width), "shifted": (n, width - 1), "row": (n,)}[kind]
        fill = pad_id if k == "response_tokens" else 1 if k == "is_end" else 0
        out[k] = torch.full(shape, fill, dtype=dtype)
    return out
