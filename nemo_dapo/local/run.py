"""The CPU main job: base model by supervised warm-up (cached), base evaluation, DAPO, final evaluation, summary.

``train(cfg)`` wires the local backend into the shared step loop (core/loop.py) and drives it: validation every
``trainer.val_every`` steps, atomic checkpoints every ``trainer.save_every`` steps, metrics to JSONL/TensorBoard,
plots and ``summary.json`` at the end. Run directory layout::

    run_dir/.lock             held by the running `train` job (pid, host, start time): one writer at a time
    run_dir/config.yaml       the resolved configuration
    run_dir/base_model/       warm-up result (model + tokenizer + warmup.json + fingerprint.json), reused next run
    run_dir/base_model.KEY/   warm-up results of other inputs, kept and reused when their inputs come back
    run_dir/checkpoints/      step_NNNNNNNN.pt (loop state, RNG states, base evaluation, resolved config)
    run_dir/metrics.jsonl     one record per train step / validation / evaluation
    run_dir/tb/               TensorBoard events
    run_dir/plots/            PNG curves
    run_dir/summary.json      base_accuracy, final_accuracy, heldout_size, wall_seconds, ...
    run_dir/diverged.json     the run's divergences (exit 7): a rerun refuses to continue it without --resume-diverged

Resume (``resume: auto``) takes the newest intact checkpoint and refuses one whose config differs in a key that
changes the run (``--allow-config-change`` overrides), or whose weights do not fit the configured model, or of a
run that diverged (exit 7; ``run_dir/diverged.json`` records it; ``--resume-diverged`` overrides); rerunning a
finished run prints its summary and changes nothing (raise ``trainer.max_steps`` / ``max_samples`` /
``max_time_s`` to train it further). SIGINT / SIGTERM stop after the current rollout step with a checkpoint of it
(exit 130 / 143). A link where the run writes (``.lock``, ``checkpoints/``, ...) is refused; see run_dir.py.
"""
from __future__ import annotations

import copy
import logging
import os
import shutil
import time
from dataclasses import asdict
from typing import Optional

import torch

from nemo_dapo.local.config import Config, ConfigError
from nemo_dapo.core.checkpoint import (atomic_directory, checkpoint_path, latest_checkpoint, list_checkpoints,
                                       rng_state, save_checkpoint, set_rng_state)
from nemo_dapo.core.affinity import pin_cpus
from nemo_dapo.core.health import DivergenceGuard, TrainingDiverged, diverged_message
from nemo_dapo.core.loop import DAPOLoop
from nemo_dapo.core.loop_data import PromptSampler
from nemo_dapo.core.loop_eval import EvalResult, evaluate
from nemo_dapo.core.reward import RuleReward
from nemo_dapo.core.settings import build_loop_parts, from_values
from nemo_dapo.engines.base import EngineError
from nemo_dapo.local.policy import LocalPolicy
from nemo_dapo.local.run_dir import (DIVERGED_FILE, RunDirLock, RunInterrupted, StopSignals, check_diverged,
                                     check_model_shapes, check_no_links, check_resume_config, finished_summary,
                                     is_write_failure, pick_checkpoint, record_divergence, unwritable)
from nemo_dapo.local.run_data import build_prompt_sets
from nemo_dapo.local.run_model import prepare_base_model
from nemo_dapo.local.run_parallel import ParallelSampler
from nemo_dapo.local.run_log import RunLogger, setup_console_logging, write_json, write_text

log = logging.getLogger("nemo_dapo")


def set_threads(threads: Optional[int]) -> int:
    """torch intra-op threads: ``threads`` or, when None, 1.

    Measured for the tiny model: a second intra-op thread made sampling ~10x slower and an update ~2-3x slower
    whenever another process was busy (it spins waiting for the busy core); the second core is used by a second
    generation process instead (``rollout.processes``).
    """
    n = 1 if threads is None else int(threads)
    torch.set_num_threads(n)
    return n


def local_loop_parts(cfg: Config) -> tuple:
    """``(LoopSettings, BatchFiller, loss_fn)`` from the algorithm block (core/settings.build_loop_parts, the builder
    the NeMo-Aligner path calls too) and this config's batch and rollout keys."""
    from nemo_dapo.local.config import algorithm_values

    t, r = cfg.trainer, cfg.rollout
    return build_loop_parts(from_values(algorithm_values(cfg)), train_batch_size=t.train_batch_size,
                            mini_batch_size=t.mini_batch_size, ppo_epochs=t.ppo_epochs,
                            shuffle_minibatches=t.shuffle_minibatches, max_new_tokens=r.max_new_tokens,
                            temperature=r.temperature, top_p=r.top_p, seed=cfg.seed, streaming=r.streaming,
                            on_filler_full=r.on_filler_full, fill_order=r.fill_order)


