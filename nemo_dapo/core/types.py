"""Data containers and the small Protocols the step loop is written against.

Layout conventions (shared by every backend):
  * ``prompt_ids``    LongTensor [B, P], LEFT-padded with ``pad_id``; ``prompt_mask`` [B, P] is 1 on real tokens.
  * ``response_ids``  LongTensor [B, R], RIGHT-padded; ``response_mask`` [B, R] float, 1 on generated tokens
    including the EOS token when one was produced, 0 on padding.
  * Per-token quantities of the response (log-probs, entropies, advantages broadcast) are [B, R] and aligned with
    ``response_ids``: entry [b, t] belongs to the token ``response_ids[b, t]``.
  * ``group_ids`` LongTensor [B]: an explicit id per prompt draw, shared by the G responses of that draw.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Optional, Protocol, Sequence, runtime_checkable

import torch


def _pad_right(t: torch.Tensor, width: int, value) -> torch.Tensor:
    if t.shape[1] == width:
        return t
    pad = t.new_full((t.shape[0], width - t.shape[1]) + tuple(t.shape[2:]), value)
    return torch.cat([t, pad], dim=1)


def _pad_left(t: torch.Tensor, width: int, value) -> torch.Tensor:
    if t.shape[1] == width:
        return t
    pad = t.new_full((t.shape[0], width - t.shape[1]) + tuple(t.shape[2:]), value)
    return torch.cat([pad, t], dim=1)


# Fields padded on the left (prompt side) / right (response side) when batches of different widths are joined.
_LEFT = {"prompt_ids", "prompt_mask"}
_RIGHT = {"response_ids", "response_mask", "old_logp", "engine_logp", "token_version"}


@dataclass
class RolloutBatch:
    """B samples (prompt + one response each). Optional fields are filled in as the step proceeds."""

    prompt_ids: torch.Tensor  # [B, P] long, left-padded
    prompt_mask: torch.Tensor  # [B, P] long/bool
    response_ids: torch.Tensor  # [B, R] long, right-padded
    response_mask: torch.Tensor  # [B, R] float
    group_ids: torch.Tensor  # [B] long
    truncated: torch.Tensor  # [B] bool: hit the generation cap without EOS
    engine_logp: Optional[torch.Tensor] = None  # [B, R] sampling log-probs reported by the generator
    old_logp: Optional[torch.Tensor] = None  # [B, R] recomputed by the trainer before the update
    rewards: Optional[torch.Tensor] = None  # [B] shaped reward (correctness + overlong)
    acc: Optional[torch.Tensor] = None  # [B] float 0/1, unshaped correctness
    advantages: Optional[torch.Tensor] = None  # [B]
    pad_id: int = 0
    extras: dict = field(default_factory=dict)  # non-tensor per-batch info (e.g. texts); not joined by cat()
    # [B, R] long: the generator's weight version that sampled each token (partial rollouts, core/partial.py)
    token_version: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    @property
    def lengths(self) -> torch.Tensor:
        """[B] response length in tokens, EOS included."""
        return self.response_mask.sum(-1).long()

    def num_tokens(self) -> int:
        return int(self.response_mask.sum().item())

    def _tensor_fields(self):
        return [f.name for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)]

    def select(self, index) -> "RolloutBatch":
        """Rows by index (LongTensor, list or slice); padding width is kept."""
        if isinstance(index, list):
            index = torch.as_tensor(index, dtype=torch.long)
        kw = {n: getattr(self, n)[index] for n in self._tensor_fields()}
        return replace(self, **kw, extras={})

    def trim(self) -> "RolloutBatch":
        """Drop all-padding columns (left of the prompts, right of the responses)."""
        p = int(self.prompt_mask.sum(-1).max().item()) if len(self) else 0
        r = int(self.response_mask.sum(-1).max().item()) if len(self) else 0
        kw = {}
        for n in self._tensor_fields():
            t = getattr(self, n)
            if n in _LEFT:
                kw[n] = t[:, t.shape[1] - p:]
            elif n in _RIGHT:
                kw[n] = t[:, :r]
        return replace(self, **kw)

    @staticmethod
    def cat(batches: Sequence["RolloutBatch"]) -> "RolloutBatch":
        """Concatenate along the batch dim, re-padding prompts on the left and responses on the right."""
        if not batches:
            raise ValueError("RolloutBatch.cat needs at least one batch")
        first = batches[0]
        out = {}
        for f in fields(first):
            vals = [getattr(b, f.name) for b in batches]
            if not isinstance(vals[0], torch.Tensor):
                continue
            if any(v is None for v in vals):
                continue
            if f.name in _LEFT or f.name in _RIGHT:
                width = max(v.shape[1] for v in vals)
                pad_val = first.pad_id if f.name in ("prompt_ids", "response_ids") else 0
                pad = _pad_left if f.name in _LEFT else _pad_right
                vals = [pad(v, width, pad_val) for v in vals]
            out[f.name] = torch.cat(vals, dim=0)
        for f in fields(first):
            if isinstance(getattr(first, f.name), torch.Tensor) and f.name not in out:
                out[f.name] = None
        return replace(first, **out, extras={})


@dataclass
class Generation:
    """What a Generator returns for B requests (B = prompts x group_size, in request order)."""

    response_ids: torch.Tensor  # [B, R] long, right-padded with pad_id
    response_mask: torch.Tensor  # [B, R] float, EOS included
    truncated: torch.Tensor  # [B] bool
    logprobs: Optional[torch.Tensor] = None  # [B, R] sampling log-probs (engine side), 0 on padding
    # [B] bool: False for a sample cut short by an abort / suspension (its tokens so far); None = all finished
    finished: Optional[torch.Tensor] = None
    token_version: Optional[torch.Tensor] = None  # [B, R] long: weight version that sampled each token

    @staticmethod
    def cat(parts: Sequence["Generation"], pad_id: int) -> "Generation":
        """Row-wise concatenation, responses right-padded to the widest part (an optional field is kept only if all
        parts have it)."""
        if not parts:
            raise ValueError("Generation.cat needs at least one part")
        width = max(p.response_ids.shape[1] for p in parts)
        logprobs = versions = finished = None
        if all(p.logprobs is not None for p in parts):
            logprobs = torch.cat([_pad_right(p.logprobs, width, 0.0) for p in parts])
        if all(p.token_version is not None for p in parts):
            versions = torch.cat([_pad_right(p.token_version, width, 0) for p in parts])
        if all(p.finished is not None for p in parts):
            finished = torch.cat([p.finished for p in parts])
        return Generation(response_ids=torch.cat([_pad_right(p.response_ids, width, pad_id) for p in parts]),
                          response_mask=torch.cat([_pad_right(p.response_mask, width, 0.0) for p in parts]),
                          truncated=torch.cat([p.truncated for p in parts]), logprobs=logprobs, finished=finished,
                          token_version=versions)


@runtime_checkable
class Generator(Protocol):
    """Samples responses. ``prompt_ids``/``prompt_mask`` [B, P] left-padded; one response per row."""

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, max_new_tokens: int,
                 temperature: float = 1.0, top_p: float = 1.0, seed: Optional[int] = None) -> Generation: ...

    def update_weights(self, policy: "Policy") -> None:
        """Refit the generator from the policy's current weights (a no-op when they share the module)."""
        ...


