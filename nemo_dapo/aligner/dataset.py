"""Prompt data set for DAPO on NeMo-Aligner: prompts with their ground-truth answers and explicit group ids.

NeMo-Aligner's ``RLHFDataset`` yields prompt tokens only (a reward model needs nothing else) and groups samples by
prompt-token equality. A rule-based reward needs the answer of every prompt, and DAPO groups by an explicit id per
prompt DRAW (the public DAPO-Math-17k file repeats each prompt ~100 times; two draws of one prompt in a batch must
not merge into one group). So an item carries its answer and its problem id, and ``collate`` takes the draws' group
ids from the caller (the step loop's ``PromptSampler`` numbers every draw).

Item: ``{"text": LongTensor [L] prompt ids, "length": L, "answer": str, "problem_id": str, "index": int}``.
Batch (``collate``): ``text`` [B, P] RIGHT-padded with ``pad_id`` (NeMo-Aligner's generate input), ``length`` [B],
``prompt_ids``/``prompt_mask`` [B, P] LEFT-padded (the core layout, types.py), ``answers`` list[str],
``group_ids`` [B] long.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import torch

from nemo_dapo.core.loop_data import PromptSet

log = logging.getLogger("nemo_dapo")


def chat_renderer(tokenizer) -> Callable[[str], str]:
    """text -> the tokenizer's chat template over one user turn, assistant turn opened. ``tokenizer``: a NeMo
    tokenizer wrapping a HuggingFace one (``.tokenizer``) or a HuggingFace tokenizer itself."""
    hf = getattr(tokenizer, "tokenizer", tokenizer)
    if not callable(getattr(hf, "apply_chat_template", None)) or not getattr(hf, "chat_template", None):
        raise ValueError(f"model.data.chat_template is true but the tokenizer ({type(hf).__name__}) has no chat "
                         "template: use a tokenizer that ships one (Qwen2.5's does) or set "
                         "model.data.chat_template=false to send the raw DAPO prompt")
    return lambda text: hf.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                               add_generation_prompt=True)


# readers that can drop repeated copies of a problem (``dedup=``)
_DEDUP_FORMATS = ("dapo_math", "verl", "aime2024")


def build_prompt_dataset(data_cfg, split: str, tokenizer) -> "DAPOPromptDataset":
    """The ``split`` ("train" / "validation") of ``model.data``: every file of ``data_prefix[split]`` read with the
    split's reader, repeated copies of a problem dropped when ``deduplicate`` / ``validation_deduplicate`` says so
    (the AIME-2024 file holds 30 problems x 32 copies: de-duplicated, ``trainer.dapo.val.n_samples: 32`` gives
    avg@32 from 30 x 32 generations instead of 960 x 32), templated, tokenised once."""
    from nemo_dapo.data.readers import read_dataset

    files = list(data_cfg.data_prefix.get(split) or [])
    if not files:
        raise ValueError(f"model.data.data_prefix.{split} lists no files; pass e.g. \"model.data.data_prefix="
                         "{train: [/data/dapo17k.parquet], validation: [/data/aime.parquet]}\"")
    train = split == "train"
    fmt = data_cfg.train_format if train else data_cfg.validation_format
    dedup = bool(data_cfg.deduplicate if train else data_cfg.validation_deduplicate)
    kwargs = {"dedup": dedup} if fmt in _DEDUP_FORMATS else {}
    rows = [row for path in files for row in read_dataset(fmt, path, **kwargs)]
    if dedup and len(files) > 1:
        seen, unique = set(), []
        for row in rows:
            if row.problem not in seen:
                seen.add(row.problem)
                unique.append(row)
        rows = unique
    ds = DAPOPromptDataset(rows, tokenizer, max_prompt_len=int(data_cfg.max_prompt_tokens),
                           prompt_template=data_cfg.prompt_template, chat_template=bool(data_cfg.chat_template),
                           add_bos=bool(data_cfg.add_bos))
    log.info("%s prompts: %d (%s, %s; chat template %s)", split, len(ds), fmt,
             "de-duplicated" if dedup else "copies kept", "on" if data_cfg.chat_template else "off")
    return ds


class DAPOPromptDataset(torch.utils.data.Dataset):
    """Tokenised prompts + answers. ``rows``: objects with ``prompt`` and ``ground_truth`` (and optionally ``id``),
    e.g. ``nemo_dapo.data.readers.read_dataset(...)``; ``tokenizer``: a NeMo tokenizer (``text_to_ids``, ``eos_id``,
    ``bos_id``). ``prompt_template`` wraps each prompt (``{prompt}`` is replaced); ``chat_template`` then renders
    the result as one user turn with the tokenizer's own chat template and the assistant turn opened (what the
    reference, verl, does with the DAPO prompt: ``apply_chat_template(..., add_generation_prompt=True)``).
    Prompts longer than ``max_prompt_len`` tokens are dropped and counted (``num_dropped``), or raise with
    ``drop_long=False`` - the engine cannot take them (max_input_len)."""

    def __init__(self, rows: Sequence, tokenizer, *, max_prompt_len: int, prompt_template: str = "{prompt}",
                 chat_template: bool = False, add_bos: bool = False, drop_long: bool = True,
                 pad_id: Optional[int] = None):
        if max_prompt_len < 1:
            raise ValueError(f"max_prompt_len must be >= 1, got {max_prompt_len}")
        if "{prompt}" not in prompt_template:
            raise ValueError(f"prompt_template must contain '{{prompt}}', got {prompt_template!r}")
        render = chat_renderer(tokenizer) if chat_template else (lambda text: text)
        self.pad_id = tokenizer.eos_id if pad_id is None else pad_id
        self.items, self.num_dropped = [], 0
        for index, row in enumerate(rows):
            ids = list(tokenizer.text_to_ids(render(prompt_template.replace("{prompt}", row.prompt))))
            if add_bos:
                ids = [tokenizer.bos_id] + ids
            if not ids:
                raise ValueError(f"row {index}: the prompt tokenises to nothing; check the data file")
            if len(ids) > max_prompt_len:
                if not drop_long:
                    raise ValueError(f"row {index}: prompt of {len(ids)} tokens exceeds max_prompt_len="
                                     f"{max_prompt_len}; raise it (and model.encoder_seq_length) or drop_long=True")
                self.num_dropped += 1
                continue
            self.items.append({"ids": ids, "answer": str(row.ground_truth),
                               "problem_id": str(getattr(row, "id", index)), "index": index})
        if self.num_dropped:
            log.warning("DAPOPromptDataset: dropped %d of %d prompts longer than %d tokens", self.num_dropped,
                        self.num_dropped + len(self.items), max_prompt_len)
        if not self.items:
            raise ValueError(f"DAPOPromptDataset is empty ({self.num_dropped} prompts were longer than "
                             f"max_prompt_len={max_prompt_len})")

    @classmethod
    def from_file(cls, fmt: str, path: str, tokenizer, **kwargs) -> "DAPOPromptDataset":
        """Read ``path`` with ``nemo_dapo.data.readers.read_dataset(fmt, path)`` (dapo_math, aime2024, ...)."""
        from nemo_dapo.data.readers import read_dataset

        return cls(read_dataset(fmt, path), tokenizer, **kwargs)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        it = self.items[i]
        return {"text": torch.tensor(it["ids"], dtype=torch.long), "length": len(it["ids"]),
                "answer": it["answer"], "problem_id": it["problem_id"], "index": it["index"]}

    def prompt_set(self) -> PromptSet:
        """The core loop's view: prompt ids and ground truths (row i = item i)."""
        return PromptSet(prompt_ids=[it["ids"] for it in self.items],
                         ground_truths=[it["answer"] for it in self.items], pad_id=self.pad_id)

    def collate_fn(self, group_ids: Optional[Sequence[int]] = None) -> Callable:
        """A DataLoader ``collate_fn`` with this data set's pad id (see :func:`collate`)."""
        return lambda items: collate(items, pad_id=self.pad_id, group_ids=group_ids)


