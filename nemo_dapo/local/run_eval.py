"""``nemo-dapo eval``: avg@k, pass@k and maj@k of a local model directory on a reader's data set.

Repeated evaluation as the paper does it: the AIME-2024 parquet holds each problem 32 times, so one sample per row
gives 32 samples per problem (avg@32); a de-duplicated file gets ``samples`` per row instead. Samples are grouped by
the reader's stable problem id either way, and k is the number of samples each problem got.
"""
from __future__ import annotations

import difflib
import math
import os

import torch

from nemo_dapo.local.config import ArgumentError
from nemo_dapo.core.loop_eval import evaluate
from nemo_dapo.core.metrics import eval_summary, length_stats
from nemo_dapo.core.reward import MODES, RuleReward
from nemo_dapo.core.settings import MIN_TEMPERATURE
from nemo_dapo.data.readers import READERS, DataFormatError, read_dataset
from nemo_dapo.data.tokenizer import load_tokenizer
from nemo_dapo.models.decoder import load_model
from nemo_dapo.local.run_data import encode
from nemo_dapo.local.sampler import LocalSampler


def _choice(flag: str, value: str, choices) -> None:
    if value not in choices:
        close = difflib.get_close_matches(str(value), list(choices), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ArgumentError(f"{flag} {value!r} is not one of {sorted(choices)}{hint}")


def check_arguments(model_dir: str, data: str, *, fmt: str, samples: int, limit, temperature: float, top_p: float,
                    max_new_tokens: int, verifier: str, batch_size: int, threads: int) -> None:
    """Every argument of :func:`evaluate_model`, checked before the model is loaded; errors name the flag."""
    _choice("--format", fmt, READERS)
    _choice("--verifier", verifier, MODES)
    for flag, value in (("--samples", samples), ("--max-new-tokens", max_new_tokens), ("--batch-size", batch_size),
                        ("--threads", threads)):
        if value < 1:
            raise ArgumentError(f"{flag} must be >= 1, got {value}")
    if limit is not None and limit < 1:
        raise ArgumentError(f"--limit must be >= 1 (the number of rows to evaluate; omit it for all), got {limit}")
    if not math.isfinite(temperature) or temperature < 0 or 0 < temperature < MIN_TEMPERATURE:
        raise ArgumentError(f"--temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE} (paper: 1.0), "
                            f"got {temperature}")
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise ArgumentError(f"--top-p must be in (0, 1] (paper: 0.7), got {top_p}")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ArgumentError(f"--model {model_dir!r} is not a model directory (no config.json). Fix: a directory "
                            "written by `nemo-dapo train`, e.g. RUN_DIR/final_model or RUN_DIR/base_model")
    if not os.path.isfile(data):
        raise ArgumentError(f"--data {data!r}: {'a directory' if os.path.isdir(data) else 'no such file'}. Fix: a "
                            f"parquet or jsonl file of the --format {fmt!r}")
    RuleReward(str, mode=verifier, num_workers=1)  # math_verify: the optional package, named with its install command


def evaluate_model(model_dir: str, data: str, *, fmt: str = "aime2024", samples: int = 1, limit=None,
                   temperature: float = 1.0, top_p: float = 0.7, max_new_tokens: int = 64, verifier: str = "dapo",
                   batch_size: int = 256, seed: int = 0, threads: int = 1) -> dict:
    """Evaluate ``model_dir`` on ``data``; returns avg@k / pass@k / maj@k, length statistics and counts."""
    check_arguments(model_dir, data, fmt=fmt, samples=samples, limit=limit, temperature=temperature, top_p=top_p,
                    max_new_tokens=max_new_tokens, verifier=verifier, batch_size=batch_size, threads=threads)
    torch.set_num_threads(threads)
    model, tokenizer = load_model(model_dir), load_tokenizer(model_dir)
    rows = read_dataset(fmt, data)
    rows = rows[:limit] if limit is not None else rows
    room = model.config.max_position_embeddings - max_new_tokens
    if room < 1:
        raise ArgumentError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the model's "
                            f"{model.config.max_position_embeddings} positions ({model_dir}). Fix: "
                            f"--max-new-tokens below {model.config.max_position_embeddings}")
    prompts = encode(tokenizer, rows, max_prompt_tokens=room, what=data,
                     limit="the model's positions less --max-new-tokens")
    if len(prompts) != len(rows):
        raise DataFormatError(f"{data}: {len(rows) - len(prompts)} prompts do not fit the model's context "
                              f"({model.config.max_position_embeddings} positions - {max_new_tokens} new tokens)")
    sampler = LocalSampler(model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)
    reward = RuleReward(lambda ids: tokenizer.decode(ids, skip_special_tokens=True), mode=verifier, num_workers=1)
    res = evaluate(sampler, reward, prompts, n_samples=samples, max_new_tokens=max_new_tokens,
                   temperature=temperature, top_p=top_p, seed=seed, batch_size=batch_size)
    keys = [row.id for row in rows for _ in range(samples)]
    preds = [p for row_preds in res.preds for p in row_preds]
    accs = res.acc.reshape(-1).tolist()
    per_problem = {}
    for key in keys:
        per_problem[key] = per_problem.get(key, 0) + 1
    k = min(per_problem.values())
    out = {"model": model_dir, "data": data, "format": fmt, "rows": len(rows), "problems": len(per_problem),
           "k": k, "temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens,
           "verifier": verifier, "seconds": round(res.seconds, 2)}
    out.update(eval_summary(keys, preds, accs, k))
    out.update(length_stats(res.lengths.reshape(-1), res.truncated.reshape(-1)))
    return out