@runtime_checkable
class Policy(Protocol):
    """The trainable model. Log-probs are of the response tokens, [B, R], aligned with ``response_ids``."""

    def logprobs(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-prob [B, R], entropy [B, R]) without grad; padding positions are 0."""
        ...

    def train_step(self, minibatch: RolloutBatch, *, norm: float, loss_fn: "LossFn") -> dict:
        """One optimizer update on this rank's share of a mini-batch.

        ``norm`` is the GLOBAL normaliser of ``loss_fn`` for the mini-batch (the sum of
        ``loss_fn.normalizer`` over all micro-batches and ranks; see LossFn); for each micro-batch
        ``loss_fn(logp, entropy, LossInput.of(microbatch), norm) -> (loss, metrics)`` returns its
        contribution so that summing over micro-batches and ranks gives the mini-batch loss.
        Returns metrics including ``grad_norm`` and ``skipped`` (1.0 when a non-finite loss/grad skipped it).
        """
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass(frozen=True)
class LossInput:
    """What the policy loss reads besides the policy's own log-probs, for B rows of T per-token positions.

    Every per-token tensor is [B, T] and aligned with the ``logp`` / ``entropy`` the loss is called with (entry
    [b, t] of each belongs to the same token). T is the response width R in the core layout (:meth:`of`), or the
    S - 1 shifted positions of a packed prompt + response row (the actor's layout, nemo_dapo/megatron/layout.py).
    ``mask`` is 1 exactly on the response tokens (EOS included) and 0 on prompt and padding positions; values at
    mask-0 positions may be anything (the loss selects them away, it never multiplies by them).

      old_logp     [B, T] float  log pi_old of the tokens, recomputed by the trainer before the update
      advantages   [B] float (broadcast over the row's tokens) or [B, T]
      mask         [B, T] float  1 on response tokens
      truncated    [B] bool      the response hit the generation cap without EOS (overlong filtering reads it)
      engine_logp  [B, T] float  the generator's sampling log-probs, or None (truncated IS and the mismatch metric)
    """

    old_logp: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    truncated: torch.Tensor
    engine_logp: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return self.mask.shape[0]

    @staticmethod
    def of(batch: RolloutBatch) -> "LossInput":
        """The loss input of a core-layout batch (T = R); the step must have filled ``old_logp`` and
        ``advantages``."""
        for name in ("old_logp", "advantages"):
            if getattr(batch, name) is None:
                raise ValueError(f"the micro-batch has no {name}; the step must fill RolloutBatch.{name} before "
                                 "the update")
        return LossInput(old_logp=batch.old_logp, advantages=batch.advantages, mask=batch.response_mask.float(),
                         truncated=batch.truncated.bool(), engine_logp=batch.engine_logp)


@runtime_checkable
class LossFn(Protocol):
    """The policy loss of one micro-batch, split-invariant through a GLOBAL normaliser (core/loss.py DAPOLossFn).

    ``normalizer(inputs)`` is the micro-batch's share (0-dim float) of the normaliser; ``norm`` is the sum of those
    shares over every micro-batch and data-parallel rank of the optimizer step (valid tokens after overlong
    filtering for token-mean, sequences with a valid token for the seq-* modes; see core/loss.py). The call
    returns (this micro-batch's share of the mini-batch loss, metrics combined by core/loss.METRIC_REDUCTION).
    ``tis_cap``: the truncated importance-sampling cap, or None; when set, ``inputs.engine_logp`` is required.
    """

    @property
    def tis_cap(self) -> Optional[float]: ...

    def normalizer(self, inputs: LossInput) -> torch.Tensor: ...

    def __call__(self, logp: torch.Tensor, entropy: Optional[torch.Tensor], inputs: LossInput,
                 norm) -> tuple: ...


@runtime_checkable
class RewardFn(Protocol):
    """Scores B responses. Returns (score [B] float, acc [B] float 0/1, preds list[str])."""

    def __call__(self, response_ids: torch.Tensor, response_mask: torch.Tensor,
                 ground_truths: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor, list]: ...


class Reducer(Protocol):
    """Collectives over data-parallel ranks; identity on one process."""

    rank: int
    world_size: int

    def sum(self, x: torch.Tensor) -> torch.Tensor: ...

    def max(self, x: torch.Tensor) -> torch.Tensor: ...

    def gather_objects(self, obj: Any) -> list: ...


class LocalReducer:
    """Single process: every reduction is the identity."""

    rank = 0
    world_size = 1

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def max(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_objects(self, obj: Any) -> list:
        return [obj]
