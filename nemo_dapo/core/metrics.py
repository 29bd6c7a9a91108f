"""Evaluation and rollout metrics: avg@k, pass@k, maj@k, response lengths, masked token sums, and the
one way loss metrics combine over micro-batches and ranks (``combine_metrics``, ``reduce_over_ranks``).

Repeated-evaluation inputs are per problem (P problems, n_i samples each; n_i may differ between problems):
  * ``acc``: ``Sequence[Sequence[bool | 0/1]]`` or a tensor [P, n] (bool, or float/int holding 0/1).
  * ``samples`` for maj@k: ``Sequence[Sequence[tuple[str, bool]]]``, the (normalised pred, acc) of each sample, in
    sampling order; the verifier's ``Verdict.pred`` is the value to vote on.
``group_by_problem`` turns flat per-sample lists (e.g. the 960 rows of AIME-2024 x32) into this form.

Token-level inputs are [B, T] tensors with a [B, T] mask (1 on response tokens, 0 on padding); means are over valid
tokens of the whole batch (token-mean): ``masked_sum_count`` gives sum and count, to be reduced across
data-parallel ranks before dividing. Empty selections give NaN rather than a made-up 0.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Hashable, Optional, Sequence, Union

import torch

from nemo_dapo.core.loss import METRIC_REDUCTION

PerProblem = Union[torch.Tensor, Sequence[Sequence]]


def _rows(acc: PerProblem, name: str = "acc") -> list:
    """Per-problem lists of 0/1 ints; rejects values that are not 0/1."""
    if isinstance(acc, torch.Tensor):
        if acc.dim() != 2:
            raise ValueError(f"{name} tensor must be [P, n] (problems x samples), got shape {tuple(acc.shape)}")
        acc = acc.tolist()
    rows = []
    for i, row in enumerate(acc):
        if any(v not in (0, 1) for v in row):  # True/False and 0.0/1.0 compare equal to 0/1
            raise ValueError(f"{name}[{i}] must hold 0/1 (or bool) correctness values, got {list(row)[:8]}")
        rows.append([int(v) for v in row])
    return rows


def avg_at_k(acc: PerProblem) -> float:
    """Mean accuracy over every sample of every problem (the paper's avg@32 on AIME-2024 x32)."""
    rows = _rows(acc)
    total = sum(len(r) for r in rows)
    return sum(sum(r) for r in rows) / total if total else math.nan


def pass_at_k_unbiased(n: int, c: int, k: int) -> float:
    """P(at least one of k samples drawn without replacement from n, c of them correct, is correct).

    ``1 - C(n-c, k) / C(n, k)``, computed as ``1 - prod_{i=n-c+1..n} (1 - k/i)`` (Chen et al. 2021) so that large n
    neither overflows nor loses precision.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}; "
                         "draw at least k samples per problem")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def pass_at_k(acc: PerProblem, k: int) -> float:
    """Mean over problems of the unbiased pass@k estimate from each problem's n >= k samples."""
    rows = _rows(acc)
    if not rows:
        return math.nan
    return sum(pass_at_k_unbiased(len(r), sum(r), k) for r in rows) / len(rows)


def _majority(preds: Sequence[Hashable]) -> Hashable:
    """Most frequent pred; ties go to the one that appeared first (deterministic)."""
    counts = Counter(preds)
    best = max(counts.values())
    return next(p for p in preds if counts[p] == best)


def maj_at_k(samples: Sequence[Sequence[tuple]], k: Optional[int] = None, *,
             invalid_pred: Optional[str] = None) -> float:
    """Majority-vote accuracy (cons@k): vote on the first k preds of each problem, score the winning pred.

    The winner's accuracy is the mean ``acc`` of the samples that voted for it (all equal for a deterministic
    verifier). ``k=None`` uses all samples. Preds equal to ``invalid_pred`` do not vote (the reference votes with
    every pred, ``"[INVALID]"`` included, which is the default here); a problem with no vote scores 0.
    """
    if not samples:
        return math.nan
    scores = []
    for i, problem in enumerate(samples):
        if k is not None and not 1 <= k <= len(problem):
            raise ValueError(f"maj@k with k={k} needs at least k samples; problem {i} has {len(problem)}")
        voters = [(p, float(a)) for p, a in (problem if k is None else problem[:k]) if p != invalid_pred]
        if not voters:
            scores.append(0.0)
            continue
        winner = _majority([p for p, _ in voters])
        won = [a for p, a in voters if p == winner]
        scores.append(sum(won) / len(won))
    return sum(scores) / len(scores)


def group_by_problem(problem_keys: Sequence[Hashable], *columns: Sequence) -> list:
    """Regroup flat per-sample columns by problem key, keeping first-seen problem order and sample order.

    ``group_by_problem(keys, accs)`` -> ``[[acc, ...], ...]``; with two columns (preds, accs) each problem's list
    holds ``(pred, acc)`` tuples, the input of ``maj_at_k``.
    """
    for col in columns:
        if len(col) != len(problem_keys):
            raise ValueError(f"group_by_problem: a column has {len(col)} values for {len(problem_keys)} keys")
    groups: dict = {}
    for i, key in enumerate(problem_keys):
        value = columns[0][i] if len(columns) == 1 else tuple(col[i] for col in columns)
        groups.setdefault(key, []).append(value)
    return list(groups.values())


def eval_summary(problem_keys: Sequence[Hashable], preds: Sequence[str], accs: Sequence, k: int) -> dict:
    """avg@k, pass@k and maj@k (all samples vote) for flat per-sample results of repeated evaluation."""
    acc_rows = group_by_problem(problem_keys, [int(bool(a)) for a in accs])
    samples = group_by_problem(problem_keys, preds, accs)
    return {f"avg@{k}": avg_at_k(acc_rows), f"pass@{k}": pass_at_k(acc_rows, k), f"maj@{k}": maj_at_k(samples)}


# ---------------------------------------------------------------------------------------------------------------
# Rollout statistics
# ---------------------------------------------------------------------------------------------------------------

def length_stats(lengths: torch.Tensor, truncated: Optional[torch.Tensor] = None, *,
                 l_max: Optional[int] = None) -> dict:
    """Response-length mean/max/min and clip ratio (share of responses cut at the generation cap).

    ``lengths`` [B] tokens (EOS included); the clip ratio uses ``truncated`` [B] bool when given (hit the cap
    without EOS), else ``lengths >= l_max``; without either it is left out.
    """
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be [B], got shape {tuple(lengths.shape)}")
    x = lengths.double()
    empty = x.numel() == 0
    out = {
        "length_mean": math.nan if empty else x.mean().item(),
        "length_max": math.nan if empty else x.max().item(),
        "length_min": math.nan if empty else x.min().item(),
    }
    if truncated is not None:
        if truncated.shape != lengths.shape:
            raise ValueError(f"truncated {tuple(truncated.shape)} must match lengths {tuple(lengths.shape)}")
        out["clip_ratio"] = math.nan if empty else truncated.double().mean().item()
    elif l_max is not None:
        out["clip_ratio"] = math.nan if empty else (x >= l_max).double().mean().item()
    return out


def masked_sum_count(x: torch.Tensor, mask: torch.Tensor) -> tuple:
    """(sum of ``x`` over mask != 0, number of such tokens) as float64 0-dim tensors, for cross-rank reduction.

    Padding values are never read (a NaN or -inf there does not leak into the sum).
    """
    if x.shape != mask.shape:
        raise ValueError(f"values {tuple(x.shape)} and mask {tuple(mask.shape)} must have the same [B, T] shape")
    keep = mask.bool()
    return torch.where(keep, x.detach().to(torch.float64), 0.0).sum(), keep.sum().to(torch.float64)


# ---------------------------------------------------------------------------------------------------------------
# Loss metrics over micro-batches and ranks
# ---------------------------------------------------------------------------------------------------------------

_COMBINE = {"sum": torch.sum, "min": torch.amin, "max": torch.amax}


def _scalar(v) -> torch.Tensor:
    """A number or 0-dim tensor (any device) -> a 0-dim float64 CPU tensor."""
    if isinstance(v, torch.Tensor):
        return v.detach().to("cpu", torch.float64).reshape(())
    return torch.tensor(float(v), dtype=torch.float64)


def combine_metrics(per_microbatch: Sequence[dict], table: Optional[dict] = None) -> dict:
    """Metric dicts of one rank's micro-batches (values: numbers or 0-dim tensors) -> floats, each key combined as
    ``table`` (default: core.loss.METRIC_REDUCTION) says. A key a micro-batch lacks is combined over the others.

    A key the table does not name is an error: guessing sum or mean would log a number DP or M times off."""
    table = METRIC_REDUCTION if table is None else table
    out = {}
    for k in sorted({k for m in per_microbatch for k in m}):
        if k not in table:
            raise KeyError(f"metric {k!r} has no reduction: add it to core.loss.METRIC_REDUCTION ('sum' for a "
                           f"share of the mini-batch mean, 'min' / 'max' for extremes)")
        vals = torch.stack([_scalar(m[k]) for m in per_microbatch if k in m])
        out[k] = float(_COMBINE[table[k]](vals))
    return out


def reduce_over_ranks(metrics: dict, reducer, table: Optional[dict] = None) -> dict:
    """Floats of one rank -> the same on every rank: keys the table names (by their last ``/`` part) are reduced
    over ``reducer`` (core.types.Reducer) as it says; the others (grad_norm, lr: already global) pass unchanged.
    Non-numeric values are dropped."""
    table = METRIC_REDUCTION if table is None else table
    out = {}
    for k, v in metrics.items():
        if not isinstance(v, (torch.Tensor, int, float)):
            continue
        how = table.get(k.split("/")[-1]) if reducer.world_size > 1 else None
        x = _scalar(v)
        if how == "sum":
            x = reducer.sum(x)
        elif how == "max":
            x = reducer.max(x)
        elif how == "min":
            x = -reducer.max(-x)
        out[k] = float(x)
    return out
