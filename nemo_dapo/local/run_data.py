"""Prompt sets of a CPU run: the procedural task (default) or verl / DAPO-Math files, tokenized for the loop."""
from __future__ import annotations

import logging

from nemo_dapo.local.config import Config, ConfigError
from nemo_dapo.core.loop_data import PromptSet
from nemo_dapo.data.readers import from_verl_rows, prompt_far_too_long, read_dataset
from nemo_dapo.data.task import ArithmeticTask
from nemo_dapo.data.tokenizer import token_ids

log = logging.getLogger("nemo_dapo")

# The held-out problems do not depend on the run's seed, so runs with different seeds or recipes (DAPO vs. the
# naive-GRPO baseline) are evaluated on the same problems.
HELDOUT_SEED = 0
ENCODE_CHUNK = 4096  # prompts per batched tokenizer call (bounds the memory of one call)


def make_task(cfg: Config) -> ArithmeticTask:
    d = cfg.data
    return ArithmeticTask(min_terms=d.min_terms, max_terms=d.max_terms, max_operand=d.max_operand,
                          max_value=d.max_value, ops=d.ops, max_multiplier=d.max_multiplier)


def encode(tokenizer, rows: list, *, max_prompt_tokens: int, what: str,
           limit: str = "data.max_prompt_tokens") -> PromptSet:
    """``MathRow`` list -> PromptSet ([BOS] + prompt tokens, as ``encode_prompts`` does); prompts longer than
    ``max_prompt_tokens`` (named ``limit`` in the messages) dropped."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    kept = [row for row in rows if not prompt_far_too_long(row.prompt, max_prompt_tokens)]  # never tokenize a MB line
    ids, truths = [], []
    for start in range(0, len(kept), ENCODE_CHUNK):
        chunk = kept[start:start + ENCODE_CHUNK]
        encoded = token_ids(tokenizer, [row.prompt for row in chunk])
        for row, tokens in zip(chunk, encoded):
            if len(bos) + len(tokens) <= max_prompt_tokens:
                ids.append(bos + tokens)
                truths.append(row.ground_truth)
    dropped = len(rows) - len(ids)
    if dropped:
        log.warning("%s: dropped %d of %d prompts longer than %s=%d", what, dropped, len(rows), limit,
                    max_prompt_tokens)
    if not ids:
        raise ConfigError(f"{what}: every prompt is longer than {limit}={max_prompt_tokens}; raise it")
    return PromptSet(ids, truths, pad_id=tokenizer.pad_token_id)


def build_prompt_sets(cfg: Config, tokenizer) -> tuple:
    """(train PromptSet, held-out PromptSet) for ``cfg.data``."""
    d = cfg.data
    if d.task == "arithmetic":
        task = make_task(cfg)
        try:
            train = from_verl_rows(task.rows("train", d.train_size, cfg.seed), "arithmetic train")
            heldout = from_verl_rows(task.rows("heldout", d.heldout_size, HELDOUT_SEED), "arithmetic heldout")
        except ValueError as e:
            raise ConfigError(f"config keys 'data.train_size' = {d.train_size} / 'data.heldout_size' = "
                              f"{d.heldout_size} with this arithmetic task ('data.max_terms', 'data.max_operand', "
                              f"...): {e}") from None
    else:
        if not d.heldout_file:
            raise ConfigError("config key 'data.heldout_file' must name the held-out set when data.task=file "
                              "(e.g. an AIME-2024 parquet with data.heldout_format=aime2024)")
        train = read_dataset(d.train_format, d.train_file)[:d.train_size]
        heldout = read_dataset(d.heldout_format, d.heldout_file)[:d.heldout_size]
    return (encode(tokenizer, train, max_prompt_tokens=d.max_prompt_tokens, what="train set"),
            encode(tokenizer, heldout, max_prompt_tokens=d.max_prompt_tokens, what="held-out set"))
