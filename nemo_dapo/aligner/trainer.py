"""DAPO trainer in NeMo-Aligner's conventions, driving the step loop shared with the CPU path.

``DAPOTrainer`` has the shape of NeMo-Aligner's trainers (``fit``, ``run_validation``, ``save``, ``state_dict`` /
``load_state_dict``, ``ScopedTimer`` timers, the ``CustomLoggerWrapper`` logger, the max-time ``run_timer``) but no
rollout logic of its own: each rollout step is ``nemo_dapo.core.loop.DAPOLoop.step`` over
  * ``ActorPolicy``        the Policy protocol on the DAPO actor + its optimizer/scheduler,
  * a generator            an engine-server generator (``engine_generation``: trtllm, vllm, local) or a legacy
                           one (``generation.TRTLLMGenerator``, ``generation.MegatronSampler``),
  * ``ClientReward``       the RewardFn over a reward client (``reward_client.LocalRewardClient``),
  * ``megatron.reduction.DPReducer`` over megatron's data-parallel group.
So the known problems of NeMo-Aligner 0.7.0's ``ReinforceTrainer`` do not arise: there is no KL term (its KL=0 path
crashes), per-sample advantages broadcast over tokens work for any micro-batch size (it crashes above 1), every DP
rank trains on its own token-balanced share of each mini-batch (it trains every rank on the full batch), and
``consumed_samples`` counts prompts drawn (it counts rollouts, skipping k-fold through the data).

Time limit: a rollout step at the 32B scale takes hours, so the time left is checked between generation batches
too (the loop's ``should_stop`` hook, ``TimeBudget``), and the trainer saves before the run's end, mid-step if need
be, and skips a validation that could not finish. ``progress`` replaces NeMo-Aligner's ``check_progress``, which
forces saves onto validation steps.

Partial rollouts (``trainer.dapo.rollout.on_filler_full: suspend``): the loop generates in prompt-order rounds that
every data-parallel rank follows in step (``rollout_mode``; core/loop_stream.py). With ``rollout.overlap`` the
engines run one more round (the groups carried over and the next batch's first prompts) while the trainer trains,
and the refit waits for its end: one-step-off, and still independent of the engines' timing.

Resume: the whole trainer state (counters, the prompt sampler's position, the dynamic-sampling filler's carried
groups and the suspended groups of partial rollouts) is packed into the model checkpoint by ``save``
(``MegatronGPTDAPOActorModel.on_save_checkpoint``) and read back from it on load (``on_load_checkpoint``), instead of
being parsed from the checkpoint file name.
"""
from __future__ import annotations

import logging
import math
import os
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from nemo_aligner.utils.distributed import ScopedTimer
from nemo_aligner.utils.train_utils import clip_gradients, set_eval, set_train
from nemo_dapo.megatron.layout import blank_rows, pack_rollout, prompt_lengths_of, unpack_response
from nemo_dapo.aligner.compat import pack_state, unpack_state, write_checkpoints_in_process
from nemo_dapo.cluster.config_load import ALGORITHM_BLOCK, ALGORITHM_KEYS, required
from nemo_dapo.cluster.config_validate import ROLLOUT_MODES
from nemo_dapo.megatron.reduction import DPReducer
from nemo_dapo.megatron.step import megatron_grad_norm, skip_update
from nemo_dapo.aligner.reward_client import ClientReward
from nemo_dapo.aligner.training_offload import onload_for_use, pop_metrics
from nemo_dapo.core.collective import cpu_wait_group
from nemo_dapo.core.loop import DAPOLoop
from nemo_dapo.core.loop_data import PromptSampler, PromptSet
from nemo_dapo.core.loop_eval import evaluate
from nemo_dapo.core.settings import FIELDS, AlgorithmSettings, build_loop_parts, from_values
from nemo_dapo.core.types import RolloutBatch

log = logging.getLogger("nemo_dapo")


# The fields of a training batch in the actor's layout (megatron.layout.pack_rollout); a rank without a sample
# trains on 0 rows of them (it still joins every collective of the update: megatron.step adds the filler).
TRAIN_FIELDS = ("response_tokens", "mask", "prev_logprobs", "advantages", "is_end")


