"""Partial rollouts: groups suspended when the dynamic-sampling filler is full, continued after the refit.

Instead of aborting the groups still generating once the filler is full (``on_filler_full: abort``), the loop
suspends them (``suspend``): the engine reports each unfinished sample's tokens so far with their sampling log-probs
(the behaviour policy's), and a :class:`SuspendedGroup` keeps them with the weight version that sampled every
token. After the refit each unfinished sample is resubmitted as prompt + partial response with the remaining token
budget and continues under the new weights (engines with a prefix cache reuse the prompt's blocks).

Staleness: ``version`` counts the refits of the generator (0 = the weights it started with). A suspended group is
dropped (and counted) when the weights that would continue it are more than ``max_staleness`` versions newer than
its oldest token, so every token of a response was sampled by weights at most ``max_staleness`` versions older than
the newest weights that sampled any of it (the span of a response). A group whose samples have all finished is
never dropped: nothing continues it. ``max_staleness: 0`` resumes nothing: the loop then aborts as before.

Per-token behaviour log-probs end up in ``RolloutBatch.engine_logp``; the loss takes its ratio against the trainer's
own old-log-prob pass and corrects the behaviour mismatch with the truncated importance weight (core/loss.py).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

import torch

from nemo_dapo.core.loop_data import mix_seed
from nemo_dapo.core.types import Generation

FINISHED = ("stop", "length")


@dataclass
class SampleState:
    """One sample of a suspended group: its tokens so far (EOS included when it finished)."""

    tokens: list  # generated token ids
    logprobs: list  # sampling log-prob of each token under the weights that drew it
    versions: list  # weight version that drew each token
    finish: Optional[str] = None  # "stop" / "length" once finished; None while it still has to continue


@dataclass
class SuspendedGroup:
    """The G samples of one prompt draw, some finished, some to continue. Plain data (checkpointed as a dict)."""

    index: int  # the prompt's index in the PromptSet
    uid: int  # the prompt draw's id (the Group's uid once complete)
    seed: int  # the group's request seed; each resubmission derives its samples' seeds from it
    samples: list = field(default_factory=list)  # [SampleState] * G, sample order
    resumes: int = 0  # times the group was resubmitted

    def unfinished(self) -> list:
        """Indices of the samples still to continue, in sample order."""
        return [j for j, s in enumerate(self.samples) if s.finish is None]

    def oldest_version(self) -> Optional[int]:
        """Version of the oldest token held (None: no token generated yet, nothing can be stale)."""
        return min((v for s in self.samples for v in s.versions), default=None)

    def num_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.samples)

    def to_state(self) -> dict:
        return asdict(self)

    @classmethod
    def from_state(cls, d: dict) -> "SuspendedGroup":
        return cls(index=int(d["index"]), uid=int(d["uid"]), seed=int(d["seed"]), resumes=int(d["resumes"]),
                   samples=[SampleState(**s) for s in d["samples"]])


def _rows(out: Generation) -> list:
    """(tokens, logprobs, finish) per row of a Generation; finish None for a row cut short by a suspension."""
    rows = []
    n = out.response_mask.sum(-1).long().tolist()
    finished = [True] * len(n) if out.finished is None else out.finished.bool().tolist()
    for b, length in enumerate(n):
        lp = out.logprobs[b, :length].tolist() if out.logprobs is not None else [0.0] * length
        finish = ("length" if bool(out.truncated[b]) else "stop") if finished[b] else None
        rows.append((out.response_ids[b, :length].tolist(), lp, finish))
    return rows


def suspend(out: Generation, version: int, *, index: int, uid: int, seed: int,
            prior: Optional[SuspendedGroup] = None, max_new_tokens: Optional[int] = None) -> SuspendedGroup:
    """The state of a group whose stream was suspended. ``out``: its rows as the engine reported them (all G samples
    of a fresh group; for a resumed ``prior``, one row per sample of ``prior.unfinished()``), tokens drawn by
    weights ``version``. A sample cut short at ``max_new_tokens`` tokens in all counts as finished ("length")."""
    rows = _rows(out)
    if prior is None:
        prior = SuspendedGroup(index=index, uid=uid, seed=seed, samples=[SampleState([], [], []) for _ in rows])
    todo = prior.unfinished()
    if len(todo) != len(rows):
        raise ValueError(f"group {prior.uid}: {len(rows)} continued rows for {len(todo)} unfinished samples")
    samples = list(prior.samples)
    for j, (t, lp, f) in zip(todo, rows):
        old = samples[j]
        samples[j] = SampleState(old.tokens + t, old.logprobs + lp, old.versions + [version] * len(t), f)
    if max_new_tokens is not None:
        samples = [SampleState(s.tokens, s.logprobs, s.versions, "length")
                   if s.finish is None and len(s.tokens) >= max_new_tokens else s for s in samples]
    return SuspendedGroup(index=prior.index, uid=prior.uid, seed=prior.seed, samples=samples, resumes=prior.resumes)


def stamp(out: Generation, version: int) -> Generation:
    """``out`` with every token marked as drawn by weights ``version`` (a group generated in one go)."""
    out.token_version = torch.full_like(out.response_ids, int(version))
    return out


def complete(prior: SuspendedGroup, out: Generation, version: int, pad_id: int) -> Generation:
    """The G full responses of a resumed group: earlier tokens + the continuation rows ``out`` (one per sample of
    ``prior.unfinished()``, drawn by weights ``version``). Right-padded with ``pad_id``; ``token_version`` [G, R]."""
    return assemble(suspend(out, version, index=prior.index, uid=prior.uid, seed=prior.seed, prior=prior), pad_id)


def assemble(done: SuspendedGroup, pad_id: int) -> Generation:
    """The Generation of a group whose samples have all finished (right-padded with ``pad_id``)."""
    if done.unfinished():
        raise ValueError(f"group {done.uid}: samples {done.unfinished()} did not finish")
    width = max((len(s.tokens) for s in done.samples), default=0)
    g = len(done.samples)
    ids = torch.full((g, width), int(pad_id), dtype=torch.long)
    mask, logp = torch.zeros(g, width), torch.zeros(g, width)
    versions = torch.zeros(g, width, dtype=torch.long)
    for j, s in enumerate(done.samples):
        n = len(s.tokens)
        ids[j, :n] = torch.as_tensor(s.tokens, dtype=torch.long)
        mask[j, :n] = 1.0
        logp[j, :n] = torch.as_tensor(s.logprobs, dtype=torch.float32)
        versions[j, :n] = torch.as_tensor(s.versions, dtype=torch.long)
    truncated = torch.as_tensor([s.finish != "stop" for s in done.samples], dtype=torch.bool)
    return Generation(response_ids=ids, response_mask=mask, truncated=truncated, logprobs=logp,
                      token_version=versions)


def continuation_requests(group: SuspendedGroup, prompt: Sequence[int], max_new_tokens: int,
                          round_tokens: Optional[int] = None) -> list:
    """One ``(prompt ids, n=1, max_new_tokens, seed)`` per unfinished sample: prompt + its tokens so far, the
    remaining budget (at most ``round_tokens`` when given: one round of the prompt-order mode), and a seed of its
    own for this resubmission (a resumed run draws the same tokens)."""
    out = []
    for j in group.unfinished():
        s = group.samples[j]
        seed = mix_seed(group.seed, group.resumes + 1, j) % (2 ** 31)
        budget = int(max_new_tokens) - len(s.tokens)
        out.append((list(prompt) + list(s.tokens), 1, budget if round_tokens is None else min(budget, round_tokens),
                    seed))
    return out


def reopen_round_cuts(before: SuspendedGroup, after: SuspendedGroup, max_new_tokens: int) -> SuspendedGroup:
    """``after`` one round (``before`` + what the round drew): a sample that the round's own cap stopped ("length",
    below the generation cap, with tokens drawn in this round) is still to continue. One that drew nothing stays
    finished (the engine had no room left), so rounds always end."""
    samples = [SampleState(a.tokens, a.logprobs, a.versions, None)
               if a.finish == "length" and len(a.tokens) < max_new_tokens and len(a.tokens) > len(b.tokens) else a
               for b, a in zip(before.samples, after.samples)]
    return SuspendedGroup(index=after.index, uid=after.uid, seed=after.seed, samples=samples, resumes=after.resumes)


def split_stale(groups: Sequence[SuspendedGroup], version: int, max_staleness: int) -> tuple:
    """(groups to continue under weights ``version``, groups dropped: continuing them would make a response span
    more than ``max_staleness`` versions). A group whose samples have all finished (overlap: during the update) is
    kept: no weights continue it, its span is final, and it is trained like any group carried over."""
    keep, drop = [], []
    for g in groups:
        oldest = g.oldest_version()
        stale = g.unfinished() and oldest is not None and version - oldest > max_staleness
        (drop if stale else keep).append(g)
    return keep, drop
