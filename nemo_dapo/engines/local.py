"""``LocalEngine``: a continuous-batching ``EngineAdapter`` over a small ``transformers`` causal LM (Llama / Qwen2
layout: ``model.model`` decoder + ``model.lm_head``), in the server's process, on the model's device.

Layout. ``max_batch_size`` slots; live sequences are rows ``[0, L)`` of one preallocated KV cache per layer,
``[slots, kv_heads, capacity, head_dim]`` (``nemo_dapo.models.kv_cache``). All rows share a column cursor ``c``: row b
owns the contiguous columns ``[start_b, c)`` (its prompt, then its generated tokens but the last, which is "pending":
sampled, not yet fed) and a decode step writes every row's pending token at column c. The attention mask over columns
``[min start, c]`` is ``column >= start_b``; positions count real tokens (prompt token 0 has position 0, as in
``position_ids_from_mask``), so where a row sits in the cache does not change its output. Requests wait in a FIFO of
sequences (a request of n samples is n sequences); free slots are refilled from the queue once ``refill_min`` are
free: the new prompts are prefilled among themselves (left-padded, each distinct prompt once), their K/V copied into
columns ``[c - p, c)`` of the free rows, and their first token sampled; then they decode with the rest. A finished
row is replaced by the last row (one row copy), so a decode step always runs on exactly the L live rows. When c
reaches the capacity the live window is shifted to column 0 (one copy; the capacity grows by doubling up to ``2 *
max_seq_len`` so that shifts stay rare).

Randomness: sample k of a request has its own stream, a ``random.Random`` seeded with ``mix_seed(request.seed, k)``
(an unseeded request takes its seed from torch's global RNG when added); each token is one uniform draw from it,
turned into a token by inverse CDF over the row's sampling distribution. So a seeded sample does not depend on what
else runs, up to floating-point round-off (a row's logits can differ in the last bits with the batch around it). A
Python RNG rather than one ``torch.Generator`` per row: a per-row ``torch.multinomial`` cost ~80 us a row per step.
"""
from __future__ import annotations

import collections
import contextlib
import random
from typing import Iterable, Optional, Sequence

import torch

from nemo_dapo.core.loop_data import mix_seed
from nemo_dapo.core.sampling import inverse_cdf, sample_next, sampling_logp
from nemo_dapo.engines.base import WAKE_TAGS, Completion, EngineError, Request, Sample, check_weight


class _Job:
    """One request: its sequences (index k = sample k) and the finished samples so far."""

    def __init__(self, request: Request, max_seq_len: int, eos_id: int):
        self.request = request
        self.samples: list = [None] * request.n
        self.left = request.n
        self.budget = min(request.max_new_tokens, max_seq_len - len(request.prompt_ids))
        # ignore_eos as in vLLM: the model's EOS does not end a sample, stop_token_ids still do
        self.stops = frozenset(request.stop_token_ids) | (frozenset() if request.ignore_eos else {eos_id})
        self.key = (float(request.temperature), float(request.top_p), int(request.top_k))
        seed = request.seed
        if seed is None and request.temperature > 0:
            seed = int(torch.randint(0, 2 ** 62, (1,)).item())
        self.seqs = [_Seq(self, k, None if request.temperature == 0 else mix_seed(int(seed), k))
                     for k in range(request.n)]


class _Seq:
    __slots__ = ("job", "k", "rng", "tokens", "logps")

    def __init__(self, job: _Job, k: int, seed: Optional[int]):
        self.job, self.k, self.tokens, self.logps = job, k, [], []
        self.rng = None if seed is None else random.Random(seed)

    def sample(self, reason: str) -> Sample:
        return Sample(list(self.tokens), list(self.logps) if self.job.request.logprobs else None, reason)


