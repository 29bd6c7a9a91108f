"""History-based prompt skipping: do not generate for prompts whose recent groups carried no gradient.

Dynamic sampling (paper Sec. 3.2) throws away groups whose G responses are all correct or all wrong, after paying
to generate them. Over several epochs a prompt whose last groups were uninformative mostly is again, so
:class:`PromptHistory` lets the prompt sampler skip it before generation.

The rule, per prompt index ``i``:

* ``streak[i]``: how many of the prompt's most recent scored groups in a row were uninformative (every response
  equally correct: accuracy 0 or 1); a group with 0 < accuracy < 1 resets it to 0.
* When the sampler reaches ``i``, it is skipped with probability ``p = 1 - (1 - skip_prob) ** streak[i]`` (each
  uninformative group in a row is one more piece of evidence; no history, no skip).
* Never forever: after ``max_skips`` skips in a row the prompt is drawn whatever its streak (``skips[i]`` counts
  skips since it was last drawn), and its next scored group updates the streak. So every prompt is generated at
  least once every ``max_skips + 1`` epochs and a prompt that became informative is found again; ``max_skips`` is
  at most ``MAX_SKIPS`` (100), so that this happens within a run.

The decision is a pure function of ``(seed, i, draws_seen)`` through a hash, not of an RNG stream: every
data-parallel rank decides the same, and a resumed run decides as the uninterrupted one would. Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass

from nemo_dapo.core.loop_data import mix_seed
from nemo_dapo.core.settings import MAX_SKIPS


@dataclass(frozen=True)
class SkipRule:
    """``skip_prob`` in [0, 1): skip probability after one uninformative group; ``max_skips`` in [1,
    :data:`~nemo_dapo.core.settings.MAX_SKIPS`]: skips in a row after which the prompt is drawn anyway."""

    skip_prob: float = 0.5
    max_skips: int = 3

    def __post_init__(self):
        if not (isinstance(self.skip_prob, (int, float)) and 0.0 <= self.skip_prob < 1.0):
            raise ValueError(f"SkipRule.skip_prob={self.skip_prob!r} must be in [0, 1) (0 never skips)")
        if isinstance(self.max_skips, bool) or not isinstance(self.max_skips, int) or \
                not 1 <= self.max_skips <= MAX_SKIPS:
            raise ValueError(f"SkipRule.max_skips={self.max_skips!r} must be an integer in [1, {MAX_SKIPS}] (the "
                             "retry bound: a prompt is generated at least once every max_skips + 1 epochs)")

    def probability(self, streak: int, skips: int) -> float:
        """Skip probability of a prompt with ``streak`` uninformative groups in a row, skipped ``skips`` times
        since it was last drawn."""
        if streak <= 0 or skips >= self.max_skips:
            return 0.0
        return 1.0 - (1.0 - self.skip_prob) ** streak


class PromptHistory:
    """Per-prompt ``streak`` / ``skips`` (see the module docstring) and the skip decision.

    ``consider(i)`` is asked once per candidate draw and returns True to skip; ``record(i, acc)`` is told the
    per-response accuracies of each scored group of prompt ``i``. State: plain ints (``state_dict``).
    """

    def __init__(self, rule: SkipRule, *, seed: int = 0):
        self.rule, self.seed = rule, int(seed)
        self.streak: dict = {}
        self.skips: dict = {}
        self.considered = 0  # candidate draws seen: the hash counter of the decisions
        self.skipped = 0  # candidate draws skipped

    def consider(self, index: int) -> bool:
        """True: skip prompt ``index`` this time (counted); False: draw it (its skip count restarts)."""
        self.considered += 1
        p = self.rule.probability(self.streak.get(index, 0), self.skips.get(index, 0))
        if p > 0.0 and _uniform(self.seed, index, self.considered) < p:
            self.skips[index] = self.skips.get(index, 0) + 1
            self.skipped += 1
            return True
        self.skips.pop(index, None)
        return False

    def record(self, index: int, acc) -> None:
        """A scored group of prompt ``index``; ``acc``: its G per-response accuracies (0/1 numbers)."""
        values = [float(a) for a in acc]
        if not values:
            return
        uninformative = all(v == values[0] for v in values) and values[0] in (0.0, 1.0)
        if uninformative:
            self.streak[index] = self.streak.get(index, 0) + 1
        else:
            self.streak.pop(index, None)

    def state_dict(self) -> dict:
        return dict(skip_prob=self.rule.skip_prob, max_skips=self.rule.max_skips, seed=self.seed,
                    considered=self.considered, skipped=self.skipped,
                    streak=sorted(self.streak.items()), skips=sorted(self.skips.items()))

    def load_state_dict(self, state: dict) -> None:
        """Restore the counters and per-prompt history; the rule stays this run's (settings may be changed)."""
        self.considered, self.skipped = int(state["considered"]), int(state["skipped"])
        self.streak = {int(k): int(v) for k, v in state["streak"]}
        self.skips = {int(k): int(v) for k, v in state["skips"]}


def _uniform(*values: int) -> float:
    """A number in [0, 1) fixed by a few integers (the loop's seed mixer, so no RNG state needs resuming)."""
    return (mix_seed(*values) >> 10) / float(1 << 53)
