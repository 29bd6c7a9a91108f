"""The "base model" of the CPU job: a short supervised warm-up on worked solutions, stopped while still weak.

DAPO starts RL from a base model that already answers in roughly the right form but is often wrong. Here that
model is made by next-token training on solved problems of the procedural task, with two design choices:

* The training solutions are sloppy on purpose (``task.Sloppiness``): some lines slip by 1 or 10, some final lines
  miss the verifier's ``Answer:`` format, some solutions ramble through a second ``Check:`` pass that pushes long
  chains past the generation cap. Sampling at T=1, the base model reproduces these faults at about their rates on
  top of its own arithmetic and look-up errors: faults that a correctness reward (and the overlong penalty) can
  remove, like the careless slips and format misses of a real base model.
* A stopping rule instead of a fixed length: every ``eval_every`` updates, sample one answer per problem of a small
  probe set from the ``dev`` split (never the evaluation split) at the RL sampling temperature, and stop as soon as
  that accuracy enters ``[target_low, target_high]`` (or the step cap is hit, or the probe jumped past the band;
  the stats say which).

The updates are :meth:`LocalPolicy.train_step` with a token-mean negative log-likelihood as ``loss_fn``, so the
warm-up exercises the same fused log-prob path as RL.
"""
from __future__ import annotations

import json
import os
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator, Optional

import torch

from nemo_dapo.core.reward import verify
from nemo_dapo.core.types import RolloutBatch
from nemo_dapo.data.task import ArithmeticTask, Sloppiness, sloppy_solution
from nemo_dapo.data.template import apply_template
from nemo_dapo.data.tokenizer import encode_prompts, token_ids
from nemo_dapo.local.policy import LocalPolicy
from nemo_dapo.local.sampler import LocalSampler


@dataclass
class WarmupConfig:
    """The warm-up's settings. Their values, with what each means, are the ``warmup`` block of
    ``conf/dapo_base.yaml`` (and the recipes' overrides): ``run_model.warmup_config(cfg)`` builds this from a job's
    config, so no default is kept here. ``max_new_tokens`` is the probe's generation cap; ``seed`` the run's."""
    batch_size: int
    lr: float
    lr_warmup_steps: int
    weight_decay: float
    grad_clip: float
    max_steps: int
    min_steps: int
    eval_every: int
    probe_size: int
    temperature: float
    max_new_tokens: int
    target_low: float
    target_high: float
    max_seconds: Optional[float]
    slip_prob: float
    format_prob: float
    ramble_prob: float
    ramble_passes: int
    seed: int


@dataclass
class WarmupStats:
    steps: int = 0
    seconds: float = 0.0  # wall clock
    cpu_seconds: float = 0.0  # this process's CPU time (what the warm-up costs on an idle core)
    probe_accuracy: float = 0.0
    stop_reason: str = ""  # "in_band" | "overshot" | "max_steps" | "max_seconds"
    history: list = field(default_factory=list)  # [{step, probe_accuracy, loss, seconds}]


def sft_loss(logp: torch.Tensor, entropy: torch.Tensor, microbatch: RolloutBatch, norm):
    """Token-mean negative log-likelihood of the response tokens; ``norm`` is the mini-batch token count."""
    mask = microbatch.response_mask > 0
    nll = -torch.where(mask, logp, torch.zeros_like(logp)).sum() / norm
    return nll, {}


def sft_batch(tokenizer, prompts: list, solutions: list) -> RolloutBatch:
    """Prompts (template applied) + worked solutions -> a RolloutBatch whose responses end with EOS."""
    prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts)
    seqs = [ids + [tokenizer.eos_token_id] for ids in token_ids(tokenizer, solutions)]
    width = max(len(s) for s in seqs)
    response_ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    response_mask = torch.zeros(len(seqs), width)
    for i, s in enumerate(seqs):
        response_ids[i, :len(s)] = torch.tensor(s)
        response_mask[i, :len(s)] = 1.0
    n = len(seqs)
    return RolloutBatch(prompt_ids, prompt_mask, response_ids, response_mask, group_ids=torch.arange(n),
                        truncated=torch.zeros(n, dtype=torch.bool), pad_id=tokenizer.pad_token_id)


