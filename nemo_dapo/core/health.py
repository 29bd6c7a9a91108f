"""Training health: has a run diverged? Pure functions of a rollout step's metrics and thresholds passed in as numbers.

A non-finite loss or gradient already skips its optimizer update (the weights stay as they were). A run whose
updates are skipped again and again, or whose policy drifts to the uniform distribution over the vocabulary
(token entropy at its upper limit ``log V``), learns nothing more: continuing would end with accuracy 0 and look
like a finished run. The runner stops it instead, with a checkpoint and :class:`TrainingDiverged`; the usual cause
is a learning rate too high for the model.
"""
from __future__ import annotations

import math
from typing import Optional


class TrainingDiverged(RuntimeError):
    """The run stopped because it diverged; the message names the signal and the likely cause."""


def skipped_streak(streak: int, metrics: dict) -> int:
    """Optimizer updates skipped in a row, updated with one rollout step's metrics.

    ``metrics['actor/skipped']`` counts the step's skipped updates and ``metrics['actor/updates']`` all of them. A
    step with at least one applied update resets the streak to its own skipped count (counted at rollout-step
    granularity: the order of updates inside a step is not recorded); a step without updates leaves it unchanged.
    """
    updates = int(metrics.get("actor/updates", 0))
    skipped = int(metrics.get("actor/skipped", 0))
    if updates == 0:
        return streak
    return streak + skipped if skipped >= updates else skipped


def divergence(*, streak: int, max_skipped_updates: int, entropy: Optional[float], start_entropy: Optional[float],
               vocab_size: int, max_entropy_fraction: Optional[float]) -> str:
    """Why the run counts as diverged ('' = it does not).

    streak: consecutive skipped updates (:func:`skipped_streak`); ``max_skipped_updates`` <= 0 disables the check.
    entropy: mean token entropy (nats) of this step's rollouts, ``start_entropy`` that of the run's first step here;
    the run diverged when the entropy is not finite, or when it rose from below ``max_entropy_fraction * log V`` to
    at least that (a policy that starts near uniform, e.g. an untrained model, is not flagged). None disables it.
    """
    if max_skipped_updates > 0 and streak >= max_skipped_updates:
        return (f"{streak} optimizer updates in a row were skipped (non-finite loss or gradient, or no valid token) "
                f"(trainer.max_skipped_updates={max_skipped_updates})")
    if entropy is None or max_entropy_fraction is None:
        return ""
    if not math.isfinite(entropy):
        return f"the token entropy of the rollouts is {entropy}"
    limit = max_entropy_fraction * math.log(max(vocab_size, 2))
    started_below = start_entropy is not None and math.isfinite(start_entropy) and start_entropy < limit
    if started_below and entropy >= limit:
        return (f"the token entropy rose from {start_entropy:.3f} to {entropy:.3f} nats, at least "
                f"{max_entropy_fraction} of the uniform limit log({vocab_size}) = {math.log(vocab_size):.3f} "
                f"(trainer.max_entropy_fraction={max_entropy_fraction}): the policy samples noise")
    return ""


class DivergenceGuard:
    """The state the pure checks need across rollout steps (skip streak, first entropy), for a runner's loop."""

    def __init__(self, *, max_skipped_updates: int, max_entropy_fraction: Optional[float], vocab_size: int):
        self.max_skipped_updates, self.max_entropy_fraction = int(max_skipped_updates), max_entropy_fraction
        self.vocab_size, self.streak, self.start_entropy = int(vocab_size), 0, None

    def observe(self, metrics: dict) -> str:
        """Feed one rollout step's metrics; returns why the run diverged ('' = healthy)."""
        self.streak = skipped_streak(self.streak, metrics)
        entropy = metrics.get("actor/entropy")
        if self.start_entropy is None and entropy is not None:
            self.start_entropy = float(entropy)
        return divergence(streak=self.streak, max_skipped_updates=self.max_skipped_updates, entropy=entropy,
                          start_entropy=self.start_entropy, vocab_size=self.vocab_size,
                          max_entropy_fraction=self.max_entropy_fraction)


def diverged_message(reason: str, *, step: int, lr: float, checkpoint_dir: str) -> str:
    """The one-line explanation of a stop for divergence: the signal, the likely cause, what to do."""
    return (f"training diverged at rollout step {step}: {reason}. Likely cause: the learning rate optim.lr={lr} is "
            f"too high for this model; lower it (e.g. optim.lr={lr / 10:g}) and start over with resume=never or a "
            f"new run_dir. The diverged state is saved in {checkpoint_dir} for inspection; the thresholds are "
            "trainer.max_skipped_updates and trainer.max_entropy_fraction")
