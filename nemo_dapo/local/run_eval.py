"""``nemo-dapo eval``: avg@k, pass@k and maj@k of a local model directory on a reader's data set.

Repeated evaluation as the paper does it: the AIME-2024 parquet holds each problem 32 times, so one sample per row
gives 32 samples per problem (avg@32); a de-duplicated file gets ``samples`` per row instead. Samples are grouped by
the reader's stable problem id either way, and k is the number of samples each problem got.
"""
from __future__ import annotations

import torch

from nemo_dapo.core.loop_eval import evaluate
from nemo_dapo.core.metrics import eval_summary, length_stats
from nemo_dapo.core.reward import RuleReward
from nemo_dapo.data.readers import DataFormatError, read_dataset
from nemo_dapo.data.tokenizer import load_tokenizer
from nemo_dapo.local.model import load_model
from nemo_dapo.local.run_data import encode
from nemo_dapo.local.sampler import LocalSampler


def evaluate_model(model_dir: str, data: str, *, fmt: str = "aime2024", samples: int = 1, limit=None,
                   temperature: float = 1.0, top_p: float = 0.7, max_new_tokens: int = 64, verifier: str = "dapo",
                   batch_size: int = 256, seed: int = 0, threads: int = 1) -> dict:
    """Evaluate ``model_dir`` on ``data``; returns avg@k / pass@k / maj@k, length statistics and counts."""
    if samples < 1:
        raise ValueError(f"--samples must be >= 1, got {samples}")
    torch.set_num_threads(threads)
    model, tokenizer = load_model(model_dir), load_tokenizer(model_dir)
    rows = read_dataset(fmt, data)
    rows = rows[:limit] if limit else rows
    room = model.config.max_position_embeddings - max_new_tokens
    if room < 1:
        raise ValueError(f"--max-new-tokens={max_new_tokens} leaves no room for a prompt in the model's "
                         f"{model.config.max_position_embeddings} positions")
    prompts = encode(tokenizer, rows, max_prompt_tokens=room, what=data)
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
