"""Group-relative advantages (GRPO outcome advantage, as DAPO uses it; no critic, no KL)."""
from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, eps: float = 1e-6,
                     scale_by_std: bool = True) -> torch.Tensor:
    """Float[B] advantage A_i = (R_i - mean_g) / (std_g + eps) over the samples sharing ``group_ids[i]``.

    ``rewards`` [B] float (the SHAPED reward), ``group_ids`` [B] integer: an explicit id per prompt draw. Samples are
    grouped by id, never by position, so a group's members may sit anywhere in the batch. The std is unbiased
    (Bessel), as in the reference. Broadcast the result over response tokens yourself (times the response mask).
    * A group whose rewards are all equal gets exactly 0 (not a rounding residue divided by eps).
    * A group of size 1 is treated as the reference does (mean 0, std 1), so its advantage is R_i / (1 + eps)
      (R_i when ``scale_by_std=False``). Dynamic sampling never trains on such groups; with it off they keep the
      raw reward's sign.
    ``scale_by_std=False`` drops the division (Dr. GRPO): A_i = R_i - mean_g.
    """
    if rewards.dim() != 1 or group_ids.dim() != 1 or rewards.shape != group_ids.shape:
        raise ValueError(f"rewards and group_ids must be 1-D of equal length, got {tuple(rewards.shape)} and "
                         f"{tuple(group_ids.shape)}")
    if group_ids.is_floating_point() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor (one id per prompt draw), got {group_ids.dtype}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards contain NaN or inf; check the reward function and overlong shaping")
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    r = rewards.to(dtype)
    if r.numel() == 0:
        return r.clone()

    _, inv = torch.unique(group_ids, return_inverse=True)
    k = int(inv.max().item()) + 1
    count = torch.zeros(k, dtype=dtype, device=r.device).index_add_(0, inv, torch.ones_like(r))
    mean = torch.zeros(k, dtype=dtype, device=r.device).index_add_(0, inv, r) / count
    sq_dev = torch.zeros(k, dtype=dtype, device=r.device).index_add_(0, inv, (r - mean[inv]) ** 2)
    std = (sq_dev / (count - 1).clamp(min=1)).sqrt()
    gmax = torch.full((k,), -torch.inf, dtype=dtype, device=r.device).scatter_reduce(0, inv, r, "amax")
    gmin = torch.full((k,), torch.inf, dtype=dtype, device=r.device).scatter_reduce(0, inv, r, "amin")

    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    centred = r - mean[inv]
    adv = centred / (std[inv] + eps) if scale_by_std else centred
    # The group mean of equal floats can differ from them in the last bit; force the constant-group case to 0.
    constant = (gmax == gmin) & ~single
    return torch.where(constant[inv], torch.zeros_like(adv), adv)