def build_reward(cfg: Config, tokenizer) -> RuleReward:
    return RuleReward(lambda ids: tokenizer.decode(ids, skip_special_tokens=True), mode=cfg.reward.verifier,
                      num_workers=cfg.reward.num_workers)


class LocalRun:
    """Everything of one CPU run, built from a :class:`Config` (also used by tests to drive a few steps)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        os.makedirs(cfg.run_dir, exist_ok=True)
        self.model, self.tokenizer, self.base_info = prepare_base_model(cfg)
        self.train_set, self.heldout = build_prompt_sets(cfg, self.tokenizer)
        t = cfg.trainer
        self.policy = LocalPolicy(self.model, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay,
                                  betas=tuple(cfg.optim.betas), eps=cfg.optim.eps, grad_clip=cfg.optim.grad_clip,
                                  warmup_steps=cfg.optim.warmup_steps, micro_batch_size=t.micro_batch_size,
                                  temperature=cfg.rollout.temperature)
        self.engine = None
        if cfg.rollout.engine == "inprocess":
            self.sampler = ParallelSampler(self.model, eos_id=self.tokenizer.eos_token_id,
                                           pad_id=self.tokenizer.pad_token_id, processes=cfg.rollout.processes)
        else:
            from nemo_dapo.local.run_engine import EngineRollouts

            self.engine = EngineRollouts(cfg, self.model, self.tokenizer, self.policy)
            self.sampler = self.engine.generator
        self.reward = build_reward(cfg, self.tokenizer)
        settings, filler, loss_fn = local_loop_parts(cfg)
        self.loop = DAPOLoop(policy=self.policy, generator=self.sampler, reward_fn=self.reward, loss_fn=loss_fn,
                             prompts=self.train_set, filler=filler, settings=settings,
                             sampler=PromptSampler(len(self.train_set), seed=cfg.seed),
                             max_staleness=cfg.rollout.max_staleness, overlap=cfg.rollout.overlap,
                             round_tokens=cfg.rollout.round_tokens)
        # The divergence guard's state (so a resumed run judges as the uninterrupted one) and every divergence of
        # the run (check_diverged): saved with each checkpoint.
        self.health = {"streak": 0, "start_entropy": None, "diverged": []}

    @property
    def step(self) -> int:
        return self.loop.counters["rollout_steps"]

    def evaluate(self, n_samples: int, problems: Optional[int] = None) -> EvalResult:
        e = self.cfg.eval
        indices = None if problems is None else range(min(problems, len(self.heldout)))
        return evaluate(self.sampler, self.reward, self.heldout, n_samples=n_samples,
                        max_new_tokens=e.max_new_tokens or self.cfg.rollout.max_new_tokens,
                        temperature=e.temperature, top_p=e.top_p, seed=self.cfg.seed, batch_size=e.batch_size,
                        indices=indices)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        else:
            self.sampler.close()

    def state_dict(self, base_eval: dict) -> dict:
        return {"loop": self.loop.state_dict(), "rng": rng_state(), "base_eval": base_eval,
                "config": asdict(self.cfg), "health": dict(self.health)}

    def load_state_dict(self, state: dict) -> dict:
        self.loop.load_state_dict(state["loop"])
        set_rng_state(state["rng"])
        self.health.update({k: v for k, v in (state.get("health") or {}).items() if k in self.health})
        return state["base_eval"]


def _ckpt_dir(cfg: Config) -> str:
    return os.path.join(cfg.run_dir, "checkpoints")


def _start_over(cfg: Config) -> None:
    """resume=never: remove what the previous run wrote; the warm-up cache (base_model/) stays."""
    for sub in ("checkpoints", "tb", "plots", "final_model"):
        shutil.rmtree(os.path.join(cfg.run_dir, sub), ignore_errors=True)
    for name in ("summary.json", DIVERGED_FILE):
        if os.path.isfile(os.path.join(cfg.run_dir, name)):
            os.unlink(os.path.join(cfg.run_dir, name))


def _write_config(cfg: Config) -> None:
    """config.yaml, once the run is known to continue (a refused resume leaves the stored one as it was)."""
    from nemo_dapo.local.config import config_to_yaml

    write_text(os.path.join(cfg.run_dir, "config.yaml"), config_to_yaml(cfg))


def train(cfg: Config, *, allow_config_change: bool = False, resume_diverged: bool = False) -> dict:
    """Run the whole job for ``cfg``; returns the summary (also written to ``run_dir/summary.json``).

    Holds the run directory's lock throughout. Raises :class:`RunDirBusy`, :class:`RunDirUnsafe` (a link where the
    run writes), :class:`ResumeMismatch` (unless ``allow_config_change``), :class:`RunDiverged` for a run that
    diverged before (unless ``resume_diverged``), :class:`RunInterrupted` on SIGINT/SIGTERM,
    :class:`RunDirUnwritable` when a write fails for lack of space or permission (the checkpoints written before
    stay intact).
    """
    t_start = time.time()
    setup_console_logging()
    threads = set_threads(cfg.trainer.threads)
    if cfg.trainer.cpus is not None:  # before the engine server and generation workers start: they inherit it
        try:
            pin_cpus(list(cfg.trainer.cpus))
        except ValueError as e:
            raise ConfigError(f"config key 'trainer.cpus': {e}") from None
        log.info("the trainer runs on CPUs %s (trainer.cpus)", sorted(os.sched_getaffinity(0)))
    try:
        os.makedirs(cfg.run_dir, exist_ok=True)
        with RunDirLock(cfg.run_dir), StopSignals() as stop:
            check_no_links(cfg.run_dir)
            return _train_locked(cfg, stop, allow_config_change, resume_diverged, t_start, threads)
    except OSError as e:
        if is_write_failure(e, cfg.run_dir):
            raise unwritable(e, cfg.run_dir, list_checkpoints(_ckpt_dir(cfg))) from e
        raise


def _resume_point(cfg: Config, allow_config_change: bool, resume_diverged: bool):
    """(checkpoint, its state, divergence records, the finished run's summary or None) for ``cfg.resume``; refuses
    a changed config or a diverged run unless allowed. ``resume=never`` clears what the previous run wrote."""
    ckpt, state = pick_checkpoint(_ckpt_dir(cfg)) if cfg.resume == "auto" else (None, None)
    diverged = check_diverged(cfg.run_dir, state, ckpt, resume_diverged=resume_diverged) if cfg.resume == "auto" \
        else []
    if state is not None:
        current = asdict(cfg)
        check_resume_config(state.get("config"), current, ckpt, allow_change=allow_config_change)
        done = finished_summary(cfg.run_dir, state, state.get("config"), current)
        if done is not None:
            return ckpt, state, diverged, done
    if cfg.resume == "never":
        _start_over(cfg)
    return ckpt, state, diverged, None


def _restore(run: LocalRun, cfg: Config, ckpt, state, diverged: list) -> Optional[dict]:
    """Load ``state`` (None: a new run) into ``run`` and write the run's config; returns the base evaluation's
    metrics a resumed run logged, or None."""
    base_eval = None
    if state is not None:
        check_model_shapes(state["loop"]["policy"]["model"], run.model.state_dict(), ckpt,
                           has_config=state.get("config") is not None)
        base_eval = run.load_state_dict(state)
        log.info("resumed from %s (rollout step %d)", ckpt, run.step)
    run.health["diverged"] = diverged
    _write_config(cfg)
    if diverged:  # continued with --resume-diverged: it stays marked, as resumed
        record_divergence(cfg.run_dir, diverged)
    return base_eval


def _evaluate_base(run: LocalRun, cfg: Config, logger: RunLogger) -> dict:
    base = run.evaluate(cfg.eval.n_samples)
    base_eval = base.summary("eval/")
    logger.write("eval", 0, base_eval)
    log.info("base model: held-out accuracy %.3f on %d problems x %d samples (%.0fs)", base.accuracy,
             len(run.heldout), cfg.eval.n_samples, base.seconds)
    return base_eval


def _train_locked(cfg: Config, stop: StopSignals, allow_config_change: bool, resume_diverged: bool, t_start: float,
                  threads: int) -> dict:
    ckpt, state, diverged, done = _resume_point(cfg, allow_config_change, resume_diverged)
    if done is not None:
        log.info("run %s in %s is finished (rollout step %d, held-out accuracy %.3f -> %.3f); nothing changed. "
                 "To train it further raise trainer.max_steps / trainer.max_samples / trainer.max_time_s; to "
                 "start over set resume=never or another run_dir", cfg.name, cfg.run_dir, done["rollout_steps"],
                 done["base_accuracy"], done["final_accuracy"])
        return done
    log.info("run %s in %s (torch threads: %d)", cfg.name, cfg.run_dir, threads)
    run = logger = None
    try:
        run = LocalRun(cfg)
        base_eval = _restore(run, cfg, ckpt, state, diverged)
        del state
        logger = RunLogger(cfg.run_dir, resume_step=run.step if base_eval else None,
                           tensorboard=cfg.trainer.tensorboard, total_steps=cfg.trainer.max_steps,
                           total_samples=cfg.trainer.max_samples)
        if base_eval is None:
            base_eval = _evaluate_base(run, cfg, logger)
        t_rl = time.time()
        stop.defer(True)
        _train_steps(run, logger, base_eval, t_start, stop)
        stop.defer(False)
        stop.raise_if_requested()  # a signal during the last step: its checkpoint is saved, the evaluation is not run
        rl_seconds = time.time() - t_rl
        _save_final_model(run)
        final_eval = run.evaluate(cfg.eval.n_samples).summary("eval/")
        logger.write("final", run.step, final_eval)
    except RunInterrupted as e:
        stop.defer(False)
        latest = latest_checkpoint(_ckpt_dir(cfg))
        if latest is not None:
            e.checkpoint, e.step = latest, int(os.path.basename(latest)[5:-3])
        raise
    finally:
        if logger is not None:
            logger.close()
        if run is not None:
            run.close()
    return _finish(run, cfg, base_eval, final_eval, t_start, rl_seconds, threads)


def _finish(run: LocalRun, cfg: Config, base_eval: dict, final_eval: dict, t_start: float, rl_seconds: float,
            threads: int) -> dict:
    """summary.json, the closing console line and the plots; returns the summary."""
    summary = _summary(run, base_eval, final_eval, wall_seconds=time.time() - t_start, rl_seconds=rl_seconds,
                       threads=threads)
    write_json(os.path.join(cfg.run_dir, "summary.json"), summary)
    log.info("held-out accuracy %.3f -> %.3f (%+.1f points) on %d problems; %.0f s wall", summary["base_accuracy"],
             summary["final_accuracy"], summary["gain_points"], summary["heldout_size"], summary["wall_seconds"])
    if cfg.trainer.plots:
        from nemo_dapo.local.plots import plot_run

        log.info("plots: %s", ", ".join(plot_run(cfg.run_dir)))
    return summary


def _stop_reason(run: LocalRun, t_rl: float) -> str:
    """Why training ends before the next step ('' = it does not): steps, sample budget or time budget."""
    t = run.cfg.trainer
    if run.step >= t.max_steps:
        return f"trainer.max_steps={t.max_steps} reached"
    if t.max_samples is not None and run.loop.counters["consumed_samples"] >= t.max_samples:
        return f"trainer.max_samples={t.max_samples} responses generated"
    if t.max_time_s is not None and time.time() - t_rl > t.max_time_s:
        return f"trainer.max_time_s={t.max_time_s} s of RL spent (stopping early)"
    return ""


def _sample_cap(run: LocalRun) -> Optional[int]:
    """The overlap's budget: nothing drawn ahead (0) on the step that reaches trainer.max_steps, else
    trainer.max_samples, which the loop reads as this module's stop rule does (None: no sample budget)."""
    t = run.cfg.trainer
    return 0 if run.step + 1 >= t.max_steps else t.max_samples


def _train_steps(run: LocalRun, logger: RunLogger, base_eval: dict, t_start: float,
                 stop: Optional[StopSignals] = None) -> None:
    """Step until a budget is spent; validate every val_every steps and at the end, checkpoint likewise.

    A stop requested by a signal (``stop.signum``) ends the loop after the step in progress, with its checkpoint.
    An engine error ends it with the checkpoint of the last finished step (its state is held in memory while no
    checkpoint on disk has it).
    """
    cfg, t = run.cfg, run.cfg.trainer
    t_rl = time.time()
    saved = run.step
    on_disk = run.step if os.path.isfile(checkpoint_path(_ckpt_dir(cfg), run.step)) else None  # a checkpoint's step
    guard = DivergenceGuard(max_skipped_updates=t.max_skipped_updates, max_entropy_fraction=t.max_entropy_fraction,
                            vocab_size=run.model.config.vocab_size)
    guard.streak, guard.start_entropy = int(run.health["streak"]), run.health["start_entropy"]
    while not _stop_reason(run, t_rl):
        last_step = run.step
        held = None if on_disk == last_step else copy.deepcopy(run.state_dict(base_eval))
        try:
            metrics = run.loop.step(sample_cap=_sample_cap(run))
            step, last = run.step, bool(_stop_reason(run, t_rl))
            if t.val_every and (step % t.val_every == 0 or last):
                metrics.update(run.evaluate(t.val_samples, t.val_problems).summary("val/"))
        except EngineError as e:
            # The loop stopped half way through the step (prompts drawn, suspended groups taken up, the policy
            # perhaps updated but not sent, the step not logged), so the checkpoint is the state at the end of the
            # last finished step: rerunning repeats the failed step whole and, in prompt order, as the
            # uninterrupted run did.
            if held is not None:
                save_checkpoint(_ckpt_dir(cfg), last_step, held, keep_last=t.keep_last)
            raise EngineError(f"{e}\nrollout step {last_step + 1} stopped; the checkpoint of step {last_step} is in "
                              f"{_ckpt_dir(cfg)}: start the engine again (or fix the cause above) and rerun the "
                              "same command to resume") from e
        logger.write("train", step, metrics)
        logger.console(step, metrics, time.time() - t_start)
        diverged = guard.observe(metrics)
        run.health.update(streak=guard.streak, start_entropy=guard.start_entropy)
        if diverged:  # the checkpoint of this step records it (so does diverged.json below)
            run.health["diverged"] = run.health["diverged"] + [
                {"step": step, "reason": diverged, "checkpoint": checkpoint_path(_ckpt_dir(cfg), step),
                 "time": time.time(), "resumed": False}]
        if step % t.save_every == 0 or last or diverged:
            save_checkpoint(_ckpt_dir(cfg), step, run.state_dict(base_eval), keep_last=t.keep_last)
            saved = on_disk = step
        if diverged:  # stop with a checkpoint instead of training on to accuracy 0 and exit 0
            record_divergence(cfg.run_dir, run.health["diverged"])
            raise TrainingDiverged(diverged_message(diverged, step=step, lr=cfg.optim.lr,
                                                    checkpoint_dir=_ckpt_dir(cfg))
                                   + f"; rerunning this run_dir refuses to continue it (recorded in "
                                     f"{os.path.join(cfg.run_dir, DIVERGED_FILE)}) unless given --resume-diverged")
        if stop is not None and stop.signum is not None:
            if saved != step:
                save_checkpoint(_ckpt_dir(cfg), step, run.state_dict(base_eval), keep_last=t.keep_last)
            stop.raise_if_requested()
    if saved != run.step:  # the time budget ran out between two checks
        save_checkpoint(_ckpt_dir(cfg), run.step, run.state_dict(base_eval), keep_last=t.keep_last)
    log.info("training done at rollout step %d: %s", run.step, _stop_reason(run, t_rl))


def _save_final_model(run: LocalRun) -> None:
    """The trained policy in save_pretrained layout (model + tokenizer), for `nemo-dapo eval --model`."""
    with atomic_directory(os.path.join(run.cfg.run_dir, "final_model")) as tmp:
        run.model.save_pretrained(tmp, safe_serialization=True)
        run.tokenizer.save_pretrained(tmp)


def _summary(run: LocalRun, base_eval: dict, final_eval: dict, *, wall_seconds: float, rl_seconds: float,
             threads: int) -> dict:
    cfg = run.cfg
    base_acc, final_acc = base_eval["eval/accuracy"], final_eval["eval/accuracy"]
    c = run.loop.counters
    return {
        "config": cfg.name,
        "seed": cfg.seed,
        "base_accuracy": base_acc,
        "final_accuracy": final_acc,
        "gain_points": round(100 * (final_acc - base_acc), 2),
        "heldout_size": len(run.heldout),
        "eval_samples_per_problem": cfg.eval.n_samples,
        "base_pass_at_n": base_eval["eval/pass_at_n"],
        "final_pass_at_n": final_eval["eval/pass_at_n"],
        "wall_seconds": round(wall_seconds, 1),
        "rl_seconds": round(rl_seconds, 1),
        "warmup": run.base_info,
        "rollout_steps": c["rollout_steps"],
        "optimizer_steps": c["optimizer_steps"],
        "gen_batches": c["gen_batches"],
        "consumed_prompts": c["consumed_prompts"],
        "consumed_samples": c["consumed_samples"],
        "trained_tokens": c["trained_tokens"],
        "skipped_updates": c["skipped_updates"],
        "torch_threads": threads,
        "diverged": run.health["diverged"],  # earlier divergences continued with --resume-diverged ([]: none)
    }
