"""DAPO trainer in NeMo-Aligner's conventions, driving the step loop shared with the CPU path.

``DAPOTrainer`` has the shape of NeMo-Aligner's trainers (``fit``, ``run_validation``, ``save``, ``state_dict`` /
``load_state_dict``, ``ScopedTimer`` timers, the ``CustomLoggerWrapper`` logger, ``check_progress``, the max-time
``run_timer``) but no rollout logic of its own: each rollout step is ``nemo_dapo.core.loop.DAPOLoop.step`` over
  * ``ActorPolicy``        the Policy protocol on the DAPO actor + its optimizer/scheduler,
  * a generator            ``generation.TRTLLMGenerator`` or ``generation.MegatronSampler``,
  * ``ClientReward``       the RewardFn over a reward client (``reward_client.LocalRewardClient``),
  * ``DataParallelReducer`` over megatron's data-parallel group.
So the known problems of NeMo-Aligner 0.7.0's ``ReinforceTrainer`` do not arise: there is no KL term (its KL=0 path
crashes), per-sample advantages broadcast over tokens work for any micro-batch size (it crashes above 1), every DP
rank trains on its own token-balanced share of each mini-batch (it trains every rank on the full batch), and
``consumed_samples`` counts prompts drawn (it counts rollouts, skipping k-fold through the data).

Resume: the whole trainer state (counters, the prompt sampler's position and the dynamic-sampling filler's carried
groups) is packed into the model checkpoint by ``save`` (``MegatronGPTDAPOActorModel.on_save_checkpoint``) and read
back from it on load (``on_load_checkpoint``), instead of being parsed from the checkpoint file name.
"""
from __future__ import annotations

import logging
import math
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mcore_ps
from omegaconf import DictConfig

from nemo_aligner.utils.distributed import ScopedTimer
from nemo_aligner.utils.train_utils import clip_gradients, set_eval, set_train
from nemo_aligner.utils.trainer_utils import check_progress
from nemo_dapo.aligner.layout import pack_rollout, prompt_lengths_of, unpack_response
from nemo_dapo.aligner.compat import pack_state, unpack_state
from nemo_dapo.aligner.reducer import DataParallelReducer
from nemo_dapo.aligner.reward_client import ClientReward
from nemo_dapo.core.dynamic_sampling import BatchFiller
from nemo_dapo.core.loop import DAPOLoop, LoopSettings
from nemo_dapo.core.loop_data import PromptSampler, PromptSet
from nemo_dapo.core.loop_eval import evaluate
from nemo_dapo.core.types import RolloutBatch

log = logging.getLogger("nemo_dapo")


def _empty_actor_batch(tis: bool) -> dict:
    """A 0-row batch in the actor's layout: the rank still joins every collective of the update."""
    out = {"response_tokens": torch.zeros(0, 2, dtype=torch.long), "mask": torch.zeros(0, 1),
           "prev_logprobs": torch.zeros(0, 1), "advantages": torch.zeros(0), "is_end": torch.ones(0)}
    if tis:
        out["engine_logprobs"] = torch.zeros(0, 1)
    return out