class ActorPolicy:
    """The loop's ``Policy`` on ``MegatronGPTDAPOActorModel``: old log-probs and one optimizer update per call,
    following NeMo-Aligner's training step (zero_grad, prepare_for_training_step, get_loss_and_metrics,
    finish_training_step, clip_gradients, optimizer.step, scheduler.step). Weights and optimizer state live in the
    NeMo checkpoint, so ``state_dict`` is empty. Metrics: this DP rank's shares, ``loss`` included (the loop
    combines them over DP by core.loss.METRIC_REDUCTION, so each is counted once); ``grad_norm`` / ``lr`` /
    ``skipped`` are global (the same on every rank)."""

    def __init__(self, actor, optimizer, scheduler, *, gradient_clip_val: Optional[float] = 1.0):
        self.actor, self.optimizer, self.scheduler = actor, optimizer, scheduler
        self.gradient_clip_val = gradient_clip_val

    @torch.no_grad()
    def logprobs(self, batch: Optional[RolloutBatch]) -> tuple:
        empty = batch is None or len(batch) == 0
        pad_id = self.actor.tokenizer.eos_id
        packed = blank_rows(("response_tokens", "response_lengths"), 0, pad_id, 2) if empty \
            else pack_rollout(batch, pad_id)
        onload_for_use(self.actor)  # a no-op in the loop's order (the engine's sleep onloaded it)
        set_eval(self.actor)
        try:  # the lengths let each micro-batch stop at its own longest row
            lp, ent = self.actor.get_logprobs_and_entropy(packed["response_tokens"],
                                                          lengths=packed["response_lengths"])
        finally:
            set_train(self.actor)
        if empty:
            return torch.zeros(0, 0), torch.zeros(0, 0)
        p, width = prompt_lengths_of(batch), batch.response_ids.shape[1]
        mask = batch.response_mask.float()
        return unpack_response(lp, p, width) * mask, unpack_response(ent, p, width) * mask

    def train_step(self, minibatch: Optional[RolloutBatch], *, norm: float, loss_fn) -> dict:
        actor = self.actor
        onload_for_use(actor)
        actor.prepare_for_training()  # onloads optimizer states offloaded for generation
        self.optimizer.zero_grad()
        actor.prepare_for_training_step()
        tis = loss_fn.tis_cap is not None
        batch = blank_rows(TRAIN_FIELDS + (("engine_logprobs",) if tis else ()), 0, actor.tokenizer.eos_id, 2) \
            if minibatch is None or len(minibatch) == 0 else pack_rollout(minibatch, actor.tokenizer.eos_id)
        _, metrics = actor.get_loss_and_metrics(batch, forward_only=False, norm=norm, loss_fn=loss_fn,
                                                reduce_over_dp=False)
        actor.finish_training_step()
        # None when the optimizer clips inside its step (mcore distributed optimizer, fused Adam) or clipping is off
        grad_norm = clip_gradients(actor, self.gradient_clip_val)
        if grad_norm is None and hasattr(self.optimizer, "mcore_optimizer"):  # NeMo's McoreDistributedOptimizer
            grad_norm = megatron_grad_norm(self.optimizer.mcore_optimizer)  # its bf16 step would apply a NaN
        grad_norm = float(grad_norm) if grad_norm is not None else None
        # the skip decision needs the global loss, so that every rank skips together
        total, skipped = skip_update(metrics["loss"], grad_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        if skipped:
            log.warning("non-finite loss (%s) or gradient norm (%s): optimizer step skipped", total, grad_norm)
            self.optimizer.zero_grad()
        else:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad()
        out = {**metrics, "lr": lr, "skipped": float(skipped)}
        if grad_norm is not None:
            out["grad_norm"] = grad_norm
        return out

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def algorithm_settings(model_cfg: DictConfig) -> AlgorithmSettings:
    """The shared algorithm block (core/settings.py) from ``model.dapo.algorithm``, every key required."""
    block = ALGORITHM_BLOCK[len("model."):]
    return from_values({name: required(model_cfg, f"{block}.{name}", "model") for name in FIELDS})


def aligner_loop_parts(cfg: DictConfig, model_cfg: DictConfig) -> tuple:
    """``(LoopSettings, BatchFiller, loss_fn)`` through core/settings.build_loop_parts, the builder the CPU path calls
    too: the algorithm from ``model.dapo.algorithm``, batch keys from ``trainer.dapo.prompts_per_step`` /
    ``ppo_epochs`` / ``shuffle_minibatches`` (``cfg``: trainer.dapo) and ``model.global_batch_size``, the generation
    cap and sampling parameters from ``model.dapo``."""
    a = algorithm_settings(model_cfg)
    max_new = int(required(model_cfg, "dapo.length_params.max_length", "model"))
    if a.overlong.l_max is not None and int(a.overlong.l_max) != max_new:
        raise ValueError(f"{ALGORITHM_KEYS['overlong.l_max']} ({a.overlong.l_max}) must equal "
                         f"model.dapo.length_params.max_length ({max_new}): the soft overlong penalty reaches its "
                         "floor at the generation cap")
    sp = required(model_cfg, "dapo.sampling_params", "model")
    greedy = bool(required(sp, "use_greedy", "model.dapo.sampling_params"))
    return build_loop_parts(
        a, train_batch_size=int(required(cfg, "prompts_per_step", "trainer.dapo")),
        mini_batch_size=int(required(model_cfg, "global_batch_size", "model")),
        ppo_epochs=int(required(cfg, "ppo_epochs", "trainer.dapo")),
        shuffle_minibatches=bool(required(cfg, "shuffle_minibatches", "trainer.dapo")), max_new_tokens=max_new,
        temperature=0.0 if greedy else float(required(sp, "temperature", "model.dapo.sampling_params")),
        top_p=float(required(sp, "top_p", "model.dapo.sampling_params")),
        seed=int(required(cfg, "seed", "trainer.dapo")), **rollout_mode(cfg))


def rollout_mode(cfg: DictConfig) -> dict:
    """LoopSettings' streaming / on_filler_full / fill_order from ``trainer.dapo.rollout.on_filler_full``
    (``cfg``: trainer.dapo). abort: one blocking generate per generation batch (it fills in prompt order; the
    groups past the full batch are discarded). suspend: partial rollouts in prompt order, generated in rounds
    (core/loop_stream.py), the only streamed mode that every data-parallel rank can follow in step."""
    mode = required(cfg, "rollout.on_filler_full", "trainer.dapo")
    if mode not in ROLLOUT_MODES:
        raise ValueError(f"trainer.dapo.rollout.on_filler_full={mode!r} must be one of {ROLLOUT_MODES}")
    if mode == "suspend":
        return dict(streaming=True, on_filler_full="suspend", fill_order="prompt")
    return dict(streaming=False, on_filler_full="abort", fill_order="finish")


def partial_rollout_args(cfg: DictConfig) -> dict:
    """DAPOLoop's ``max_staleness`` / ``round_tokens`` / ``overlap`` from ``trainer.dapo.rollout`` (``cfg``:
    trainer.dapo). overlap needs partial rollouts (suspend, max_staleness >= 1; the loop refuses it otherwise) and
    engines that stay awake while the trainer trains (``engine_server.sleep_level`` 0; the validator's rule)."""
    overlap = required(cfg, "rollout.overlap", "trainer.dapo")
    if not isinstance(overlap, bool):
        raise ValueError(f"trainer.dapo.rollout.overlap={overlap!r} must be true or false")
    return dict(max_staleness=int(required(cfg, "rollout.max_staleness", "trainer.dapo")),
                round_tokens=int(required(cfg, "rollout.round_tokens", "trainer.dapo")), overlap=overlap)


def training_steps(num_prompts: int, prompts_per_step: int, max_epochs, max_steps) -> tuple:
    """(rollout steps, why): ``max_steps`` capped by ``max_epochs`` epochs of NeMo-Aligner's kind (num_prompts //
    prompts_per_step steps each); null / -1 leaves that bound out. Dynamic sampling draws more prompts per step, so
    the sampler's own epoch (logged as train/epoch) runs ahead of this count. ``why`` names the bound that holds
    (it goes to the log: a de-duplicated DAPO-Math-17k gives only ~34 steps per epoch)."""
    per_epoch = max(1, num_prompts // max(1, prompts_per_step))
    epochs = None if max_epochs is None or int(max_epochs) < 0 else int(max_epochs)
    steps = None if max_steps is None or int(max_steps) < 0 else int(max_steps)
    if epochs is None and steps is None:
        raise ValueError("trainer.dapo.max_steps and trainer.dapo.max_epochs are both unset (null / -1): set at "
                         "least one, e.g. max_steps: 375 (the paper's ~6k optimizer updates at 16 per step)")
    epoch_cap = None if epochs is None else per_epoch * epochs
    detail = (f"{num_prompts} prompts / {prompts_per_step} per step = {per_epoch} steps per epoch, "
              f"max_epochs={max_epochs}, max_steps={max_steps}")
    if epoch_cap is not None and (steps is None or epoch_cap < steps):
        if steps is not None:
            log.warning("trainer.dapo.max_steps=%d is cut to %d by max_epochs=%d (%s): raise max_epochs to train "
                        "that long", steps, epoch_cap, epochs, detail)
        return epoch_cap, f"bound by max_epochs ({detail})"
    return steps, f"bound by max_steps ({detail})"


def allocation_time_left(env, now: float) -> float:
    """Seconds until the Slurm job's projected end (``SLURM_JOB_END_TIME``, a UNIX time, set in the job's
    environment), or inf outside Slurm: the run stops and saves before the allocation ends even when
    exp_manager.max_time_per_run is not set."""
    end = str(env.get("SLURM_JOB_END_TIME", "")).strip()
    return float(end) - now if end.isdigit() and int(end) > 0 else math.inf


def progress(step: int, max_steps: int, val_check_interval: int, save_interval: int) -> tuple:
    """(run_val, save, is_train_end) after rollout step ``step``: every ``val_check_interval`` / ``save_interval``
    steps (0 disables) and at the last step. Unlike NeMo-Aligner's check_progress, saving need not wait for a
    validation (its assert ties save_interval to a multiple of val_check_interval): a multi-hour step is saved
    every step, validated every few; the checkpoint callback keeps the latest save as -last either way."""
    end = step >= max_steps
    run_val = val_check_interval > 0 and (step % val_check_interval == 0 or end)
    save = save_interval > 0 and (step % save_interval == 0 or end)
    return run_val, save, end


class TimeBudget:
    """Which work still fits before the run's time limit (exp_manager.max_time_per_run), from measured durations.

    Phases: ``generate`` (one generation batch), ``update`` (old log-probs + optimizer updates), ``validation``,
    ``save``. A phase's estimate is the longest duration measured in this run (0 before the first; ``save``: the
    configured ``save_s`` until a save was timed). Work starts only if ``time_left() >= estimate + save estimate``,
    so a checkpoint can still be written after it. ``agree`` makes every rank take rank 0's decision (the ranks'
    clocks differ). ``should_stop`` is the step loop's hook (core.loop.DAPOLoop.step)."""

    def __init__(self, time_left: Callable[[], float], save_s: float, *, agree: Callable[[bool], bool] = bool,
                 clock: Callable[[], float] = time.monotonic):
        self.time_left, self.agree, self.clock = time_left, agree, clock
        self.estimate = {"save": float(save_s)}
        self._measured: set = set()
        self._open: Optional[tuple] = None

    def record(self, phase: str, seconds: float) -> None:
        prev = self.estimate.get(phase, 0.0) if phase in self._measured else 0.0
        self.estimate[phase] = max(prev, float(seconds))
        self._measured.add(phase)

    def state_dict(self) -> dict:
        """The measured durations ({phase: seconds}): a resumed run starts from them. Without them a run's first
        validation always started, whatever the time left, and an allocation ending in it lost the step it follows."""
        return {phase: self.estimate[phase] for phase in sorted(self._measured)}

    def load_state_dict(self, measured: dict) -> None:
        for phase, seconds in measured.items():
            self.record(phase, seconds)

    def fits(self, phase: str) -> bool:
        need = self.estimate.get(phase, 0.0) + (self.estimate["save"] if phase != "save" else 0.0)
        return self.agree(self.time_left() >= need)

    def begin(self, phase: str) -> None:
        self.end()
        self._open = (phase, self.clock())

    def end(self) -> None:
        if self._open is not None:
            self.record(self._open[0], self.clock() - self._open[1])
            self._open = None

    def should_stop(self, phase: str) -> bool:
        self.end()
        if not self.fits(phase):
            return True
        self.begin(phase)
        return False


def _dp_reducer() -> DPReducer:
    """The loop's reducer over megatron's data-parallel group, with its gloo twin to wait for slower replicas in."""
    reducer = DPReducer()
    if reducer.world_size > 1:
        reducer.wait_group = cpu_wait_group(reducer.group)
    return reducer


class DAPOTrainer:
    """Runs DAPO rollout steps with NeMo-Aligner's trainer conventions (see the module doc).

    ``cfg``: ``trainer.dapo``; ``model``: the DAPO actor; ``train_ds`` / ``val_ds``: ``DAPOPromptDataset``;
    ``rm``: a reward client (``infer_rm``); ``generator``: a Generator over the actor; ``logger``: NeMo-Aligner's
    ``CustomLoggerWrapper``; ``ckpt_callback``: from ``add_custom_checkpoint_callback``; ``run_timer``: NeMo-Aligner's
    ``Timer`` (exp_manager.max_time_per_run). If the model was restored from a checkpoint that carries a trainer
    state, training resumes from it.
    """

    def __init__(self, cfg: DictConfig, model, optimizer, scheduler, train_ds, val_ds, rm, generator, logger,
                 ckpt_callback, run_timer, reducer=None):
        self.cfg, self.model, self.optimizer, self.scheduler = cfg, model, optimizer, scheduler
        self.train_ds, self.val_ds, self.rm, self.generator = train_ds, val_ds, rm, generator
        self.logger, self.ckpt_callback, self.run_timer = logger, ckpt_callback, run_timer
        self.reducer = reducer or _dp_reducer()
        self.settings, filler, loss_fn = aligner_loop_parts(cfg, model.cfg)
        model.loss_fn = loss_fn  # built once: the actor's default loss is the loop's
        self.reward_fn = ClientReward(rm)
        self.policy = ActorPolicy(model, optimizer, scheduler,
                                  gradient_clip_val=required(cfg, "gradient_clip_val", "trainer.dapo"))
        prompts: PromptSet = train_ds.prompt_set()
        self.loop = DAPOLoop(policy=self.policy, generator=generator, reward_fn=self.reward_fn,
                             loss_fn=loss_fn, prompts=prompts, filler=filler,
                             settings=self.settings, sampler=PromptSampler(len(prompts), seed=self.settings.seed),
                             reducer=self.reducer, **partial_rollout_args(cfg))
        self.timer = ScopedTimer(reduction="mean", sync_cuda=True, buffer_size=1)
        self.max_steps, why = training_steps(len(prompts), filler.num_groups,
                                             required(cfg, "max_epochs", "trainer.dapo"),
                                             required(cfg, "max_steps", "trainer.dapo"))
        log.info("DAPO training for %d rollout steps: %s", self.max_steps, why)
        self.checkpoint_writer = write_checkpoints_in_process(getattr(model, "_trainer", None))
        log.info("checkpoint saves: %s", self.checkpoint_writer)
        self.history: list = []  # (step, metrics) of every rollout step and validation, for callers and tests
        self.budget: Optional[TimeBudget] = None  # fit's; its measured durations travel in the checkpoint
        self._durations: dict = {}  # those of the checkpoint resumed from
        if getattr(model, "trainer_state", None) is not None:
            self.load_state_dict(unpack_state(model.trainer_state))
            log.info("resumed the DAPO trainer at step %d from the checkpoint's trainer state", self.step)

    # ---- counters --------------------------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        return self.loop.counters["rollout_steps"]

    @property
    def consumed_samples(self) -> int:
        """Prompts drawn so far (each yields group_size responses); NeMo-Aligner's REINFORCE counts responses."""
        return self.loop.counters["consumed_prompts"]

    @property
    def epoch(self) -> int:
        return self.loop.sampler.epoch

    # ---- NeMo-Aligner trainer API -------------------------------------------------------------------------------
    def _time_left(self) -> float:
        return min(self.run_timer.get_time_remaining(), allocation_time_left(os.environ, time.time()))

    def _rank0_decides(self, ok: bool) -> bool:
        flag = torch.tensor([bool(ok)], dtype=torch.bool).cuda()
        if dist.is_initialized():
            dist.broadcast(flag, 0)
        return bool(flag.item())

    def fit(self) -> None:
        if self.step >= self.max_steps:
            log.info("DAPO training already finished (step %d of %d)", self.step, self.max_steps)
            return
        self.run_timer.start_time()
        budget = self.budget = TimeBudget(self._time_left, float(required(self.cfg, "save_time_s", "trainer.dapo")),
                                          agree=self._rank0_decides)
        budget.load_state_dict(self._durations)
        self._saved_at = self.loop.counters["gen_batches"]
        while self.step < self.max_steps:
            with self.timer("step_time"):
                # the last step draws nothing ahead (overlap): no prompt is started that no step trains
                metrics = self.loop.step(should_stop=budget.should_stop,
                                         sample_cap=0 if self.step + 1 >= self.max_steps else None)
            budget.end()
            if metrics is None:  # the time limit came inside the step: keep its generated groups
                log.info("time limit of the run: rollout step %d stopped after %d generation batches, %.0f s left; "
                         "saving its partial state", self.step + 1, self.loop.counters["gen_batches"],
                         self._time_left())
                self.timer.consume_durations()
                if self.loop.counters["gen_batches"] != self._saved_at:
                    self.save()
                return
            metrics.update({f"timers/{k}": v for k, v in self.timer.consume_durations().items()})
            metrics.update(pop_metrics(getattr(self.generator, "training_offload", None)))
            metrics["train/epoch"] = float(self.epoch)
            self.logger.log_metrics(metrics, step=self.step, prefix="")
            self.history.append((self.step, metrics))
            run_val, save, is_train_end = progress(self.step, self.max_steps,
                                                   int(required(self.cfg, "val_check_interval", "trainer.dapo")),
                                                   int(required(self.cfg, "save_interval", "trainer.dapo")))
            extra = {}
            if run_val and self.val_ds is not None:
                if budget.fits("validation"):
                    val = self.run_validation()
                    self.logger.log_metrics(val, step=self.step, prefix="")
                    self.history.append((self.step, val))
                    extra = {k.replace("/", "_"): v for k, v in val.items()}
                else:
                    log.warning("validation at step %d skipped: %.0f s left, the last one took %.0f s and a save "
                                "%.0f s", self.step, self._time_left(),
                                budget.estimate.get("validation", 0.0), budget.estimate["save"])
            # stop when not even one more generation batch (and its checkpoint) fits
            out_of_time = not is_train_end and not budget.fits("generate")
            if save or out_of_time:
                self.save(extra, is_train_end=is_train_end)
            if out_of_time:
                log.info("time limit of the run: stopping after step %d (%.0f s left)", self.step, self._time_left())
                return
        self.logger.finalize()

    @torch.no_grad()
    def run_validation(self) -> dict:
        """avg@n accuracy (and pass@n, lengths) on ``val_ds`` with ``trainer.dapo.val`` sampling settings."""
        v = {k: required(self.cfg, f"val.{k}", "trainer.dapo")
             for k in ("n_samples", "temperature", "top_p", "seed", "batch_size", "max_problems")}
        t0 = time.monotonic()
        with self.timer("validation_time"):
            res = evaluate(self.generator, self.reward_fn, self.val_ds.prompt_set(),
                           n_samples=int(v["n_samples"]), max_new_tokens=self.settings.max_new_tokens,
                           temperature=float(v["temperature"]), top_p=float(v["top_p"]), seed=int(v["seed"]),
                           batch_size=int(v["batch_size"]),
                           indices=None if v["max_problems"] is None else range(
                               min(int(v["max_problems"]), len(self.val_ds))),
                           reducer=self.reducer)
        out = res.summary(prefix="val/")
        out["val/generations"] = float(res.acc.numel())  # problems x n_samples (AIME-2024: 30 x 32)
        log.info("validation: %d problems x %d samples, avg@%d = %.4f", res.acc.shape[0], res.acc.shape[1],
                 res.acc.shape[1], res.accuracy)
        out.update({f"timers/{k}": t for k, t in self.timer.consume_durations().items()})
        if getattr(self, "budget", None) is not None:
            self.budget.record("validation", time.monotonic() - t0)
        return out

    def state_dict(self) -> dict:
        return {"step": self.step, "consumed_samples": self.consumed_samples, "epoch": self.epoch,
                "dapo_optimization_step": self.loop.counters["optimizer_steps"], "loop": self.loop.state_dict(),
                "time_budget": self.budget.state_dict() if self.budget is not None else dict(self._durations)}

    def load_state_dict(self, state: dict) -> None:
        self.loop.load_state_dict(state["loop"])
        self._durations = dict(state.get("time_budget") or {})  # none in a checkpoint of an earlier release
        # every rank must have loaded the same checkpoint: compare the counters with rank 0's
        mine = torch.tensor([self.step, self.consumed_samples, self.loop.counters["optimizer_steps"]],
                            dtype=torch.int64).cuda()
        ref = mine.clone()
        dist.broadcast(ref, 0)
        if not torch.equal(mine, ref):
            raise RuntimeError(f"rank {dist.get_rank()} restored trainer counters {mine.tolist()} but rank 0 has "
                               f"{ref.tolist()}: the ranks loaded different checkpoints")

    def save(self, extra_candidates: Optional[dict] = None, is_train_end: bool = False) -> None:
        """Checkpoint through NeMo's checkpoint callback, with this trainer's state inside the checkpoint (also in
        the middle of a rollout step: the filler's groups so far travel with it)."""
        t0 = time.monotonic()
        # A training state offloaded for generation (model.dapo.offload_training_state) comes back for the save with
        # the engine asleep (its sleep frees the KV cache, at sleep level 2 its weights too: the onloaded state fits
        # as in training), and leaves again with a full refit afterwards (the engine may have released its weights).
        offload = getattr(self.generator, "training_offload", None)
        refit_after = offload is not None and bool(offload.offloaded_parts)
        if refit_after:
            self.generator.sleep()
        # optimizer states back on the device before they are saved, and back to the CPU after it when the save
        # comes between a refit and the next generation (the engine path offloads them at the refit)
        offloaded = getattr(self.model, "distributed_adam_offload_manager", None) is not None
        self.model.prepare_for_training()
        dist.barrier()
        self.model.trainer_state = pack_state(self.state_dict())
        candidates = {k: torch.tensor(v, dtype=torch.int32) for k, v in self.state_dict().items()
                      if k not in ("loop", "time_budget")}  # the counters: NeMo's checkpoint names read them
        candidates.update({k: torch.as_tensor(v) for k, v in (extra_candidates or {}).items()})
        self.ckpt_callback.custom_save(monitor_candidates=candidates, is_train_end=is_train_end)
        self.model.finish_training()
        if offloaded:
            self.model.offload_adam_states()
        if refit_after:
            self.generator.update_weights()
        self._saved_at = self.loop.counters["gen_batches"]
        if getattr(self, "budget", None) is not None:
            self.budget.record("save", time.monotonic() - t0)
