"""Dynamic sampling (DAPO section 3.2, Algorithm 1) as a batch filler.

The step loop draws prompts, generates G responses each, scores them, and hands the scored groups to
``BatchFiller.add``. The filler keeps the groups whose UNSHAPED accuracy is strictly between 0 and 1 (the others
give zero advantage), reports ``ready()`` once ``num_groups`` are held, and ``take()`` returns them. Unlike the
reference, surplus kept groups are not discarded: they wait for the next step (at most ``max_age`` steps), and
an exhausted generation budget is a configured policy rather than a crash. ``next_gen_batch_size`` sizes the
next generation batch from the observed pass rate instead of a fixed 3x over-sampling.

Loop sketch:
    while not filler.ready():
        filler.add(generate_and_score(filler.next_gen_batch_size()))   # may raise BudgetExhausted
    groups = filler.take()          # [] only under train_partial when nothing was kept: skip the update then
    stats = filler.step_stats()
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

import torch

BUDGET_POLICIES = ("raise", "train_partial", "unbounded")
_COUNTERS = ("kept", "filtered_all_correct", "filtered_all_wrong", "num_gen_batches", "generated_groups")


@dataclass
class Group:
    """The G scored responses of one prompt draw."""

    uid: int  # explicit id assigned when the prompt was drawn (never derived from the prompt text)
    acc: torch.Tensor  # [G] float 0/1, UNSHAPED correctness: the filter looks only at this
    rewards: torch.Tensor  # [G] float, shaped reward (correctness + overlong), used later for advantages
    payload: Any = None  # backend data (the loop stores a RolloutBatch of the G samples); must be torch.save-able
    age: int = 0  # rollout steps this group has already been carried over


class BudgetExhausted(RuntimeError):
    """The generation budget of a step ran out before the training batch was full (policy "raise")."""


def _validate_group(g: Group) -> None:
    if not isinstance(g, Group):
        raise TypeError(f"BatchFiller.add takes Group objects, got {type(g).__name__}")
    if not isinstance(g.uid, int) or isinstance(g.uid, bool):
        raise TypeError(f"Group.uid must be a Python int (the prompt draw's id), got {type(g.uid).__name__}")
    if g.acc.dim() != 1 or g.acc.numel() == 0:
        raise ValueError(f"group {g.uid}: acc must be 1-D [G] with G >= 1, got shape {tuple(g.acc.shape)}")
    if not bool(((g.acc == 0) | (g.acc == 1)).all()):
        raise ValueError(f"group {g.uid}: acc must be 0/1 correctness (unshaped), got {g.acc.tolist()}")
    if g.rewards.shape != g.acc.shape:
        raise ValueError(f"group {g.uid}: rewards {tuple(g.rewards.shape)} and acc {tuple(g.acc.shape)} differ")
    if not isinstance(g.age, int) or g.age < 0:
        raise ValueError(f"group {g.uid}: age must be an int >= 0, got {g.age!r}")


class BatchFiller:
    """Accumulates informative groups into training batches of ``num_groups`` groups.

    enabled: filter groups (False keeps every group: dynamic sampling off, same plumbing).
    max_gen_batches: generation batches allowed per step before ``on_budget_exhausted`` applies:
      "raise" -> ``add`` raises BudgetExhausted; "train_partial" -> ``ready()`` turns true and ``take`` returns
      what was kept (possibly []: the loop then skips the update); "unbounded" -> keep generating.
    max_age: steps a surplus kept group may wait; 0 discards the surplus as the reference does.
    gen_batch_size: prompts per generation batch when ``adaptive`` is False (default num_groups).
    adaptive: size each generation batch as ceil(needed / pass_rate * safety), clamped to
      [1, max_gen_batch_size] (default max(gen_batch_size, 3 * num_groups), the reference's generation batch).
    prior_pass_rate, prior_weight: the pass-rate estimate starts at prior_pass_rate, worth prior_weight groups.
    pass_rate_memory: weight of past steps' counts, applied once per step (0 = this step only).
    """

    def __init__(self, num_groups: int, *, enabled: bool = True, max_gen_batches: int = 10,
                 on_budget_exhausted: str = "raise", max_age: int = 1, gen_batch_size: Optional[int] = None,
                 adaptive: bool = True, max_gen_batch_size: Optional[int] = None, prior_pass_rate: float = 0.5,
                 prior_weight: float = 8.0, pass_rate_memory: float = 0.7, safety: float = 1.1):
        def positive_int(name, v):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"BatchFiller: {name} must be an int >= 1, got {v!r}")

        positive_int("num_groups", num_groups)
        positive_int("max_gen_batches", max_gen_batches)
        if on_budget_exhausted not in BUDGET_POLICIES:
            raise ValueError(f"BatchFiller: on_budget_exhausted={on_budget_exhausted!r}, expected one of "
                             f"{BUDGET_POLICIES}")
        if not isinstance(max_age, int) or max_age < 0:
            raise ValueError(f"BatchFiller: max_age must be an int >= 0 (0 = discard surplus), got {max_age!r}")
        gen_batch_size = num_groups if gen_batch_size is None else gen_batch_size
        positive_int("gen_batch_size", gen_batch_size)
        max_gen_batch_size = max(gen_batch_size, 3 * num_groups) if max_gen_batch_size is None else max_gen_batch_size
        positive_int("max_gen_batch_size", max_gen_batch_size)
        if not 0 < prior_pass_rate <= 1 or not prior_weight > 0:
            raise ValueError(f"BatchFiller: need 0 < prior_pass_rate <= 1 and prior_weight > 0, got "
                             f"{prior_pass_rate}, {prior_weight}")
        if not 0 <= pass_rate_memory <= 1 or not safety >= 1:
            raise ValueError(f"BatchFiller: need 0 <= pass_rate_memory <= 1 and safety >= 1, got "
                             f"{pass_rate_memory}, {safety}")
        self.num_groups, self.enabled, self.max_gen_batches = num_groups, enabled, max_gen_batches
        self.on_budget_exhausted, self.max_age, self.gen_batch_size = on_budget_exhausted, max_age, gen_batch_size
        self.adaptive, self.max_gen_batch_size = adaptive, max_gen_batch_size
        self.prior_pass_rate, self.prior_weight = prior_pass_rate, prior_weight
        self.pass_rate_memory, self.safety = pass_rate_memory, safety
        self._groups: list[Group] = []
        self._count = dict.fromkeys(_COUNTERS, 0)
        self._carried_in = 0
        self._past_kept = 0.0  # decayed counts of finished steps, for the pass-rate estimate
        self._past_generated = 0.0
        self._last_stats: Optional[dict] = None
        self._between_steps = False

    # ---- filling -------------------------------------------------------------------------------------------------
    def add(self, groups: Sequence[Group]) -> None:
        """Record one generation batch of scored groups; keep those with 0 < mean(acc) < 1."""
        self._check_new(groups)  # a rejected batch does not count
        self.begin_gen_batch()
        self.add_groups(groups)
        self.end_gen_batch()

    # A streamed generation batch hands its groups over as they finish: begin, add_groups per group, end.
    def begin_gen_batch(self) -> None:
        self._between_steps = False
        self._count["num_gen_batches"] += 1

    def add_groups(self, groups: Sequence[Group]) -> None:
        """Groups of the generation batch in progress (see :meth:`begin_gen_batch`)."""
        self._check_new(groups)
        for g in groups:
            self._count["generated_groups"] += 1
            mean_acc = float(g.acc.float().mean())
            if not self.enabled or 0.0 < mean_acc < 1.0:
                self._groups.append(g)
                self._count["kept"] += 1
            elif mean_acc >= 1.0:
                self._count["filtered_all_correct"] += 1
            else:
                self._count["filtered_all_wrong"] += 1

    def _check_new(self, groups: Sequence[Group]) -> None:
        held = {g.uid for g in self._groups}
        for g in groups:
            _validate_group(g)
            if g.uid in held:
                raise ValueError(f"group uid {g.uid} appears twice in the filler; give every prompt draw its own "
                                 "uid (duplicated prompts must not merge into one group)")
            held.add(g.uid)

    def end_gen_batch(self) -> None:
        """Close the generation batch; under "raise" an exhausted budget with too few groups raises here."""
        if self.on_budget_exhausted == "raise" and self._budget_spent() and not self.full():
            raise BudgetExhausted(self._exhausted_message())

    def full(self) -> bool:
        """num_groups informative groups are held (a streamed batch may stop generating)."""
        return len(self._groups) >= self.num_groups

    def _budget_spent(self) -> bool:
        return self.on_budget_exhausted != "unbounded" and self._count["num_gen_batches"] >= self.max_gen_batches

    def _exhausted_message(self) -> str:
        c = self._count
        return (f"dynamic sampling kept {len(self._groups)} of {self.num_groups} groups after {c['num_gen_batches']} "
                f"generation batches ({c['generated_groups']} groups generated: {c['filtered_all_wrong']} all wrong, "
                f"{c['filtered_all_correct']} all correct). Fix one of: raise max_gen_batches (now "
                f"{self.max_gen_batches}); set on_budget_exhausted='train_partial' (train on the kept groups) or "
                f"'unbounded' (keep sampling); raise max_gen_batch_size / gen_batch_size; or use data whose pass "
                f"rate is neither ~0 nor ~1 for this model.")

    def ready(self) -> bool:
        """True when a training batch can be taken: num_groups held, or (train_partial) the budget is spent."""
        if self.full():
            return True
        return self.on_budget_exhausted == "train_partial" and self._budget_spent()

    def take(self) -> list[Group]:
        """The training batch, oldest groups first; surplus waits with age + 1 or is discarded past max_age."""
        if not self.ready():
            raise RuntimeError(f"BatchFiller.take() before ready(): {len(self._groups)} of {self.num_groups} groups "
                               "held; add() another generation batch of next_gen_batch_size() prompts first")
        held = sorted(self._groups, key=lambda g: -g.age)  # stable: arrival order within an age
        batch, surplus = held[:self.num_groups], held[self.num_groups:]
        carried = [replace(g, age=g.age + 1) for g in surplus if g.age + 1 <= self.max_age]
        stats = self._stats(carried=len(carried), discarded=len(surplus) - len(carried), trained_groups=len(batch))
        m = self.pass_rate_memory
        self._past_kept = m * self._past_kept + self._count["kept"]
        self._past_generated = m * self._past_generated + self._count["generated_groups"]
        self._groups, self._carried_in = carried, len(carried)
        self._count = dict.fromkeys(_COUNTERS, 0)
        self._last_stats, self._between_steps = stats, True
        return batch

    # ---- over-sampling -------------------------------------------------------------------------------------------
    def pass_rate_estimate(self) -> float:
        """Smoothed kept/generated group ratio: past steps (decayed) + this step + the prior."""
        kept = self._past_kept + self._count["kept"]
        generated = self._past_generated + self._count["generated_groups"]
        return (kept + self.prior_pass_rate * self.prior_weight) / (generated + self.prior_weight)

    def next_gen_batch_size(self) -> int:
        """Prompts to draw for the next generation batch."""
        if not self.adaptive:
            return self.gen_batch_size
        return self._proposal(max(self.num_groups - len(self._groups), 1))

    def next_step_gen_batch_size(self) -> int:
        """Prompts the next step's first generation batch will draw, asked once this step's batch is full (the
        overlap draws them a step early): the batch less the surplus that take() will carry over, over the
        pass-rate estimate (this step's groups counted)."""
        if not self.adaptive:
            return self.gen_batch_size
        surplus = max(len(self._groups) - self.num_groups, 0)
        return self._proposal(max(self.num_groups - surplus, 1))

    def _proposal(self, needed: int) -> int:
        if not self.enabled:
            return min(needed, self.max_gen_batch_size)
        # Surplus is carried over, so over-shooting costs little; the safety margin avoids a second round.
        proposal = math.ceil(needed / max(self.pass_rate_estimate(), 1e-6) * self.safety)
        return max(1, min(proposal, self.max_gen_batch_size))

    # ---- reporting and checkpointing -----------------------------------------------------------------------------
    def _stats(self, **at_take) -> dict:
        c = self._count
        stats = dict(c, carried=0, discarded=0, trained_groups=0, carried_in=self._carried_in,
                     pass_rate=c["kept"] / c["generated_groups"] if c["generated_groups"] else 0.0,
                     pass_rate_estimate=self.pass_rate_estimate())
        stats.update(at_take)
        return stats

    def step_stats(self) -> dict:
        """Counters of the step just taken (right after take()) or of the step in progress (otherwise).

        kept / filtered_all_correct / filtered_all_wrong / generated_groups / num_gen_batches: this step's
        generation; carried: surplus groups kept for the next step; discarded: surplus dropped past max_age;
        carried_in: groups carried into this step; trained_groups: groups returned by take(); pass_rate:
        kept / generated_groups of this step; pass_rate_estimate: the smoothed rate used for over-sampling.
        """
        return dict(self._last_stats) if self._between_steps else self._stats()

    def state_dict(self) -> dict:
        groups = [dict(uid=g.uid, acc=g.acc, rewards=g.rewards, payload=g.payload, age=g.age) for g in self._groups]
        return dict(version=1, groups=groups, count=dict(self._count), carried_in=self._carried_in,
                    past_kept=self._past_kept, past_generated=self._past_generated, last_stats=self._last_stats,
                    between_steps=self._between_steps)

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != 1:
            raise ValueError(f"BatchFiller state version {state.get('version')!r} is not supported (expected 1)")
        self._groups = [Group(**g) for g in state["groups"]]
        for g in self._groups:
            _validate_group(g)
        self._count = {k: int(state["count"][k]) for k in _COUNTERS}
        self._carried_in = int(state["carried_in"])
        self._past_kept, self._past_generated = float(state["past_kept"]), float(state["past_generated"])
        self._last_stats = state["last_stats"]
        self._between_steps = bool(state["between_steps"])