def collate(items: Sequence[dict], *, pad_id: int, group_ids: Optional[Sequence[int]] = None) -> dict:
    """Stack items (see the module doc). ``group_ids``: one explicit id per item (per prompt DRAW); when None the
    items must carry ``"group_id"``. Grouping by the dataset index instead would merge repeated prompts."""
    if not items:
        raise ValueError("collate needs at least one item")
    if group_ids is None:
        if any("group_id" not in it for it in items):
            raise ValueError("collate needs group ids: pass group_ids= (one per item, e.g. the PromptSampler's "
                             "uids) or set item['group_id']; the dataset index would merge repeated prompts")
        group_ids = [it["group_id"] for it in items]
    if len(group_ids) != len(items):
        raise ValueError(f"collate got {len(items)} items but {len(group_ids)} group_ids")
    lengths = torch.tensor([int(it["length"]) for it in items], dtype=torch.long)
    width = int(lengths.max())
    right = torch.full((len(items), width), pad_id, dtype=torch.long)
    left = torch.full((len(items), width), pad_id, dtype=torch.long)
    left_mask = torch.zeros((len(items), width), dtype=torch.long)
    for b, it in enumerate(items):
        n = int(it["length"])
        right[b, :n] = it["text"][:n]
        left[b, width - n:] = it["text"][:n]
        left_mask[b, width - n:] = 1
    return {"text": right, "length": lengths, "prompt_ids": left, "prompt_mask": left_mask,
            "answers": [it["answer"] for it in items], "group_ids": torch.as_tensor(list(group_ids), dtype=torch.long)}
