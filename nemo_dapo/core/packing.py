"""Rows of prompt + response tokens, and the responses cut back out of them (torch only).

The core layout (core/types.py) keeps prompts LEFT-padded [B, P] and responses RIGHT-padded [B, R]. A model
forward wants each row's real prompt tokens first and its response right after, from column 0 (positions and the
causal mask then need no padding information): the packed row. Both the megatron policy and the NeMo-Aligner actor
pack this way, and both generators cut responses out of such rows; the index arithmetic lives here once.
"""
from __future__ import annotations

from typing import Optional

import torch


def response_positions(prompt_lengths: torch.Tensor, width: int, offset: int = 0) -> torch.Tensor:
    """[B, width] long: the column of response token j of row b in a packed row, ``p_b + j``, plus ``offset``
    (-1: the position whose output predicts that token, i.e. its index among the shifted [S-1] log-probs)."""
    return prompt_lengths.long()[:, None] + offset + torch.arange(width, device=prompt_lengths.device)[None, :]


def pack_rows(prompt_ids: torch.Tensor, prompt_lengths: torch.Tensor, response_ids: torch.Tensor, pad_id: int,
              width: Optional[int] = None) -> torch.Tensor:
    """[B, width] packed rows: the last ``prompt_lengths[b]`` columns of the left-padded ``prompt_ids`` [B, P], then
    the R columns of ``response_ids`` [B, R], then ``pad_id``. Default width: max prompt length + R (every response
    slot fits; R + 1 for an empty batch)."""
    big_p, r = prompt_ids.shape[1], response_ids.shape[1]
    p = prompt_lengths.long()
    if width is None:
        width = int(p.max()) + r if len(p) else r + 1
    src = torch.cat([prompt_ids, response_ids.to(prompt_ids.dtype)], dim=1)  # [B, P + R]
    idx = torch.arange(width, device=src.device)[None, :] + (big_p - p)[:, None]  # row b's prompt starts at P - p_b
    tokens = src.gather(1, idx.clamp(max=big_p + r - 1))
    return torch.where(idx < big_p + r, tokens, torch.full_like(tokens, pad_id))


def cut_responses(rows: torch.Tensor, prompt_lengths: torch.Tensor, response_lengths: torch.Tensor,
                  pad_id: int) -> tuple:
    """(ids [B, W] right-padded with ``pad_id``, mask [B, W] bool): response token j of row b is
    ``rows[b, p_b + j]`` for j < ``response_lengths[b]``; W = the longest response (at least 1)."""
    n = response_lengths.long()
    width = max(1, int(n.max())) if len(n) else 1
    mask = torch.arange(width, device=rows.device)[None, :] < n[:, None]
    ids = rows.gather(1, response_positions(prompt_lengths, width).clamp(max=rows.shape[1] - 1))
    return torch.where(mask, ids, torch.full_like(ids, pad_id)), mask
