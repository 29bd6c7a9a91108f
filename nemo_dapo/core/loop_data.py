"""What the step loop needs from a data set: tokenized prompts, a resumable prompt sampler, and rank splits.

* :class:`PromptSet`  tokenized prompts + ground-truth strings; ``collate`` left-pads them (types.py layout).
* :class:`PromptSampler`  draws prompt indices epoch by epoch from a seeded permutation and gives every draw an
  explicit group id (uid); its whole state is four integers (plus the prompt history when skipping is on), so
  resuming restores the exact position.
* :func:`balanced_split`  splits a mini-batch between data-parallel ranks so that each gets about the same number
  of response tokens (the cost of a training pass is proportional to tokens, not to samples).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class PromptSet:
    """``prompt_ids[i]``: token ids of prompt i (unpadded, non-empty); ``ground_truths[i]``: its answer string."""

    prompt_ids: list
    ground_truths: list
    pad_id: int = 0

    def __post_init__(self):
        if len(self.prompt_ids) != len(self.ground_truths):
            raise ValueError(f"PromptSet: {len(self.prompt_ids)} prompts but {len(self.ground_truths)} ground truths")
        if not self.prompt_ids:
            raise ValueError("PromptSet is empty: the data source produced no prompts (check the data file/split)")
        for i, ids in enumerate(self.prompt_ids):
            if len(ids) == 0:
                raise ValueError(f"PromptSet: prompt {i} has no tokens (empty prompt text?)")

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def collate(self, indices: Sequence[int]) -> tuple:
        """(prompt_ids [n, P] long LEFT-padded with pad_id, prompt_mask [n, P] long) for the given rows."""
        rows = [self.prompt_ids[i] for i in indices]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for k, r in enumerate(rows):
            ids[k, width - len(r):] = torch.as_tensor(r, dtype=torch.long)
            mask[k, width - len(r):] = 1
        return ids, mask


class PromptSampler:
    """Endless prompt draws: each epoch is a fresh permutation of ``range(num_prompts)`` seeded by (seed, epoch).

    Every draw gets a new uid (0, 1, 2, ...), so two draws of the same prompt never share a group id.
    State: seed, epoch, position in the epoch's permutation, next uid (= prompts consumed so far).
    ``history`` (optional, core/prompt_history.PromptHistory): each permutation entry is first offered to it and
    passed over when it says skip (the draw goes on to the next entry); its state is part of this state.
    """

    def __init__(self, num_prompts: int, *, seed: int = 0, shuffle: bool = True, history=None):
        if num_prompts < 1:
            raise ValueError(f"PromptSampler needs at least one prompt, got num_prompts={num_prompts}")
        self.num_prompts, self.seed, self.shuffle = num_prompts, seed, shuffle
        self.epoch, self.position, self.next_uid = 0, 0, 0
        self.history = history
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> list:
        if not self.shuffle:
            return list(range(self.num_prompts))
        g = torch.Generator().manual_seed(_mix(self.seed, epoch))
        return torch.randperm(self.num_prompts, generator=g).tolist()

    @property
    def consumed(self) -> int:
        """Prompts drawn so far (over all epochs)."""
        return self.next_uid

    def draw(self, n: int) -> tuple:
        """(indices, uids): ``n`` prompt indices (crossing epoch boundaries as needed) and their fresh uids."""
        if n < 1:
            raise ValueError(f"PromptSampler.draw: n must be >= 1, got {n}")
        indices = []
        while len(indices) < n:
            if self.position == self.num_prompts:
                self.epoch, self.position = self.epoch + 1, 0
                self._perm = self._permutation(self.epoch)
            if self.history is not None:
                # Terminates: the history skips a prompt at most max_skips times in a row.
                index = self._perm[self.position]
                self.position += 1
                if not self.history.consider(index):
                    indices.append(index)
                continue
            take = min(n - len(indices), self.num_prompts - self.position)
            indices.extend(self._perm[self.position:self.position + take])
            self.position += take
        uids = list(range(self.next_uid, self.next_uid + n))
        self.next_uid += n
        return indices, uids

    @property
    def skipped(self) -> int:
        """Permutation entries passed over by the history so far (0 without one)."""
        return self.history.skipped if self.history is not None else 0

    def state_dict(self) -> dict:
        state = dict(num_prompts=self.num_prompts, seed=self.seed, shuffle=self.shuffle, epoch=self.epoch,
                     position=self.position, next_uid=self.next_uid)
        if self.history is not None:
            state["history"] = self.history.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if state["num_prompts"] != self.num_prompts:
            raise ValueError(f"PromptSampler: checkpoint was taken on {state['num_prompts']} prompts, this run has "
                             f"{self.num_prompts}; resume with the same data settings")
        self.seed, self.shuffle = state["seed"], state["shuffle"]
        self.epoch, self.position, self.next_uid = state["epoch"], state["position"], state["next_uid"]
        self._perm = self._permutation(self.epoch)
        if self.history is not None and state.get("history") is not None:
            self.history.load_state_dict(state["history"])


def _mix(*values: int) -> int:
    """A 63-bit seed from a few integers (splitmix64-style), so nearby inputs give unrelated seeds."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (int(v) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return h & 0x7FFFFFFFFFFFFFFF


def mix_seed(*values: int) -> int:
    """Public form of the seed mixer: seeds derived from counters need no RNG state to be resumed."""
    return _mix(*values)


def balanced_split(num_tokens: Sequence[int], world_size: int) -> list:
    """Split samples between ``world_size`` ranks with about equal token counts.

    ``num_tokens[i]``: cost of sample i (its valid response tokens). Returns ``world_size`` lists of sample
    indices (ascending in each list) that together hold every index exactly once. Greedy longest-first: each
    sample, longest first, goes to the rank with the fewest tokens so far (ties: fewer samples, then lower
    rank), which keeps the largest load within 4/3 of the optimum and spreads zero-token samples evenly.
    Deterministic, so every rank computes the same split.
    """
    if world_size < 1:
        raise ValueError(f"balanced_split: world_size must be >= 1, got {world_size}")
    order = sorted(range(len(num_tokens)), key=lambda i: (-int(num_tokens[i]), i))
    loads = [[0, 0, r] for r in range(world_size)]  # tokens, samples, rank
    shares = [[] for _ in range(world_size)]
    for i in order:
        target = min(loads)
        shares[target[2]].append(i)
        target[0] += int(num_tokens[i])
        target[1] += 1
    return [sorted(s) for s in shares]
