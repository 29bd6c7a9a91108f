"""A small BPE tokenizer trained offline on the task corpus (about a second), wrapped for ``transformers``.

Design:
  * byte-level alphabet, so any text encodes and ``decode(encode(x)) == x`` exactly (spaces, newlines included:
    the verifier parses ``Answer: 14`` from decoded text);
  * digits are split into single-digit pre-tokens, so numbers are spelled digit by digit and merges never glue a
    digit to its neighbours (arithmetic stays learnable);
  * no whitespace pre-splitting, so merges may cross spaces: the ~50-word DAPO template, repeated in every prompt,
    compresses into a handful of tokens;
  * special tokens ``<|pad|>`` (id 0), ``<|bos|>`` (1), ``<|eos|>`` (2); padding on the left (generation).
Nothing is downloaded: the tokenizer is trained from text and saved to / loaded from a local directory.
"""
from __future__ import annotations

import os
from typing import Iterable, Iterator

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
SPECIAL_TOKENS = (PAD, BOS, EOS)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 512, min_frequency: int = 2):
    """BPE over bytes with single-digit pre-tokens; returns a ``PreTrainedTokenizerFast``.

    ``vocab_size`` counts the 256 byte symbols and the 3 special tokens; the rest are merges learnt from ``texts``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size={vocab_size} leaves no room for merges; use at least 260 "
                         f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens + merges)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return wrap_tokenizer(tok)


def wrap_tokenizer(tok):
    """``tokenizers.Tokenizer`` -> ``PreTrainedTokenizerFast`` with pad/bos/eos and left padding."""
    from transformers import PreTrainedTokenizerFast

    for special in SPECIAL_TOKENS:
        if tok.token_to_id(special) is None:
            raise ValueError(f"tokenizer lacks the special token {special!r}; train it with train_tokenizer()")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS,
                                   padding_side="left", clean_up_tokenization_spaces=False)


def task_corpus(rows: Iterable[dict], seed: int = 0, style: str = "steps") -> Iterator:
    """Texts the task tokenizer is trained on: prompts, clean worked solutions and sloppy ones (so that the
    phrases of sloppy solutions, e.g. ``Check:``, get merges too)."""
    import random

    from nemo_dapo.data.task import Sloppiness, sloppy_solution

    rng, noisy = random.Random(seed), Sloppiness(slip_prob=0.1, format_prob=0.5, ramble_prob=0.5)
    for row in rows:
        yield row["prompt"][-1]["content"]
        solution = row.get("extra_info", {}).get("solution")
        if solution:
            yield solution
            yield sloppy_solution(row["extra_info"]["raw_problem"], rng, noisy, style)


def build_task_tokenizer(task=None, n_rows: int = 2000, seed: int = 0, vocab_size: int = 512):
    """Train the tokenizer of the procedural task on ``n_rows`` training rows (deterministic for a seed)."""
    from nemo_dapo.data.task import ArithmeticTask

    task = task or ArithmeticTask()
    corpus = task_corpus(task.rows("train", n_rows, seed, unique=False), seed, task.style)
    return train_tokenizer(corpus, vocab_size=vocab_size)


def save_tokenizer(tokenizer, directory) -> str:
    os.makedirs(directory, exist_ok=True)
    tokenizer.save_pretrained(os.fspath(directory))
    return os.fspath(directory)


def load_tokenizer(directory):
    """Load a tokenizer saved by :func:`save_tokenizer` (local files only)."""
    from transformers import PreTrainedTokenizerFast

    path = os.fspath(directory)
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise FileNotFoundError(f"no tokenizer.json in {path!r}; build one with build_task_tokenizer() and "
                                "save_tokenizer(), or point at a directory written by save_pretrained()")
    tok = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    tok.padding_side = "left"
    return tok


def token_ids(tokenizer, texts) -> list:
    """``[tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]`` in one batched call (the fast
    tokenizer encodes a list ~3x faster than one text at a time)."""
    texts = list(texts)
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


def encode_prompts(tokenizer, prompts, add_bos: bool = True):
    """Prompt texts -> (ids [B, P] long, mask [B, P] long), LEFT-padded with the pad token, BOS prepended.

    Generation needs left padding so that every row's last column is its last prompt token.
    """
    import torch

    if isinstance(prompts, str):
        raise TypeError("encode_prompts takes a list of prompt texts, not one string")
    bos = [tokenizer.bos_token_id] if add_bos and tokenizer.bos_token_id is not None else []
    seqs = [bos + ids for ids in token_ids(tokenizer, prompts)]
    width = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = 1
    return ids, mask
