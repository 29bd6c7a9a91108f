"""The DAPO step loop (paper Algorithm 1), written once against the Protocols of types.py.

One call of :meth:`DAPOLoop.step` is one rollout step:

    while the dynamic-sampling filler is not full:                       (generation batches)
        draw prompts (explicit uids) -> generate G responses each -> score (verifier + soft overlong penalty)
        -> one Group per prompt -> filler (streaming: each group as soon as its G responses are done)
    take the training batch -> recompute old log-probs -> group advantages on the whole batch (shaped rewards)
    -> ppo_epochs x mini-batches of mini_batch_size samples, each one optimizer update with its GLOBAL token count

The CPU path (nemo_dapo/local) and the NeMo-Aligner path differ only in the Policy, Generator, RewardFn and Reducer
they pass in. Under data parallelism every rank runs this same code (SPMD): each rank generates and scores its share
of a generation batch, ``gather_objects`` gives every rank all scored groups (so the filler state is identical
everywhere), advantages are computed on the global batch, and each mini-batch is split between ranks by tokens.

Counters are kept apart: ``rollout_steps`` (training batches), ``gen_batches`` (generation rounds),
``optimizer_steps`` (updates), ``consumed_prompts`` / ``consumed_samples`` (prompt draws / responses generated).
The streamed generation paths (and partial rollouts) are in loop_stream.py, the step's metrics in loop_metrics.py.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, fields
from typing import Callable, Optional

import torch

from nemo_dapo.core.advantages import group_advantages
from nemo_dapo.core.dynamic_sampling import BatchFiller, Group
from nemo_dapo.core.loop_data import PromptSampler, PromptSet, balanced_split, mix_seed
from nemo_dapo.core.loop_metrics import (generation_metrics, mean_metrics, mismatch_by_lag, rollout_metrics,
                                         staleness_metrics)
from nemo_dapo.core.loop_stream import StreamingPhase
from nemo_dapo.core.loss import METRIC_REDUCTION
from nemo_dapo.core.metrics import reduce_over_ranks
from nemo_dapo.core.overlong import soft_overlong_penalty
from nemo_dapo.core.partial import SuspendedGroup
from nemo_dapo.core.prompt_history import PromptHistory, SkipRule
from nemo_dapo.core.settings import OverlongSettings, SkipHistorySettings, problems as algorithm_problems
from nemo_dapo.core.types import (Generation, Generator, LocalReducer, LossFn, LossInput, Policy, Reducer,
                                  RewardFn, RolloutBatch)

log = logging.getLogger("nemo_dapo")

# How a rank's train_step metric combines over ranks: the loss metrics (and the loss share) as core.loss says, a skip
# anywhere is a skip everywhere; the rest (grad_norm, lr) is global.
_POLICY_METRIC_REDUCTION = {**METRIC_REDUCTION, "skipped": "max"}

FILLER_FULL_POLICIES = ("abort", "finish", "suspend")  # suspend: partial rollouts (core/partial.py)
FILL_ORDERS = ("finish", "prompt")  # streamed groups enter the filler as they finish, or in prompt order
# Partial-rollout counters (reported as partial/* only with on_filler_full "suspend"): groups / tokens continued
# after a refit, and dropped because their oldest token was more than max_staleness versions old.
PARTIAL_COUNTERS = ("resumed_groups", "resumed_tokens", "stale_groups", "stale_tokens")
COUNTERS = ("rollout_steps", "gen_batches", "optimizer_steps", "consumed_prompts", "consumed_samples",
            "skipped_updates", "trained_samples", "trained_tokens", "generated_tokens", "aborted_tokens",
            "skipped_prompts")
# A step's phases, logged as timing/<phase>_s: generation (in prompt order with the overlap, the wait for the round's
# end too), rewards, the old-log-prob pass, the updates, and the refit (the trainer's time in the generator's
# update_weights: the weights gathered, sent and loaded by the engine; in the NeMo-Aligner trainer also the offloads
# and the engine's wake of its refit phase, aligner/engine_generation.py).
TIMED_PHASES = ("gen", "reward", "old_logp", "update", "refit")


@dataclass(frozen=True)
class LoopSettings:
    """The numbers the loop needs (the filler and the loss carry their own settings). Built by
    core/settings.build_loop_parts from the algorithm block, whose sub-settings it holds as they are: every field is
    required, the defaults live in the YAML."""

    group_size: int  # G: responses per prompt
    mini_batch_size: int  # samples per optimizer update (paper: 512 = 32 prompts x 16)
    max_new_tokens: int  # generation cap (EOS included)
    ppo_epochs: int  # passes over the training batch (mu in Algorithm 1)
    temperature: float
    top_p: float
    adv_eps: float  # A = (R - mean) / (std + adv_eps)
    scale_by_std: bool  # False: Dr. GRPO advantages (no std division)
    overlong: OverlongSettings  # Soft Overlong Punishment added to the reward (core/overlong.py)
    # History-based prompt skipping (core/prompt_history.py): the sampler passes over prompts whose recent groups
    # were uninformative, skip probability 1 - (1 - skip_prob)^streak, at most max_skips times in a row.
    skip_history: SkipHistorySettings
    shuffle_minibatches: bool  # shuffle samples before cutting mini-batches (seeded by the step)
    seed: int
    # Streaming dynamic sampling: submit a generation batch at once, score each group as it finishes, and once
    # the filler is full either "abort" the requests still running or let them "finish" into the carried-over
    # groups. Needs a generator with ``stream`` (engines/generator.py); False = one blocking generate per batch.
    streaming: bool
    on_filler_full: str
    # Streaming only: "finish" hands each group to the filler as it finishes (fastest); "prompt" hands them over in
    # prompt order (a finished group waits for those drawn before it), so which groups train does not depend on
    # the engine's timing (with partial rollouts it generates in rounds: DAPOLoop's round_tokens). The batch path is
    # always in prompt order.
    fill_order: str

    def __post_init__(self):
        for name in ("group_size", "mini_batch_size", "max_new_tokens", "ppo_epochs"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"LoopSettings.{name} must be >= 1, got {getattr(self, name)}")
        if self.on_filler_full not in FILLER_FULL_POLICIES:
            raise ValueError(f"LoopSettings.on_filler_full must be one of {FILLER_FULL_POLICIES}, got "
                             f"{self.on_filler_full!r}")
        if self.fill_order not in FILL_ORDERS:
            raise ValueError(f"LoopSettings.fill_order must be one of {FILL_ORDERS}, got {self.fill_order!r}")
        ov = {f"overlong.{f.name}": getattr(self.overlong, f.name) for f in fields(self.overlong)}
        found = algorithm_problems(ov, self.max_new_tokens)  # l_cache against the cap a null l_max stands for
        if found:
            raise ValueError("; ".join(f"LoopSettings.{name} {message}" for name, message in found))

    @property
    def penalty_l_max(self) -> int:
        """L_max of the penalty: ``overlong.l_max``, or the generation cap when that is null (the paper's choice)."""
        return self.max_new_tokens if self.overlong.l_max is None else self.overlong.l_max


def _repeat_rows(t: torch.Tensor, g: int) -> torch.Tensor:
    return t.repeat_interleave(g, dim=0)


class DAPOLoop(StreamingPhase):
    """Callable step by step: ``metrics = loop.step()``; ``loop.state_dict()`` / ``load_state_dict()`` for resume.

    ``loss_fn``: a LossFn (core/types.py; core/settings.build_loss builds the DAPO one); its ``normalizer`` gives a
    micro-batch's share of the global normaliser that each update passes the policy (core/loss.py).
    """

    def __init__(self, *, policy: Policy, generator: Generator, reward_fn: RewardFn, loss_fn: LossFn,
                 prompts: PromptSet, filler: BatchFiller, settings: LoopSettings,
                 sampler: Optional[PromptSampler] = None, reducer: Optional[Reducer] = None,
                 max_staleness: int = 0, overlap: bool = False, round_tokens: Optional[int] = None):
        self.policy, self.generator, self.reward_fn, self.loss_fn = policy, generator, reward_fn, loss_fn
        self.prompts, self.filler, self.settings = prompts, filler, settings
        self.sampler = sampler or PromptSampler(len(prompts), seed=settings.seed)
        sh = settings.skip_history
        if sh.enabled and self.sampler.history is None:
            self.sampler.history = PromptHistory(SkipRule(float(sh.skip_prob), int(sh.max_skips)),
                                                 seed=mix_seed(settings.seed, 104729))
        self.reducer = reducer or LocalReducer()
        self.counters = dict.fromkeys(COUNTERS, 0)
        # Partial rollouts: the generator's weight version (refits so far), the suspended groups, their counters.
        if not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(f"max_staleness must be an int >= 0 (weight versions), got {max_staleness!r}")
        self.max_staleness, self._version = max_staleness, 0
        self._suspended: list = []
        # overlap (one-step-off): once the filler is full the engine goes on generating (the rest of the batch and
        # the next batch's prompts) while the trainer trains; parked before the refit (loop_stream._park_live). In
        # prompt order that work is one round, run to its end (loop_stream._round_ahead).
        self.overlap, self._live, self._ahead, self._sample_cap = bool(overlap), [], None, None
        self._drawn_ahead = 0  # prompts drawn ahead for the next step, consumed when it begins
        if self.overlap and not self._suspending():
            raise ValueError("overlap needs partial rollouts: on_filler_full='suspend' with max_staleness >= 1, "
                             "streaming, and under data parallelism fill_order='prompt' (the work left running is "
                             "suspended at the refit)")
        self.partial_counters = dict.fromkeys(PARTIAL_COUNTERS, 0)
        # Partial rollouts in prompt order generate in rounds of round_tokens tokens (loop_stream._stream_rounds).
        self.round_tokens = None if round_tokens is None else int(round_tokens)
        if self._suspending() and settings.fill_order == "prompt":
            if self.round_tokens is None or self.round_tokens < 1:
                raise ValueError("fill_order='prompt' with on_filler_full='suspend' generates in rounds: give "
                                 f"round_tokens >= 1 (tokens per sample and round), got {round_tokens!r}")
        if self._partial_mode() and settings.streaming and not self._suspending():
            raise ValueError("partial rollouts under data parallelism run in rounds: set fill_order='prompt' with "
                             "round_tokens (streamed in finishing order, each rank's share would stop elsewhere)")
        if self._partial_mode() and not callable(getattr(generator, "stream_requests", None)):
            raise ValueError(f"on_filler_full='suspend' needs a generator with stream_requests() (an engine server "
                             f"client); {type(generator).__name__} has none")
        if settings.streaming and not callable(getattr(generator, "stream", None)):
            raise ValueError(f"streaming dynamic sampling needs a generator with stream() (an engine server "
                             f"client); {type(generator).__name__} has none: set streaming off")
        if settings.mini_batch_size < self.reducer.world_size:
            raise ValueError(f"mini_batch_size={settings.mini_batch_size} is smaller than the "
                             f"{self.reducer.world_size} data-parallel ranks; every rank needs a share of each "
                             "mini-batch")

    # ---- phase 1: generation batches until the filler is full -----------------------------------------------------
    def _partial_mode(self) -> bool:
        """Partial rollouts configured (suspend with max_staleness >= 1; max_staleness 0 resumes nothing: abort)."""
        return self.settings.on_filler_full == "suspend" and self.max_staleness > 0

    def _suspending(self) -> bool:
        # Under data parallelism only the rounds in prompt order suspend (between rounds every rank holds the state
        # of every group); a batch streamed in finishing order is drained there (see _generate_groups).
        s = self.settings
        return self._partial_mode() and s.streaming and (self.reducer.world_size == 1 or s.fill_order == "prompt")

    def _generate_groups(self, n_prompts: int, timers: dict) -> list:
        """One generation batch: draw prompts, generate, score, hand the groups to the filler; returns them all.
        With partial rollouts the suspended groups are continued first and count toward the batch's size."""
        s, red = self.settings, self.reducer
        resumed = self._resumable() if self._suspending() else []
        n_prompts = max(n_prompts - len(resumed), 0)
        skipped_before = self.sampler.skipped
        indices, uids = self.sampler.draw(n_prompts) if n_prompts else ([], [])
        self.counters["skipped_prompts"] += self.sampler.skipped - skipped_before
        self.counters["gen_batches"] += 1
        self.counters["consumed_prompts"] += n_prompts
        self.counters["consumed_samples"] += n_prompts * s.group_size
        # Each rank generates a contiguous slice of the prompts; all ranks drew the same prompts.
        lo, hi = self._share(n_prompts)
        self.filler.begin_gen_batch()
        if self._suspending() and s.fill_order == "prompt":
            groups = self._stream_rounds(indices, uids, resumed, timers)
        elif self._suspending():
            groups = self._stream_partial(indices, uids, resumed, timers)
        elif s.streaming and red.world_size == 1:
            groups = self._stream_and_score(indices, uids, timers)
        else:
            # Under data parallelism the filler sees a batch only once every rank's share is gathered, so a
            # streamed batch cannot stop early there: ranks drain their streams (same result, no abort saving).
            groups = self._generate_and_score(indices[lo:hi], uids[lo:hi], timers) if hi > lo else []
            groups = [g for part in red.gather_objects(groups) for g in part]
            self.counters["generated_tokens"] += sum(g.payload.num_tokens() for g in groups)
            self.filler.add_groups(groups)
        self.filler.end_gen_batch()
        if self.sampler.history is not None:
            # Every rank holds every scored group here, so every rank's history stays the same.
            index_of = dict(zip(uids, indices))
            index_of.update((g.uid, g.index) for g in resumed)
            for group in groups:
                self.sampler.history.record(index_of[group.uid], group.acc.tolist())
        return groups

    def _seed(self, rank: Optional[int] = None) -> int:
        """The generation batch's sampling seed for ``rank`` (default: this one)."""
        return mix_seed(self.settings.seed, self.counters["gen_batches"], self.reducer.rank if rank is None else rank)

    def _share(self, n: int) -> tuple:
        """This rank's contiguous slice ``(lo, hi)`` of ``n`` items split over the data-parallel ranks."""
        red = self.reducer
        return red.rank * n // red.world_size, (red.rank + 1) * n // red.world_size

    def _generate_and_score(self, indices, uids, timers) -> list:
        s, g = self.settings, self.settings.group_size
        prompt_ids, prompt_mask = self.prompts.collate(indices)
        t0 = time.perf_counter()
        if s.streaming:
            stream = self.generator.stream(prompt_ids, prompt_mask, n=g, max_new_tokens=s.max_new_tokens,
                                           temperature=s.temperature, top_p=s.top_p, seed=self._seed())
            outs = dict(stream)
            out = Generation.cat([outs[k] for k in range(len(indices))], self.prompts.pad_id)
        else:
            out = self.generator.generate(_repeat_rows(prompt_ids, g), _repeat_rows(prompt_mask, g),
                                          max_new_tokens=s.max_new_tokens, temperature=s.temperature,
                                          top_p=s.top_p, seed=self._seed())
        timers["gen"] += time.perf_counter() - t0
        return self._score(indices, uids, prompt_ids, prompt_mask, out, timers)

    def _score(self, indices, uids, prompt_ids, prompt_mask, out, timers) -> list:
        """Groups of G scored samples from prompts [N, P] and their responses [N * G, R] (prompt-major order)."""
        s, g = self.settings, self.settings.group_size
        t1 = time.perf_counter()
        prompt_ids, prompt_mask = _repeat_rows(prompt_ids, g), _repeat_rows(prompt_mask, g)
        truths = [self.prompts.ground_truths[i] for i in indices for _ in range(g)]
        score, acc, _ = self.reward_fn(out.response_ids, out.response_mask, truths)
        score, acc = score.float(), acc.float()
        lengths = out.response_mask.sum(-1).long()
        rewards = score
        if s.overlong.enabled:
            rewards = score + soft_overlong_penalty(lengths, l_max=s.penalty_l_max, l_cache=s.overlong.l_cache,
                                                    factor=float(s.overlong.penalty_factor))
        timers["reward"] += time.perf_counter() - t1
        group_ids = torch.as_tensor(uids, dtype=torch.long).repeat_interleave(g)
        full = RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=out.response_ids,
                            response_mask=out.response_mask.float(), group_ids=group_ids,
                            truncated=out.truncated.bool(), engine_logp=out.logprobs, rewards=rewards, acc=acc,
                            pad_id=self.prompts.pad_id, token_version=out.token_version)
        groups = []
        for k, uid in enumerate(uids):
            part = full.select(slice(k * g, (k + 1) * g)).trim()
            groups.append(Group(uid=uid, acc=acc[k * g:(k + 1) * g].clone(),
                                rewards=rewards[k * g:(k + 1) * g].clone(), payload=part))
        return groups

    # ---- phase 2: the update --------------------------------------------------------------------------------------
    def _minibatch_shares(self, batch: RolloutBatch) -> list:
        """For each mini-batch, this rank's sample indices (token-balanced split of the mini-batch).

        A last mini-batch with fewer samples than ranks is merged into the previous one, so that every rank gets
        at least one sample of every mini-batch (each rank must take part in every update's gradient reduction).
        """
        s, n, world = self.settings, len(batch), self.reducer.world_size
        if s.shuffle_minibatches:
            gen = torch.Generator().manual_seed(mix_seed(s.seed, 7919, self.counters["rollout_steps"]))
            order = torch.randperm(n, generator=gen).tolist()
        else:
            order = list(range(n))
        chunks = [order[a:a + s.mini_batch_size] for a in range(0, n, s.mini_batch_size)]
        if len(chunks) > 1 and len(chunks[-1]) < world:
            chunks[-2].extend(chunks.pop())
        tokens = batch.lengths.tolist()
        shares = []
        for mb in chunks:
            split = balanced_split([tokens[i] for i in mb], world)
            shares.append(sorted(mb[j] for j in split[self.reducer.rank]))
        return shares

    def _update(self, batch: RolloutBatch, timers: dict) -> dict:
        s, red = self.settings, self.reducer
        shares = self._minibatch_shares(batch)
        local = sorted({i for share in shares for i in share})
        t0 = time.perf_counter()
        old_logp = torch.zeros_like(batch.response_mask)
        entropy_sum = torch.zeros(())
        # Every rank calls the policy, also with an empty share: model-parallel policies run collectives inside.
        local_batch = batch.select(local)
        lp, ent = self.policy.logprobs(local_batch)
        if local:
            old_logp[local] = lp.detach().float()
            entropy_sum = (ent.detach().float() * local_batch.response_mask).sum()
        batch.old_logp = old_logp
        tokens = red.sum(batch.response_mask[local].sum() if local else torch.zeros(()))
        # Entropy of the policy that sampled the batch (the old-log-prob pass), as the reference logs it.
        entropy = float(red.sum(entropy_sum) / tokens.clamp(min=1.0))
        t1 = time.perf_counter()
        timers["old_logp"] += t1 - t0
        # Advantages from the shaped rewards of the whole (global) batch; every rank computes the same numbers.
        batch.advantages = group_advantages(batch.rewards, batch.group_ids, eps=s.adv_eps,
                                            scale_by_std=s.scale_by_std)
        per_update = []
        for _ in range(s.ppo_epochs):
            for share in shares:
                per_update.append(self._train_minibatch(batch, share))
        timers["update"] += time.perf_counter() - t1
        metrics = mean_metrics(per_update)
        metrics.update(mismatch_by_lag(batch, local, self._version, red))
        metrics["actor/entropy"] = entropy
        metrics["actor/updates"] = len(per_update)
        return metrics

    def _train_minibatch(self, batch: RolloutBatch, share: list) -> dict:
        red = self.reducer
        mb = batch.select(share).trim()
        norm = float(red.sum(self.loss_fn.normalizer(LossInput.of(mb)).float()))
        if norm == 0:
            # Every token of this mini-batch is masked (empty or overlong-filtered responses): an update would only
            # apply weight decay and stale Adam momentum, so it is skipped and counted.
            log.warning("mini-batch without valid tokens (empty or filtered responses): update skipped")
            self.counters["skipped_updates"] += 1
            return {"skipped": 1.0}
        out = self.policy.train_step(mb, norm=norm, loss_fn=self.loss_fn)
        out = reduce_over_ranks(out, self.reducer, _POLICY_METRIC_REDUCTION)
        if out.get("skipped", 0.0) > 0:
            log.warning("rollout step %d: non-finite loss or gradient, optimizer update skipped (weights unchanged)",
                        self.counters["rollout_steps"])
            self.counters["skipped_updates"] += 1
        else:
            self.counters["optimizer_steps"] += 1
        return out

    # ---- one rollout step -----------------------------------------------------------------------------------------
    def step(self, should_stop: Optional[Callable[[str], bool]] = None,
             sample_cap: Optional[int] = None) -> Optional[dict]:
        """Run one rollout step; returns flat float metrics (``/``-grouped names) including the counters.

        ``sample_cap`` (overlap): the caller's budget of ``counters["consumed_samples"]``, which ends the run as it
        ends a synchronous one (the next step runs while the count is below it); the next batch's prompts are drawn
        ahead only then, and counted when that step begins. 0: draw nothing ahead (the caller's last step). None: no
        budget.

        ``should_stop(phase)`` (optional) is asked before each generation batch (phase ``"generate"``) and before
        the update (``"update"``); it must answer the same on every rank. True ends the step there and returns
        None: the groups generated so far stay in the filler, so ``state_dict()`` holds the partial step and a
        resumed loop continues it (a caller uses this to checkpoint before a time limit)."""
        marks = self._marks()
        self._sample_cap = None if sample_cap is None else int(sample_cap)
        timers = dict.fromkeys(TIMED_PHASES, 0.0)
        generated: list = []
        if not self.filler.ready():  # (a step resumed with its batch full counted them before its checkpoint)
            self._count_ahead()
        while not self.filler.ready():
            if should_stop is not None and should_stop("generate"):
                return None
            generated.extend(self._generate_groups(self.filler.next_gen_batch_size(), timers))
        if should_stop is not None and should_stop("update"):
            self._park_live()
            return None
        t_needed = timers.pop("filled_at", time.perf_counter()) - marks["t"]
        groups = self.filler.take()
        metrics = {f"filter/{k}": float(v) for k, v in self.filler.step_stats().items()}
        metrics.update(generation_metrics(generated, self.settings))
        self.counters["rollout_steps"] += 1
        if self._trainable(groups):
            metrics.update(self._train_groups(groups, timers))
        self._park_live(timers)  # a step that trained nothing: nothing runs past the step (checkpoints see it all)
        metrics.update(self._step_metrics(marks, timers, t_needed, metrics.get("response/tokens", 0.0)))
        return metrics

    def _marks(self) -> dict:
        """What a step's metrics count from: its start time, token and skip counters, the engine's idle clock."""
        idle = getattr(self.generator, "idle_seconds", None)  # engine generators only
        return dict(t=time.perf_counter(), tokens=(self.counters["generated_tokens"], self.counters["aborted_tokens"]),
                    skipped=self.counters["skipped_prompts"], idle=idle() if callable(idle) else None)

    def _step_metrics(self, marks: dict, timers: dict, t_needed: float, gen_tokens: float) -> dict:
        """rollout/*, partial/*, timing/*, perf/* and counters/* of the step begun at ``marks`` (``_marks``)."""
        step_s = time.perf_counter() - marks["t"]
        metrics = rollout_metrics(self.counters, marks["tokens"], timers, t_needed)
        metrics["rollout/skipped_prompts"] = float(self.counters["skipped_prompts"] - marks["skipped"])
        if self._partial_mode():
            metrics.update(self._partial_metrics())
        # The cost of a trained group so far: responses generated (kept or not) per group that reached an update.
        trained_groups = self.counters["trained_samples"] / self.settings.group_size
        metrics["rollout/responses_per_trained_group"] = (self.counters["consumed_samples"] / trained_groups
                                                          if trained_groups else 0.0)
        metrics.update({f"timing/{k}_s": timers[k] for k in TIMED_PHASES})
        metrics["timing/step_s"] = step_s
        if marks["idle"] is not None:  # the engine with no request in flight: what overlap takes back
            metrics["timing/engine_idle_s"] = self.generator.idle_seconds() - marks["idle"]
            metrics["timing/engine_idle_frac"] = metrics["timing/engine_idle_s"] / step_s if step_s > 0 else 0.0
        metrics["perf/gen_tokens_per_s"] = gen_tokens / timers["gen"] if timers["gen"] > 0 else 0.0
        metrics.update({f"counters/{k}": float(v) for k, v in self.counters.items()})
        return metrics

    def _trainable(self, groups: list) -> bool:
        """Whether the kept groups make an update (a warning says why not)."""
        if not groups:
            log.warning("rollout step %d: no informative group kept (train_partial); update skipped",
                        self.counters["rollout_steps"])
            return False
        if len(groups) * self.settings.group_size < self.reducer.world_size:
            log.warning("rollout step %d: %d kept groups are too few to share between %d ranks; update skipped",
                        self.counters["rollout_steps"], len(groups), self.reducer.world_size)
            return False
        return True

    def _train_groups(self, groups: list, timers: dict) -> dict:
        """Phase 2 on the kept groups: the training batch, its update, and the refit (the next weight version)."""
        batch = RolloutBatch.cat([g.payload for g in groups])
        batch.rewards = torch.cat([g.rewards for g in groups]).float()
        batch.acc = torch.cat([g.acc for g in groups]).float()
        metrics = {"train/batch_acc": float(batch.acc.mean()), "train/batch_reward": float(batch.rewards.mean()),
                   "train/batch_samples": float(len(batch)), "train/batch_tokens": float(batch.num_tokens())}
        if batch.token_version is not None:
            metrics.update(staleness_metrics(batch, self._version))
        sleep = None if self.overlap else getattr(self.generator, "sleep", None)
        if callable(sleep):  # an engine frees its KV cache (and maybe weights) while the trainer trains
            sleep()
        metrics.update(self._update(batch, timers))
        self.counters["trained_samples"] += len(batch)
        self.counters["trained_tokens"] += batch.num_tokens()
        self._park_live(timers)  # an engine takes weights only with nothing running
        t_refit = time.perf_counter()
        self.generator.update_weights(self.policy)
        timers["refit"] = time.perf_counter() - t_refit
        self._version += 1
        metrics["rollout/trained_tokens"] = float(batch.num_tokens())
        return metrics

    # ---- resume ---------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        state = dict(version=1, counters=dict(self.counters), sampler=self.sampler.state_dict(),
                     filler=self.filler.state_dict(), policy=self.policy.state_dict(),
                     settings=asdict(self.settings))
        if self._partial_mode():  # plain data: the suspended groups continue after a resume as they would have
            state["partial"] = dict(weight_version=self._version, counters=dict(self.partial_counters),
                                    suspended=[g.to_state() for g in self._suspended], drawn_ahead=self._drawn_ahead)
        return state

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != 1:
            raise ValueError(f"DAPOLoop state version {state.get('version')!r} is not supported (expected 1)")
        self.counters = {k: int(state["counters"].get(k, 0)) for k in COUNTERS}
        self.sampler.load_state_dict(state["sampler"])
        self.filler.load_state_dict(state["filler"])
        self.policy.load_state_dict(state["policy"])
        self.generator.update_weights(self.policy)
        partial = state.get("partial")
        if partial is not None and self._partial_mode():
            self._version = int(partial["weight_version"])
            self.partial_counters = {k: int(partial["counters"].get(k, 0)) for k in PARTIAL_COUNTERS}
            self._suspended = [SuspendedGroup.from_state(g) for g in partial["suspended"]]
            self._drawn_ahead = int(partial.get("drawn_ahead", 0))
        elif partial is not None and partial["suspended"]:
            log.warning("resume: %d suspended groups of the checkpoint are dropped (on_filler_full is not 'suspend' "
                        "with max_staleness >= 1 now)", len(partial["suspended"]))