class LocalEngine:
    """See the module docstring. ``max_seq_len`` (default ``config.max_position_embeddings``) bounds prompt +
    response: a longer prompt is refused by ``add``, a budget past it is cut (finish ``length``)."""

    def __init__(self, model, *, eos_id: int, pad_id: int, max_batch_size: int = 64, max_seq_len: Optional[int] = None,
                 steps_per_call: int = 4, refill_min: Optional[int] = None, name: str = "local"):
        self.model, self.name = model, name
        # Free slots are refilled once this many are free (or the queue is shorter): each refill is a prefill
        # forward of its own; refilling one slot at a time made in-flight decoding ~1.3x slower on CPU
        # (benchmarks/rollout_engine.py).
        self.refill_min = max(1, int(refill_min if refill_min is not None else max_batch_size // 8))
        self.eos_id, self.pad_id = int(eos_id), int(pad_id)
        self.max_batch_size, self.steps_per_call = int(max_batch_size), int(steps_per_call)
        self.max_seq_len = int(max_seq_len or model.config.max_position_embeddings)
        if self.max_batch_size < 1 or self.steps_per_call < 1 or self.max_seq_len < 2:
            raise ValueError(f"engine {name!r}: need max_batch_size >= 1, steps_per_call >= 1, max_seq_len >= 2")
        self.device = next(model.parameters()).device
        S, long = self.max_batch_size, dict(dtype=torch.long, device=self.device)
        self._start, self._pos, self._pending = torch.zeros(S, **long), torch.zeros(S, **long), torch.zeros(S, **long)
        self._queue: collections.deque = collections.deque()  # _Seq waiting for a slot, FIFO
        self._jobs: dict = {}  # id -> _Job, queued or running
        self._rows: list = []  # live _Seq; row i <-> cache slot i
        self._cache, self._c, self._asleep = None, 0, False

    @classmethod
    def from_path(cls, model_dir, *, device=None, **kw) -> "LocalEngine":
        """An engine over a directory written by ``save_pretrained``; eos / pad ids default to the model config's
        (a list of eos ids: the first)."""
        from nemo_dapo.models.decoder import load_model

        model = load_model(model_dir)
        if device is not None:
            model = model.to(device)
        eos = kw.pop("eos_id", None)
        eos = model.config.eos_token_id if eos is None else eos
        eos = eos[0] if isinstance(eos, (list, tuple)) else eos
        pad = next((p for p in (kw.pop("pad_id", None), model.config.pad_token_id, eos) if p is not None))
        return cls(model, eos_id=eos, pad_id=pad, **kw)

    def info(self) -> dict:
        cfg = self.model.config
        return dict(model=getattr(cfg, "_name_or_path", "") or type(self.model).__name__, vocab_size=cfg.vocab_size,
                    max_batch_size=self.max_batch_size, eos_id=self.eos_id, max_seq_len=self.max_seq_len,
                    sleep_releases={"1": ["kv_cache"], "2": ["kv_cache"]}, wake_tags=list(WAKE_TAGS))

    def add(self, request: Request) -> None:
        if request.id in self._jobs:
            raise ValueError(f"engine {self.name!r}: request id {request.id!r} is already queued or running")
        if len(request.prompt_ids) >= self.max_seq_len:
            raise ValueError(f"engine {self.name!r}: request {request.id}: prompt of {len(request.prompt_ids)} "
                             f"tokens leaves no room under max_seq_len {self.max_seq_len}")
        job = self._jobs[request.id] = _Job(request, self.max_seq_len, self.eos_id)
        self._queue.extend(job.seqs)

    def has_work(self) -> bool:
        return bool(self._queue or self._rows)

    def step(self) -> list:
        """Up to ``steps_per_call`` decode steps, refilling free slots before each; returns finished Completions."""
        if self._asleep:
            raise EngineError(f"engine {self.name!r} is asleep: call wake() before stepping")
        done: list = []
        with self._inference():
            for _ in range(self.steps_per_call):
                self._admit(done)
                if self._rows:
                    self._decode(done)
                elif not self._queue:
                    break
        return done

    def abort(self, ids: Sequence[str]) -> list:
        out = []
        for rid in dict.fromkeys(ids):
            job = self._jobs.pop(rid, None)
            if job is None:
                continue  # unknown or already returned
            for i in reversed([i for i, s in enumerate(self._rows) if s.job is job]):
                self._drop_row(i)
            self._queue = collections.deque(s for s in self._queue if s.job is not job)
            out.append(Completion(rid, [job.samples[s.k] or s.sample("aborted") for s in job.seqs]))
        return out

    def load_weights(self, named: Iterable[tuple]) -> None:
        """Check the whole bucket first (a rejected bucket changes nothing), then copy in place."""
        named, state = list(named), self.model.state_dict()
        for name, tensor in named:
            check_weight(name, tensor, state.get(name), self.name)
        with torch.no_grad():
            for name, tensor in named:
                state[name].copy_(tensor)

    def finish_weights(self) -> None:
        """Nothing to post-process (no fused or quantised copies, no prefix cache). Running rows keep the K/V they
        computed under the old weights, as in other in-flight engines."""

    def sleep(self, level: int) -> None:
        """Free the KV cache (any level >= 1). Level 2 frees nothing more: the weights stay where they are (on CPU
        there is nothing to gain); queued requests stay queued."""
        if self._rows:
            raise EngineError(f"engine {self.name!r}: sleep with {len(self._rows)} running sequences; abort them "
                              "first")
        if level >= 1:
            self._cache, self._c = None, 0
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self._asleep = True

    def wake(self, tags=None) -> None:
        if tags is None:
            self._asleep = False  # the cache is reallocated by the next prefill; the weights never left

    def close(self) -> None:
        self._queue.clear()
        self._jobs.clear()
        self._rows.clear()
        self._cache, self._c = None, 0

    # ---- internals ------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _inference(self):
        was_training = self.model.training  # the model may be the trainer's own module: restore its mode
        self.model.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            self.model.train(was_training)

    def _admit(self, done: list) -> None:
        free = self.max_batch_size - len(self._rows)
        if free == 0 or not self._queue or (self._rows and free < min(self.refill_min, len(self._queue))):
            return
        from nemo_dapo.models.decoder import position_ids_from_mask
        from nemo_dapo.models.kv_cache import InPlaceCache

        new = [self._queue.popleft() for _ in range(min(free, len(self._queue)))]
        jobs = list(dict.fromkeys(s.job for s in new))  # each distinct prompt is prefilled once
        which = torch.tensor([jobs.index(s.job) for s in new], device=self.device)
        lens = [len(j.request.prompt_ids) for j in jobs]
        P = max(lens)
        ids = torch.full((len(jobs), P), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(jobs), P, dtype=torch.long)
        for u, j in enumerate(jobs):
            ids[u, P - lens[u]:] = torch.tensor(j.request.prompt_ids)
            mask[u, P - lens[u]:] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        tmp = InPlaceCache(capacity=P)
        out = self.model.model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                               past_key_values=tmp, use_cache=True)
        logits = self.model.lm_head(out.last_hidden_state[:, -1]).float()[which]
        if self._cache is None:  # first prefill (or after sleep): slot buffers shaped like the prefill's K/V
            self._cache = InPlaceCache.like(tmp, batch=self.max_batch_size, capacity=self._capacity_for(P))
        self._make_room(P)
        L, c, n = len(self._rows), self._c, len(new)
        for t, buf in zip(tmp.keys + tmp.values, self._cache.keys + self._cache.values):
            buf[L:L + n, :, c - P:c] = t[which]  # right-aligned prompts: the padding lands left of start_b
        plen = torch.tensor(lens, device=self.device)[which]
        self._start[L:L + n], self._pos[L:L + n] = c - plen, plen
        self._rows.extend(new)
        self._emit(L, logits, done)

    def _decode(self, done: list) -> None:
        if self._c >= self._cache.keys[0].shape[2]:
            self._make_room(0)
        L, c = len(self._rows), self._c
        lo = int(self._start[:L].min())
        self._cache.set_window(L, lo, c)  # rows [0, L) write column c, attend to columns [lo, c]
        mask = (torch.arange(lo, c + 1, device=self.device)[None, :] >= self._start[:L, None]).long()
        out = self.model.model(input_ids=self._pending[:L, None], attention_mask=mask,
                               position_ids=self._pos[:L, None], past_key_values=self._cache, use_cache=True)
        self._c, self._pos[:L] = c + 1, self._pos[:L] + 1
        self._emit(0, self.model.lm_head(out.last_hidden_state[:, -1]).float(), done)

    def _emit(self, first: int, logits: torch.Tensor, done: list) -> None:
        """Sample the next token of rows [first, L) from ``logits`` [L - first, V]; retire the rows that finish."""
        seqs = self._rows[first:]
        tok, lp = self._sample(logits, seqs)
        self._pending[first:first + len(seqs)] = tok
        finished = []
        for i, (s, t, l) in enumerate(zip(seqs, tok.tolist(), lp.tolist())):
            s.tokens.append(t)
            s.logps.append(l)
            job = s.job
            if t in job.stops or len(s.tokens) >= job.budget:
                finished.append(first + i)
                job.samples[s.k] = s.sample("stop" if t in job.stops else "length")
                job.left -= 1
                if job.left == 0:
                    del self._jobs[job.request.id]
                    done.append(Completion(job.request.id, job.samples))
        for i in reversed(finished):
            self._drop_row(i)

    def _sample(self, logits: torch.Tensor, seqs: list):
        """Rows grouped by (temperature, top_p, top_k); the distribution is computed per group, the draw per row with
        that sequence's stream. Greedy reports the model's (temperature 1) log-prob, as ``sample_next`` does."""
        groups: dict = {}
        for i, s in enumerate(seqs):
            groups.setdefault(s.job.key, []).append(i)
        tok = torch.empty(len(seqs), dtype=torch.long, device=self.device)
        lp = torch.empty(len(seqs), device=self.device)
        for (temperature, top_p, top_k), idx in groups.items():
            x = logits if len(idx) == len(seqs) else logits[idx]
            if temperature == 0:
                t, l = sample_next(x, 0.0, 1.0, None)
            else:
                logp = sampling_logp(x, temperature, top_p, top_k)
                u = torch.tensor([seqs[i].rng.random() for i in idx], dtype=torch.float64, device=self.device)
                t = inverse_cdf(logp, u)
                l = logp.gather(1, t[:, None]).squeeze(1)
            tok[idx], lp[idx] = t, l
        return tok, lp

    def _drop_row(self, i: int) -> None:
        """Retire row i: the last row moves into its slot (its span only), so the live rows stay [0, L)."""
        last = len(self._rows) - 1
        if i != last:
            a, c = int(self._start[last]), self._c
            for buf in self._cache.keys + self._cache.values:
                buf[i, :, a:c] = buf[last, :, a:c]
            for t in (self._start, self._pos, self._pending):
                t[i] = t[last]
            self._rows[i] = self._rows[last]
        self._rows.pop()

    def _capacity_for(self, cols: int) -> int:
        """Room for ``cols`` columns with as much again to spare (so that shifts are rare), at most 2 * max_seq_len."""
        cap = 128
        while cap < 2 * cols:
            cap *= 2
        return min(cap, 2 * self.max_seq_len)

    def _make_room(self, need_left: int) -> None:
        """Move the live window so that c >= need_left (the prompt columns of new rows) and c < capacity (a free
        column for the next token). Live spans are < max_seq_len, so 2 * max_seq_len columns always suffice."""
        L, c, cap = len(self._rows), self._c, self._cache.keys[0].shape[2]
        if L and need_left <= c < cap:
            return
        lo = int(self._start[:L].min()) if L else c  # no live rows: an empty window, c restarts at need_left
        width = c - lo
        new_lo = max(0, need_left - width)
        new_cap = max(cap, self._capacity_for(new_lo + width + 1))
        for layer in self._cache.layers:
            for name in ("keys", "values"):
                buf = getattr(layer, name)
                window = buf[:L, :, lo:c].clone()  # source and target may overlap
                if new_cap != buf.shape[2]:
                    # zeros, not new_empty: masked columns still enter q.k and p.v, and 0 * a NaN left in
                    # uninitialised memory is NaN (the output then depended on what the allocator handed back)
                    buf = buf.new_zeros(buf.shape[0], buf.shape[1], new_cap, buf.shape[3])
                    setattr(layer, name, buf)
                buf[:L, :, new_lo:new_lo + width] = window
        self._start[:L] += new_lo - lo
        self._c = new_lo + width