class ActorPolicy:
    """The loop's ``Policy`` on ``MegatronGPTDAPOActorModel``: old log-probs and one optimizer update per call,
    following NeMo-Aligner's training step (zero_grad, prepare_for_training_step, get_loss_and_metrics,
    finish_training_step, clip_gradients, optimizer.step, scheduler.step). Weights and optimizer state live in the
    NeMo checkpoint, so ``state_dict`` is empty. Metrics: local shares (the loop reduces them over DP), except
    ``loss`` / ``grad_norm`` / ``lr`` / ``skipped``, which are global."""

    def __init__(self, actor, optimizer, scheduler, *, gradient_clip_val: Optional[float] = 1.0):
        self.actor, self.optimizer, self.scheduler = actor, optimizer, scheduler
        self.gradient_clip_val = gradient_clip_val

    @torch.no_grad()
    def logprobs(self, batch: Optional[RolloutBatch]) -> tuple:
        empty = batch is None or len(batch) == 0
        tokens = torch.zeros(0, 2, dtype=torch.long) if empty else \
            pack_rollout(batch, self.actor.tokenizer.eos_id)["response_tokens"]
        set_eval(self.actor)
        try:
            lp, ent = self.actor.get_logprobs_and_entropy(tokens)
        finally:
            set_train(self.actor)
        if empty:
            return torch.zeros(0, 0), torch.zeros(0, 0)
        p, width = prompt_lengths_of(batch), batch.response_ids.shape[1]
        mask = batch.response_mask.float()
        return unpack_response(lp, p, width) * mask, unpack_response(ent, p, width) * mask

    def train_step(self, minibatch: Optional[RolloutBatch], *, num_tokens: float, loss_fn) -> dict:
        actor = self.actor
        actor.prepare_for_training()  # onloads optimizer states offloaded for generation
        self.optimizer.zero_grad()
        actor.prepare_for_training_step()
        batch = _empty_actor_batch(getattr(loss_fn, "tis_cap", None) is not None) \
            if minibatch is None or len(minibatch) == 0 else pack_rollout(minibatch, actor.tokenizer.eos_id)
        _, metrics = actor.get_loss_and_metrics(batch, forward_only=False, num_tokens=num_tokens, loss_fn=loss_fn,
                                                reduce_over_dp=False)
        actor.finish_training_step()
        # None when the optimizer clips inside its step (mcore distributed optimizer, fused Adam) or clipping is off
        grad_norm = clip_gradients(actor, self.gradient_clip_val)
        grad_norm = float(grad_norm) if grad_norm is not None else None
        loss = torch.tensor([metrics.pop("loss")], dtype=torch.float64).cuda()
        dist.all_reduce(loss, group=mcore_ps.get_data_parallel_group())  # shares -> the mini-batch loss
        loss = float(loss.item())
        lr = self.optimizer.param_groups[0]["lr"]
        skipped = not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm))
        if skipped:
            log.warning("non-finite loss (%s) or gradient norm (%s): optimizer step skipped", loss, grad_norm)
            self.optimizer.zero_grad()
        else:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad()
        out = {**metrics, "loss": loss, "lr": lr, "skipped": float(skipped)}
        if grad_norm is not None:
            out["grad_norm"] = grad_norm
        return out

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def loop_settings(cfg: DictConfig, model_cfg: DictConfig) -> LoopSettings:
    """LoopSettings from ``trainer.dapo`` (cfg) and ``model.dapo`` (generation cap, sampling parameters)."""
    d, ov = model_cfg.dapo, cfg.get("overlong") or {}
    sp = d.get("sampling_params") or {}
    max_new = int(d.length_params.max_length)
    if ov.get("l_max") is not None and int(ov.l_max) != max_new:
        raise ValueError(f"trainer.dapo.overlong.l_max ({ov.l_max}) must equal model.dapo.length_params.max_length "
                         f"({max_new}): the soft overlong penalty reaches its floor at the generation cap")
    temperature = 0.0 if sp.get("use_greedy", False) else float(sp.get("temperature", 1.0))
    return LoopSettings(group_size=int(cfg.group_size), mini_batch_size=int(model_cfg.global_batch_size),
                        max_new_tokens=max_new, ppo_epochs=int(cfg.get("ppo_epochs", 1)),
                        temperature=temperature, top_p=float(sp.get("top_p", 1.0)),
                        overlong_shaping=bool(ov.get("enabled", True)), l_cache=int(ov.get("l_cache", 4096)),
                        overlong_penalty_factor=float(ov.get("penalty_factor", 1.0)),
                        adv_eps=float(cfg.get("adv_eps", 1e-6)), scale_by_std=bool(cfg.get("scale_by_std", True)),
                        shuffle_minibatches=bool(cfg.get("shuffle_minibatches", True)),
                        seed=int(cfg.get("seed", model_cfg.get("seed", 0))))


