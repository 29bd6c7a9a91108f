"""The local trainable policy: a ``transformers`` decoder + AdamW, behind the ``Policy`` protocol (core/types.py).

Log-probs and entropies come from the core fused function applied to the model's final hidden states and the
``lm_head`` weight, so full [B, T, V] logits never exist during training or the old-log-prob pass.

Sequence layout of a :class:`RolloutBatch` row: ``[left pad | prompt | response | right pad]``. Positions count real
tokens only (the sampler uses the same convention), so a token's log-prob does not depend on how much padding its
batch happened to need. The log-prob of response token t is read from the hidden state one position earlier.
"""
from __future__ import annotations

import copy
import logging
import math
from typing import Iterator, Optional

import torch

from nemo_dapo.core.logprobs import fused_logprobs_entropy
from nemo_dapo.core.metrics import combine_metrics
from nemo_dapo.core.types import RolloutBatch
from nemo_dapo.models.decoder import final_hidden

log = logging.getLogger(__name__)


def linear_warmup(warmup_steps: int):
    """LR factor for update s (0-based): (s + 1) / warmup_steps until it reaches 1, then constant."""
    if warmup_steps <= 0:
        return lambda s: 1.0
    return lambda s: min(1.0, (s + 1) / warmup_steps)


def _sequence(batch: RolloutBatch) -> tuple:
    """(input_ids [B, P+R], attention_mask [B, P+R] long) of prompt + response."""
    ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)
    mask = torch.cat([batch.prompt_mask.long(), (batch.response_mask > 0).long()], dim=1)
    return ids, mask


