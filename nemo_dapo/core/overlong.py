"""Overlong handling (DAPO section 3.4): soft overlong punishment and overlong filtering.

Lengths count response tokens including the EOS token (``RolloutBatch.lengths``).
"""
from __future__ import annotations

import torch


def soft_overlong_penalty(lengths: torch.Tensor, *, l_max: int, l_cache: int, factor: float = 1.0) -> torch.Tensor:
    """Float[B] length penalty R_length of the DAPO paper (Eq. 13), scaled by ``factor``, in [-factor, 0].

    ``lengths`` [B] integer response lengths. With L_exp = l_max - l_cache:
        0                          if |y| <= L_exp
        factor * (L_exp - |y|) / l_cache   if L_exp < |y| <= l_max   (linear from 0 down to -factor)
        -factor                    if |y| > l_max
    The value is clamped at -factor: without the clamp, a generation cap larger than ``l_max`` would push the
    penalty below -factor and the reward below the paper's range [-2, +1].
    Example: l_max=10, l_cache=4, lengths=[5, 6, 8, 10, 12] -> [0, 0, -0.5, -1, -1].
    """
    if not 0 < l_cache <= l_max:
        raise ValueError(f"soft_overlong_penalty needs 0 < l_cache <= l_max, got l_cache={l_cache}, l_max={l_max}; "
                         "l_cache is the buffer before the generation cap l_max (paper: 4096 of 20480)")
    if not factor >= 0:
        raise ValueError(f"soft_overlong_penalty needs factor >= 0 (the penalty magnitude), got {factor}")
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-D [B], got shape {tuple(lengths.shape)}")
    if lengths.is_floating_point() and not bool((lengths == lengths.round()).all()):
        raise ValueError("lengths must be whole token counts (use RolloutBatch.lengths)")
    excess = lengths.double() - (l_max - l_cache)
    penalty = (-excess / l_cache).clamp(min=-1.0, max=0.0) * factor
    return (penalty + 0.0).float()  # + 0.0 turns the -0.0 of lengths <= L_exp into 0.0


def overlong_filter_mask(truncated: torch.Tensor) -> torch.Tensor:
    """Float[B] keep-mask for overlong filtering: 0 for samples that hit the generation cap, 1 otherwise.

    ``truncated`` [B] bool (or 0/1). Multiply it into the response mask so that truncated samples contribute
    neither loss nor tokens to the normaliser.
    """
    if truncated.dim() != 1:
        raise ValueError(f"truncated must be 1-D [B], got shape {tuple(truncated.shape)}")
    if truncated.dtype != torch.bool:
        if not bool(((truncated == 0) | (truncated == 1)).all()):
            raise ValueError("truncated must be bool or 0/1 (RolloutBatch.truncated)")
        truncated = truncated != 0
    return (~truncated).float()