def batch_filler(cfg: DictConfig) -> BatchFiller:
    """The dynamic-sampling filler from ``trainer.dapo.prompts_per_step`` and ``trainer.dapo.dynamic_sampling``."""
    ds = cfg.get("dynamic_sampling") or {}
    opt = {k: ds[k] for k in ("max_gen_batches", "on_budget_exhausted", "max_age", "gen_batch_size", "adaptive",
                              "max_gen_batch_size", "prior_pass_rate", "prior_weight", "pass_rate_memory", "safety")
           if ds.get(k) is not None}
    return BatchFiller(int(cfg.prompts_per_step), enabled=bool(ds.get("enabled", True)), **opt)


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
        self.reducer = reducer or DataParallelReducer()
        self.settings = loop_settings(cfg, model.cfg)
        self.reward_fn = ClientReward(rm)
        self.policy = ActorPolicy(model, optimizer, scheduler, gradient_clip_val=cfg.get("gradient_clip_val", 1.0))
        prompts: PromptSet = train_ds.prompt_set()
        self.loop = DAPOLoop(policy=self.policy, generator=generator, reward_fn=self.reward_fn,
                             loss_fn=model.loss_fn, prompts=prompts, filler=batch_filler(cfg),
                             settings=self.settings, sampler=PromptSampler(len(prompts), seed=self.settings.seed),
                             reducer=self.reducer)
        self.timer = ScopedTimer(reduction="mean", sync_cuda=True, buffer_size=1)
        # NeMo-Aligner's epoch: len(prompts) / prompts_per_step rollout steps. Dynamic sampling draws more prompts
        # per step, so the sampler's own epoch (logged as train/epoch) runs ahead of this count.
        steps_per_epoch = max(1, len(prompts) // int(cfg.prompts_per_step))
        self.max_steps = steps_per_epoch * int(cfg.get("max_epochs", 1) or 1)
        if int(cfg.get("max_steps", -1)) >= 0:
            self.max_steps = min(self.max_steps, int(cfg.max_steps))
        self.history: list = []  # (step, metrics) of every rollout step and validation, for callers and tests
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
    def fit(self) -> None:
        if self.step >= self.max_steps:
            log.info("DAPO training already finished (step %d of %d)", self.step, self.max_steps)
            return
        self.run_timer.start_time()
        while self.step < self.max_steps:
            with self.timer("step_time"):
                metrics = self.loop.step()
            metrics.update({f"timers/{k}": v for k, v in self.timer.consume_durations().items()})
            metrics["train/epoch"] = float(self.epoch)
            self.logger.log_metrics(metrics, step=self.step, prefix="")
            self.history.append((self.step, metrics))
            run_time_exceeded = self.run_timer.is_finished()
            run_val, save, is_train_end = check_progress(
                self.step, self.max_steps, int(self.cfg.get("val_check_interval", 0)),
                int(self.cfg.get("save_interval", 0)), 1.0, run_time_exceeded=run_time_exceeded)
            extra = {}
            if run_val and self.val_ds is not None:
                val = self.run_validation()
                self.logger.log_metrics(val, step=self.step, prefix="")
                self.history.append((self.step, val))
                extra = {k.replace("/", "_"): v for k, v in val.items()}
            if save:
                self.save(extra, is_train_end=is_train_end)
            if run_time_exceeded:
                log.info("time limit of the run reached at step %d: stopping", self.step)
                return
        self.logger.finalize()

    @torch.no_grad()
    def run_validation(self) -> dict:
        """avg@n accuracy (and pass@n, lengths) on ``val_ds`` with ``trainer.dapo.val`` sampling settings."""
        v = self.cfg.get("val") or {}
        with self.timer("validation_time"):
            res = evaluate(self.generator, self.reward_fn, self.val_ds.prompt_set(),
                           n_samples=int(v.get("n_samples", 1)), max_new_tokens=self.settings.max_new_tokens,
                           temperature=float(v.get("temperature", self.settings.temperature)),
                           top_p=float(v.get("top_p", self.settings.top_p)), seed=int(v.get("seed", 0)),
                           batch_size=int(v.get("batch_size", 256)),
                           indices=None if v.get("max_problems") is None else range(
                               min(int(v.max_problems), len(self.val_ds))),
                           reducer=self.reducer)
        out = res.summary(prefix="val/")
        out.update({f"timers/{k}": t for k, t in self.timer.consume_durations().items()})
        return out

    def state_dict(self) -> dict:
        return {"step": self.step, "consumed_samples": self.consumed_samples, "epoch": self.epoch,
                "dapo_optimization_step": self.loop.counters["optimizer_steps"], "loop": self.loop.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.loop.load_state_dict(state["loop"])
        # every rank must have loaded the same checkpoint: compare the counters with rank 0's
        mine = torch.tensor([self.step, self.consumed_samples, self.loop.counters["optimizer_steps"]],
                            dtype=torch.int64).cuda()
        ref = mine.clone()
        dist.broadcast(ref, 0)
        if not torch.equal(mine, ref):
            raise RuntimeError(f"rank {dist.get_rank()} restored trainer counters {mine.tolist()} but rank 0 has "
                               f"{ref.tolist()}: the ranks loaded different checkpoints")

    def save(self, extra_candidates: Optional[dict] = None, is_train_end: bool = False) -> None:
        """Checkpoint through NeMo's checkpoint callback, with this trainer's state inside the checkpoint."""
        self.model.prepare_for_training()  # optimizer states back on the device before they are saved
        dist.barrier()
        self.model.trainer_state = pack_state(self.state_dict())
        candidates = {k: torch.tensor(v, dtype=torch.int32) for k, v in self.state_dict().items() if k != "loop"}
        candidates.update({k: torch.as_tensor(v) for k, v in (extra_candidates or {}).items()})
        self.ckpt_callback.custom_save(monitor_candidates=candidates, is_train_end=is_train_end)
        self.model.finish_training()
