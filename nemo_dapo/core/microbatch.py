"""Micro-batch planning: which rows of a batch go through the model together, and how long each group is padded.

A Megatron micro-batch is one [b, S_mb] tensor, so every row in it is padded to the group's longest row. Padding
every micro-batch to the longest row of the whole mini-batch (NeMo-Aligner's ``get_iterator_k_split``) wastes most
of the compute on long-tailed response lengths (DAPO: mean ~6k tokens, cap 20k). Here rows are sorted by length
(longest first) and packed greedily: a micro-batch takes the next rows while ``rows x S_mb`` stays within a token
budget, where ``S_mb`` is its first (longest) row rounded up to ``multiple`` (the sequence-parallel split).

The plan only regroups rows: with a loss normalised by a GLOBAL token count (core.loss), the sum of the micro-batch
losses, and so the gradient, is the same for any grouping. Torch-free (stdlib only).
"""
from __future__ import annotations

from typing import Optional, Sequence


def round_up(n: int, multiple: int) -> int:
    return -(-int(n) // multiple) * multiple


def plan_microbatches(lengths: Sequence[int], *, multiple: int = 1, max_tokens: Optional[int] = None,
                      max_rows: Optional[int] = None) -> list:
    """Groups of row indices, one per micro-batch, longest rows first; each group is padded to ``padded_len``.

    ``lengths`` [B]: each row's real token count. ``max_tokens``: budget of rows x padded length per micro-batch
    (a row longer than the budget alone forms a micro-batch); ``max_rows``: cap on rows per micro-batch (the
    fixed row count when ``max_tokens`` is None). At least one of the two must be given. Returns [] for B = 0.
    """
    if max_tokens is None and max_rows is None:
        raise ValueError("plan_microbatches needs max_tokens (a token budget) or max_rows (rows per micro-batch)")
    if max_tokens is not None and int(max_tokens) < 1:
        raise ValueError(f"max_tokens (model.dapo.micro_batch_tokens) must be >= 1 or null, got {max_tokens}")
    if max_rows is not None and int(max_rows) < 1:
        raise ValueError(f"max_rows (the micro-batch size) must be >= 1, got {max_rows}")
    order = sorted(range(len(lengths)), key=lambda i: -int(lengths[i]))  # stable: ties keep their order
    groups: list = []
    for i in order:
        if groups:
            g = groups[-1]
            width = round_up(lengths[g[0]], multiple)
            fits_rows = max_rows is None or len(g) < max_rows
            fits_tokens = max_tokens is None or (len(g) + 1) * width <= max_tokens
            if fits_rows and fits_tokens:
                g.append(i)
                continue
        groups.append([i])
    return groups


def padded_len(lengths: Sequence[int], group: Sequence[int], multiple: int = 1) -> int:
    """S_mb of one planned micro-batch: its longest row rounded up to ``multiple``."""
    return round_up(max(int(lengths[i]) for i in group), multiple)