class LocalPolicy:
    """``Policy`` over a ``transformers`` causal LM with ``model.model`` (decoder) and ``model.lm_head``.

    lr / weight_decay / betas / eps: AdamW. grad_clip: max global grad norm (None: no clipping, norm still logged).
    warmup_steps: linear LR warm-up, counted in optimizer updates (the reference counts rollout steps: multiply by
    the updates per rollout step). micro_batch_size: rows per forward/backward (None: the whole mini-batch);
    logprob_batch_size: rows per no-grad pass of :meth:`logprobs` (None: micro_batch_size).
    chunk_size: tokens per chunk of the fused log-prob/entropy. temperature: the sampling temperature of the
    rollouts; log-probs and entropy are those of ``logits / temperature``, the distribution the samples came from
    (as the sampler's and the engines' log-probs are).
    """

    def __init__(self, model, *, lr: float = 1e-3, weight_decay: float = 0.0, betas=(0.9, 0.999), eps: float = 1e-8,
                 grad_clip: Optional[float] = 1.0, warmup_steps: int = 0, micro_batch_size: Optional[int] = None,
                 logprob_batch_size: Optional[int] = None, chunk_size: int = 1024, temperature: float = 1.0):
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1 or None, got {micro_batch_size}")
        self.model = model
        self.grad_clip = grad_clip
        self.micro_batch_size = micro_batch_size
        self.logprob_batch_size = logprob_batch_size or micro_batch_size
        self.chunk_size = chunk_size
        self.temperature = float(temperature)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=tuple(betas), eps=eps,
                                           weight_decay=weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, linear_warmup(warmup_steps))
        self.num_updates = 0
        self.num_skipped = 0

    # --- forward --------------------------------------------------------------------------------------------
    def forward_logprobs(self, batch: RolloutBatch) -> tuple:
        """(logp [B, R], entropy [B, R]) fp32 WITH grad; 0 on response padding."""
        ids, mask = _sequence(batch)
        P, R = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
        if R == 0:
            z = torch.zeros(ids.shape[0], 0)
            return z, z.clone()
        if P == 0:
            raise ValueError("RolloutBatch has no prompt column: the first response token needs a prompt (BOS)")
        hidden = final_hidden(self.model, ids, mask)[:, P - 1:P + R - 1]
        return fused_logprobs_entropy(hidden, self.model.lm_head.weight, batch.response_ids,
                                      mask=batch.response_mask > 0, chunk_size=self.chunk_size,
                                      temperature=self.temperature)

    def _chunks(self, batch: RolloutBatch, size: Optional[int]) -> Iterator[RolloutBatch]:
        n = len(batch)
        size = size or max(n, 1)
        for start in range(0, n, size):
            yield batch.select(slice(start, min(start + size, n))).trim()

    @torch.no_grad()
    def logprobs(self, batch: RolloutBatch) -> tuple:
        """(log-prob [B, R], entropy [B, R]) without grad, aligned with ``batch.response_ids``; 0 on padding."""
        was_training = self.model.training
        self.model.eval()
        B, R = batch.response_ids.shape
        logp, ent = torch.zeros(B, R), torch.zeros(B, R)
        try:
            row = 0
            for mb in self._chunks(batch, self.logprob_batch_size):
                lp, en = self.forward_logprobs(mb)
                logp[row:row + len(mb), :lp.shape[1]] = lp
                ent[row:row + len(mb), :en.shape[1]] = en
                row += len(mb)
        finally:
            self.model.train(was_training)
        return logp, ent

    # --- update ---------------------------------------------------------------------------------------------
    def accumulate_gradients(self, minibatch: RolloutBatch, norm: float, loss_fn) -> tuple:
        """Forward/backward over micro-batches, summing the gradients (no optimizer step).

        Returns (metrics, finite): metrics combined over micro-batches (``METRIC_REDUCTION``; ``loss`` is the sum of
        the micro-batch losses, i.e. the mini-batch loss); finite=False as soon as a micro-batch loss is not finite
        (its backward is not run).
        """
        per_mb = []
        for mb in self._chunks(minibatch, self.micro_batch_size):
            logp, ent = self.forward_logprobs(mb)
            loss, metrics = loss_fn(logp, ent, mb, norm)
            if not bool(torch.isfinite(loss.detach()).all()):
                return {"loss": float(loss.detach())}, False
            if loss.requires_grad:
                loss.backward()
            per_mb.append({**metrics, "loss": loss})
        return (combine_metrics(per_mb) if per_mb else {"loss": 0.0}), True

    def train_step(self, minibatch: RolloutBatch, *, norm: float, loss_fn) -> dict:
        """One AdamW update on ``minibatch`` (see ``Policy.train_step``); a non-finite loss or gradient norm skips
        the update (weights, optimizer and schedule untouched) and reports ``skipped=1``."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        metrics, finite = self.accumulate_gradients(minibatch, norm, loss_fn)
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.grad_clip if self.grad_clip is not None else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params and finite else 0.0
        skipped = not finite or not math.isfinite(grad_norm)
        if skipped:
            self.num_skipped += 1
            log.warning("skipping optimizer update %d: non-finite %s (loss=%s, grad_norm=%s); weights unchanged",
                        self.num_updates, "loss" if not finite else "gradient", metrics["loss"], grad_norm)
        else:
            self.optimizer.step()
            self.scheduler.step()
            self.num_updates += 1
        self.optimizer.zero_grad(set_to_none=True)
        metrics.update(grad_norm=grad_norm, lr=lr, skipped=float(skipped))
        return metrics

    # --- state ----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Copies (not views) of model, optimizer and scheduler state, plus update counters."""
        return copy.deepcopy({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                              "scheduler": self.scheduler.state_dict(), "num_updates": self.num_updates,
                              "num_skipped": self.num_skipped})

    def load_state_dict(self, state: dict) -> None:
        missing = {"model", "optimizer", "scheduler"} - set(state)
        if missing:
            raise KeyError(f"policy state lacks {sorted(missing)}; pass a dict from LocalPolicy.state_dict()")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.num_updates = int(state.get("num_updates", 0))
        self.num_skipped = int(state.get("num_skipped", 0))
