"""The metrics of one DAPO rollout step (core/loop.py), computed from the step's groups, counters and timers.

Names are ``/``-grouped floats: ``train/`` (rewards and accuracy of every generated response), ``response/`` (their
lengths), ``rollout/`` (generated vs trained tokens), ``partial/`` (staleness of the trained tokens), ``actor/``
(the policy's update metrics, averaged over updates).
"""
from __future__ import annotations

import math

import torch

from nemo_dapo.core.loss import logp_mismatch
from nemo_dapo.core.metrics import length_stats
from nemo_dapo.core.overlong import soft_overlong_penalty
from nemo_dapo.core.types import RolloutBatch


def rollout_metrics(counters: dict, before: tuple, timers: dict, t_needed: float) -> dict:
    """Generated (aborted partial samples included) vs trained tokens, and how long the needed groups took.

    ``time_to_last_needed_s``: from the step's start until the filler was full (streaming: the moment the last
    needed group finished; batch mode: the end of the last generation batch)."""
    out = {"rollout/generated_tokens": float(counters["generated_tokens"] - before[0]),
           "rollout/aborted_tokens": float(counters["aborted_tokens"] - before[1]),
           "rollout/aborted_requests": float(timers.get("aborted_requests", 0)),
           "timing/to_last_needed_s": float(t_needed)}
    return out


def staleness_metrics(batch: RolloutBatch, version: int) -> dict:
    """How many weight versions older than the trainer's (``version``) the trained tokens' samplers were."""
    valid = batch.response_mask.bool()
    lag = (version - batch.token_version)[valid].float()
    if not lag.numel():
        return {}
    return {"partial/trained_lag_mean": float(lag.mean()), "partial/trained_lag_max": float(lag.max()),
            "partial/trained_stale_token_frac": float((lag > 0).float().mean())}


def mismatch_by_lag(batch: RolloutBatch, rows: list, version: int, reducer) -> dict:
    """``actor/logp_mismatch`` split by the tokens' lag: mean |pi_engine / pi_trainer - 1| over the trained tokens
    sampled by the trainer's current weights (``partial/logp_mismatch_fresh``: the engine's numerics alone) and by
    older ones (``partial/logp_mismatch_stale``: numerics and the updates since). ``rows``: this rank's rows of
    ``batch``, whose ``old_logp`` (the trainer's, weights ``version``), ``engine_logp`` and ``token_version`` are
    set there; sums and counts are reduced over the ranks (every rank calls it). {} without engine log-probs."""
    if batch.engine_logp is None or batch.token_version is None:
        return {}
    valid = batch.response_mask[rows].bool()
    fresh = batch.token_version[rows] == version
    out = {}
    for name, where in (("fresh", valid & fresh), ("stale", valid & ~fresh)):
        local = where.sum().float()
        total = reducer.sum(logp_mismatch(batch.engine_logp[rows], batch.old_logp[rows], where) * local)
        count = reducer.sum(local)
        if float(count) > 0:
            out[f"partial/logp_mismatch_{name}"] = float(total / count)
    return out


def generation_metrics(generated: list, s) -> dict:
    """Reward / accuracy / length statistics over every response generated in this step (all ranks)."""
    if not generated:
        return {}
    rewards = torch.cat([g.rewards for g in generated]).float()
    acc = torch.cat([g.acc for g in generated]).float()
    lengths = torch.cat([g.payload.lengths for g in generated])
    truncated = torch.cat([g.payload.truncated for g in generated]).bool()
    out = {"train/reward": float(rewards.mean()), "train/acc": float(acc.mean()),
           **{f"response/{k}": v for k, v in length_stats(lengths, truncated).items()},
           "response/tokens": float(lengths.sum()), "response/samples": float(lengths.numel())}
    if s.overlong.enabled:
        penalty = soft_overlong_penalty(lengths.long(), l_max=s.penalty_l_max, l_cache=s.overlong.l_cache,
                                        factor=float(s.overlong.penalty_factor))
        out["train/overlong_penalty"] = float(penalty.mean())
        out["train/overlong_frac"] = float((penalty < 0).float().mean())
    return out


def mean_metrics(per_update: list) -> dict:
    """Mean over updates of each policy metric, under ``actor/``; ``skipped`` is a count, not a mean."""
    keys = sorted({k for m in per_update for k in m})
    out = {}
    for k in keys:
        vals = [m[k] for m in per_update if k in m and math.isfinite(m[k])]
        name = k if "/" in k else f"actor/{k}"
        if k == "skipped":
            out[name] = float(sum(m.get(k, 0.0) for m in per_update))
        elif vals:
            out[name] = sum(vals) / len(vals)
    return out