def sample_accuracy(model, tokenizer, rows: list, *, temperature: float, max_new_tokens: int, seed: int,
                    samples_per_problem: int = 1, score: Optional[Callable] = None) -> float:
    """Mean correctness of sampled answers to verl-schema ``rows`` (the DAPO verifier by default)."""
    score = score or (lambda text, gt: verify(text, gt).acc)
    prompts = [r["prompt"][-1]["content"] for r in rows for _ in range(samples_per_problem)]
    truths = [r["reward_model"]["ground_truth"] for r in rows for _ in range(samples_per_problem)]
    ids, mask = encode_prompts(tokenizer, prompts)
    sampler = LocalSampler(model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)
    gen = sampler.generate(ids, mask, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    texts = [tokenizer.decode(r[m > 0], skip_special_tokens=True)
             for r, m in zip(gen.response_ids, gen.response_mask)]
    return sum(bool(score(t, g)) for t, g in zip(texts, truths)) / max(len(texts), 1)


def sft_batches(task: ArithmeticTask, tokenizer, cfg: WarmupConfig) -> Iterator[RolloutBatch]:
    """Endless batches of sloppy worked solutions to train-split problems (deterministic in ``cfg.seed``)."""
    problems = task.iter_problems("train", seed=cfg.seed)
    sloppiness = Sloppiness(cfg.slip_prob, cfg.format_prob, cfg.ramble_prob, cfg.ramble_passes)
    rng = random.Random(f"{cfg.seed}:sloppy")
    while True:
        batch = [next(problems) for _ in range(cfg.batch_size)]
        yield sft_batch(tokenizer, [apply_template(p) for p in batch],
                        [sloppy_solution(p, rng, sloppiness, task.style) for p in batch])


def supervised_warmup(model, tokenizer, task: ArithmeticTask, cfg: WarmupConfig,
                      log: Optional[Callable[[str], None]] = print) -> tuple:
    """Train ``model`` in place on worked solutions of ``task``'s train split until the probe enters the band.

    Returns (model, :class:`WarmupStats`). Deterministic for a given ``cfg.seed`` (on the same machine and thread
    count), except that ``max_seconds`` makes the stopping point depend on speed.
    """
    policy = LocalPolicy(model, lr=cfg.lr, weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip,
                         warmup_steps=cfg.lr_warmup_steps)
    probe = task.rows("dev", cfg.probe_size, seed=cfg.seed)
    batches = sft_batches(task, tokenizer, cfg)
    stats, start, cpu_start = WarmupStats(), time.perf_counter(), time.process_time()
    for step in range(1, cfg.max_steps + 1):
        batch = next(batches)
        loss = policy.train_step(batch, norm=float(batch.num_tokens()), loss_fn=sft_loss)["loss"]
        stats.steps, stats.seconds = step, time.perf_counter() - start
        reason = _stop_reason(step, stats.seconds, cfg)
        if step >= cfg.min_steps and (step % cfg.eval_every == 0 or reason):
            acc = sample_accuracy(model, tokenizer, probe, temperature=cfg.temperature,
                                  max_new_tokens=cfg.max_new_tokens, seed=cfg.seed + step)
            stats.probe_accuracy, stats.seconds = acc, time.perf_counter() - start
            stats.history.append(dict(step=step, probe_accuracy=acc, loss=loss, seconds=round(stats.seconds, 2)))
            if log:
                log(f"warm-up step {step}: loss {loss:.3f}, probe accuracy {acc:.3f} ({stats.seconds:.0f}s)")
            if acc >= cfg.target_low:
                reason = "in_band" if acc <= cfg.target_high else "overshot"
        if reason:
            stats.stop_reason = reason
            break
    stats.seconds, stats.cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    model.eval()
    return model, stats


def _stop_reason(step: int, seconds: float, cfg: WarmupConfig) -> str:
    if step >= cfg.max_steps:
        return "max_steps"
    if cfg.max_seconds is not None and seconds >= cfg.max_seconds:
        return "max_seconds"
    return ""


def save_warmup(directory, model, tokenizer, stats: WarmupStats, cfg: WarmupConfig) -> None:
    """Model + tokenizer (``save_pretrained`` layout) and ``warmup.json`` (config and stats) in ``directory``."""
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    with open(os.path.join(directory, "warmup.json"), "w") as f:
        json.dump({"config": asdict(cfg), "stats": asdict(stats)}, f, indent=1)
