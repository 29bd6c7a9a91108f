"""Held-out evaluation with the generator: n samples per problem, scored by the same RewardFn as training.

Accuracy is the mean over all samples (avg@n); the per-sample results are returned so that callers can compute
pass@k / maj@k from them. Under data parallelism each rank evaluates a contiguous slice of the problems and the
results are gathered, so every rank returns the same full table.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from nemo_dapo.core.loop_data import PromptSet, mix_seed
from nemo_dapo.core.metrics import length_stats
from nemo_dapo.core.types import Generator, LocalReducer, Reducer, RewardFn


@dataclass
class EvalResult:
    """Per-problem, per-sample outcomes; rows follow the order of the evaluated problems."""

    acc: torch.Tensor  # [N, n] float 0/1
    lengths: torch.Tensor  # [N, n] long, response tokens (EOS included)
    truncated: torch.Tensor  # [N, n] bool
    preds: list  # N lists of n extracted answers (strings)
    seconds: float = 0.0

    @property
    def accuracy(self) -> float:
        """Mean correctness over every sample of every problem (avg@n)."""
        return float(self.acc.float().mean()) if self.acc.numel() else 0.0

    def summary(self, prefix: str = "val/") -> dict:
        return {f"{prefix}accuracy": self.accuracy,
                f"{prefix}pass_at_n": float(self.acc.amax(-1).mean()) if self.acc.numel() else 0.0,
                **{f"{prefix}{k}": v for k, v in length_stats(self.lengths.reshape(-1), self.truncated.reshape(-1))
                   .items() if k in ("length_mean", "clip_ratio")},
                f"{prefix}problems": float(self.acc.shape[0]), f"{prefix}seconds": self.seconds}


def _evaluate_slice(generator: Generator, reward_fn: RewardFn, prompts: PromptSet, indices: Sequence[int], *,
                    n_samples: int, max_new_tokens: int, temperature: float, top_p: float, seed: int,
                    batch_size: int) -> tuple:
    acc, lengths, truncated, preds = [], [], [], []
    per_batch = max(1, batch_size // n_samples)  # problems per generate call
    for start in range(0, len(indices), per_batch):
        rows = list(indices[start:start + per_batch])
        ids, mask = prompts.collate(rows)
        ids, mask = ids.repeat_interleave(n_samples, 0), mask.repeat_interleave(n_samples, 0)
        out = generator.generate(ids, mask, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                 seed=mix_seed(seed, rows[0]))
        truths = [prompts.ground_truths[i] for i in rows for _ in range(n_samples)]
        _, a, p = reward_fn(out.response_ids, out.response_mask, truths)
        acc.append(a.float().view(len(rows), n_samples))
        lengths.append(out.response_mask.sum(-1).long().view(len(rows), n_samples))
        truncated.append(out.truncated.bool().view(len(rows), n_samples))
        preds.extend([list(p[k * n_samples:(k + 1) * n_samples]) for k in range(len(rows))])
    if not acc:
        return torch.zeros(0, n_samples), torch.zeros(0, n_samples, dtype=torch.long), \
            torch.zeros(0, n_samples, dtype=torch.bool), []
    return torch.cat(acc), torch.cat(lengths), torch.cat(truncated), preds


def evaluate(generator: Generator, reward_fn: RewardFn, prompts: PromptSet, *, n_samples: int = 1,
             max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
             batch_size: int = 256, indices: Optional[Sequence[int]] = None,
             reducer: Optional[Reducer] = None) -> EvalResult:
    """Sample ``n_samples`` responses for each problem of ``prompts`` (or of ``indices``) and score them.

    Each generate call is seeded from ``seed`` and its first problem index, so a run is reproducible for a given
    ``batch_size`` (responses per generate call) and number of ranks.
    """
    if n_samples < 1:
        raise ValueError(f"evaluate: n_samples must be >= 1, got {n_samples}")
    reducer = reducer or LocalReducer()
    indices = list(range(len(prompts))) if indices is None else list(indices)
    lo = reducer.rank * len(indices) // reducer.world_size
    hi = (reducer.rank + 1) * len(indices) // reducer.world_size
    t0 = time.perf_counter()
    part = _evaluate_slice(generator, reward_fn, prompts, indices[lo:hi], n_samples=n_samples,
                           max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                           batch_size=batch_size)
    parts = reducer.gather_objects(part)
    return EvalResult(acc=torch.cat([p[0] for p in parts]), lengths=torch.cat([p[1] for p in parts]),
                      truncated=torch.cat([p[2] for p in parts]), preds=[x for p in parts for x in p[3]],
                      seconds=time.perf_counter() - t0)
