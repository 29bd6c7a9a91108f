"""The ``Generator`` of core/types.py over an engine server, plus the group stream the step loop consumes.

Requests are per prompt group: n = G samples of one prompt share one request (engines share the prompt's KV), and a
group comes back when all G samples are done. ``generate`` (batch mode) waits for everything; ``stream`` yields the
groups in the order they finish, and ``GroupStream.abort`` stops the ones still running. Partial rollouts
(core/partial.py): ``stream_requests`` takes explicit requests per group (a resumed group is one request per
unfinished sample: prompt + its tokens so far), and ``GroupStream.suspend`` stops the running groups and returns
what their samples generated so far, with log-probs.

Seeds: request k of a call seeded with s uses seed ``mix_seed(s, k)``; the engine derives sample j's stream from
(request seed, j), so results do not depend on what else the engine runs.
"""
from __future__ import annotations

import itertools
import time
from typing import Iterator, Optional

import torch

from nemo_dapo.core.loop_data import mix_seed
from nemo_dapo.core.types import Generation
from nemo_dapo.engines.base import EngineError, EngineWeightError, Request
from nemo_dapo.engines.client import EngineClient
from nemo_dapo.engines.weight_group import check_transport, update_over_group


def weight_buckets(policy, bucket_bytes: int) -> Iterator[list]:
    """(HF name, tensor) buckets of the policy's current weights, each <= bucket_bytes (a bigger tensor alone).

    A policy that knows its own Hugging Face naming (the Megatron policy, which gathers over TP/PP/EP) provides
    ``hf_weight_buckets(bucket_bytes)``; otherwise its ``model.state_dict()`` is taken to be in HF names already
    (the local ``transformers`` policy)."""
    own = getattr(policy, "hf_weight_buckets", None)
    if own is not None:
        yield from own(bucket_bytes)
        return
    model = getattr(policy, "model", policy)
    bucket, size = [], 0
    for name, t in model.state_dict().items():
        n = t.numel() * t.element_size()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


def _unpad(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list:
    return [row[mask.bool()].tolist() for row, mask in zip(prompt_ids, prompt_mask)]


def completions_to_generation(completions: list, pad_id: int) -> Generation:
    """Rows in the order given (samples of each completion in index order), right-padded with ``pad_id``."""
    samples = [s for c in completions for s in c.samples]
    width = max((len(s.token_ids) for s in samples), default=0)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    logp = torch.zeros(len(samples), width)
    mask = torch.zeros(len(samples), width)
    for i, s in enumerate(samples):
        n = len(s.token_ids)
        ids[i, :n] = torch.as_tensor(s.token_ids, dtype=torch.long)
        mask[i, :n] = 1.0
        if s.logprobs is not None:
            logp[i, :n] = torch.as_tensor(s.logprobs, dtype=torch.float32)
    truncated = torch.as_tensor([s.finish_reason != "stop" for s in samples], dtype=torch.bool)
    finished = torch.as_tensor([s.finish_reason != "aborted" for s in samples], dtype=torch.bool)
    return Generation(response_ids=ids, response_mask=mask, truncated=truncated, logprobs=logp, finished=finished)


class GroupStream:
    """Iterates ``(k, Generation of the samples of group k)`` as groups finish; ``abort()`` / ``suspend()`` stop the
    rest. Group k is one request (its n samples) or, with ``group_of``, several (their samples in request order).

    ``generated_tokens`` counts every token the engine produced for this stream, the aborted partial samples
    included; ``aborted_tokens`` only those (``suspend`` keeps them: they are not counted as aborted)."""

    def __init__(self, client: EngineClient, ids: list, pad_id: int, group_of: Optional[list] = None):
        self.client, self.pad_id = client, pad_id
        self._index: dict = {}
        self._members: dict = {}
        self._pending: set = set()
        self._held: dict = {}  # rid -> Completion of a group whose other requests still run
        self.generated_tokens = 0
        self.aborted_tokens = 0
        self.aborted_requests = 0
        self.add(ids, list(range(len(ids))) if group_of is None else group_of)

    def add(self, ids: list, group_of: list) -> None:
        """Requests ``ids`` (already submitted) joining this stream, request k in group ``group_of[k]``."""
        for rid, k in zip(ids, group_of):
            self._index[rid] = k
            self._members.setdefault(k, []).append(rid)
        self._pending.update(ids)

    @property
    def done(self) -> bool:
        return not self._pending

    def __iter__(self):
        while self._pending:
            c = self.client.next_completion()
            if c.id not in self._pending:
                continue  # a late completion of an earlier, aborted stream
            self._pending.discard(c.id)
            self.generated_tokens += c.num_tokens
            k = self._index[c.id]
            members = self._members[k]
            if len(members) == 1:
                yield k, completions_to_generation([c], self.pad_id)
                continue
            self._held[c.id] = c
            if all(r in self._held for r in members):
                yield k, completions_to_generation([self._held.pop(r) for r in members], self.pad_id)

    def _stop(self) -> dict:
        """Abort every request still running; their (partial) completions, by id."""
        got: dict = {}
        if not self._pending:
            return got
        self.client.abort(sorted(self._pending))
        while self._pending:
            c = self.client.next_completion()
            if c.id in self._pending:
                self._pending.discard(c.id)
                self.generated_tokens += c.num_tokens
                got[c.id] = c
        return got

    def abort(self) -> None:
        """Abort every request still running and collect their (partial) completions."""
        got = self._stop()
        held, self._held = self._held, {}
        for c in list(got.values()) + list(held.values()):
            self.aborted_tokens += c.num_tokens
        self.aborted_requests += len(got)

    def suspend(self) -> dict:
        """Stop every group still running; ``{k: Generation}`` of each one's samples so far (all its requests, in
        request order; ``finished`` False on a sample cut short, whose log-probs are those it was drawn with)."""
        got = self._stop()
        got.update(self._held)
        self._held = {}
        out = {}
        for k, members in self._members.items():
            if any(r in got for r in members):
                out[k] = completions_to_generation([got[r] for r in members], self.pad_id)
        return out


_PARTIAL = "weight update aborted: the engine holds partial weights and refuses to generate until a full update"


class EngineGenerator:
    """``Generator`` (core/types.py) over an :class:`EngineClient`.

    eos_id/pad_id: the tokenizer's; stop_token_ids: extra tokens that end a response (kept in it, as EOS is);
    top_k: 0 = off; bucket_bytes: weight-update bucket size; sleep_level: 0 keeps the engine awake while the trainer
    trains, 1 frees its KV cache, 2 its weights too (``sleep`` is called by the loop before the update);
    weight_transport: ``shm`` (shared memory), or ``gloo`` / ``nccl``: a broadcast over a process group of the trainer
    and the engine's workers (weight_group.py; nccl from the current CUDA device to the engine's GPUs), its rendezvous
    at the trainer's address on its connection to the engine; the group formed at the first update is kept, and
    formed again after a failed one."""

    def __init__(self, client: EngineClient, *, eos_id: int, pad_id: int, stop_token_ids=(), top_k: int = 0,
                 bucket_bytes: int = 64 << 20, sleep_level: int = 0, weight_transport: str = "shm"):
        self.weight_transport, self._group = check_transport(weight_transport), None
        self.client, self.eos_id, self.pad_id = client, int(eos_id), int(pad_id)
        self.stop_token_ids = sorted({int(eos_id), *map(int, stop_token_ids)})
        self.top_k, self.bucket_bytes, self.sleep_level = top_k, bucket_bytes, sleep_level
        self._ids = itertools.count()
        # a server that a killed trainer left asleep is woken before its first use (None: a test's client-less one)
        self._asleep = bool(getattr(client, "asleep_at_connect", False))
        self.last_update: dict = {}

    def _requests(self, prompts: list, n: int, max_new_tokens, temperature: float, top_p: float,
                  seed: Optional[int]) -> list:
        base = int(torch.randint(0, 2 ** 62, (1,)).item()) if seed is None else int(seed)
        budgets = max_new_tokens.tolist() if isinstance(max_new_tokens, torch.Tensor) else None
        return [Request(id=f"r{next(self._ids)}", prompt_ids=p, n=n,
                        max_new_tokens=int(budgets[k] if budgets is not None else max_new_tokens),
                        temperature=float(temperature), top_p=float(top_p), top_k=self.top_k,
                        seed=mix_seed(base, k) % (2 ** 31), stop_token_ids=self.stop_token_ids, logprobs=True)
                for k, p in enumerate(prompts)]

    def stream(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, n: int, max_new_tokens: int,
               temperature: float = 1.0, top_p: float = 1.0, seed: Optional[int] = None) -> GroupStream:
        """Submit every prompt (LEFT-padded [N, P]) with n samples at once; returns the stream of finished groups."""
        self._wake()
        requests = self._requests(_unpad(prompt_ids, prompt_mask), n, max_new_tokens, temperature, top_p, seed)
        self.client.submit(requests)
        return GroupStream(self.client, [r.id for r in requests], self.pad_id)

    def stream_requests(self, groups: list, *, temperature: float = 1.0, top_p: float = 1.0,
                        into: Optional[GroupStream] = None, first_key: int = 0) -> GroupStream:
        """Submit explicit requests, ``groups[k]`` a list of ``(prompt token ids, n, max_new_tokens, seed)`` (a fresh
        group: one request of n samples; a resumed one: a request per unfinished sample, prompt + its tokens so far);
        returns the stream of finished groups, group k's samples in request order. ``into``: add them to that live
        stream instead, as groups ``first_key + k`` (one stream per client: a stream drops completions not its own)."""
        self._wake()
        requests, group_of = [], []
        for k, parts in enumerate(groups):
            for prompt, n, budget, seed in parts:
                requests.append(Request(id=f"r{next(self._ids)}", prompt_ids=list(prompt), n=int(n),
                                        max_new_tokens=int(budget), temperature=float(temperature),
                                        top_p=float(top_p), top_k=self.top_k, seed=int(seed),
                                        stop_token_ids=self.stop_token_ids, logprobs=True))
                group_of.append(first_key + k)
        if requests:
            self.client.submit(requests)
        if into is None:
            return GroupStream(self.client, [r.id for r in requests], self.pad_id, group_of=group_of)
        into.add([r.id for r in requests], group_of)
        return into

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, max_new_tokens,
                 temperature: float = 1.0, top_p: float = 1.0, seed: Optional[int] = None) -> Generation:
        """One response per row of LEFT-padded [B, P] prompts (rows in order; each row its own request)."""
        self._wake()
        requests = self._requests(_unpad(prompt_ids, prompt_mask), 1, max_new_tokens, temperature, top_p, seed)
        if not requests:
            return completions_to_generation([], self.pad_id)
        self.client.submit(requests)
        wanted, done = {r.id for r in requests}, {}
        while len(done) < len(requests):
            c = self.client.next_completion()
            if c.id in wanted:  # never a late completion of an aborted stream
                done[c.id] = c
        return completions_to_generation([done[r.id] for r in requests], self.pad_id)

    @property
    def asleep(self) -> bool:
        return self._asleep

    def idle_seconds(self) -> float:
        """Wall seconds the engine has had no request in flight since the client connected."""
        return self.client.idle_seconds()

    def sleep(self) -> None:
        if self.sleep_level and not self._asleep:
            self.client.sleep(self.sleep_level)
            self._asleep = True

    def _wake(self) -> None:
        if self._asleep:
            self.client.wake()
            self._asleep = False

    def update_weights(self, policy, *, wake: bool = True) -> None:
        """Push the policy's weights (HF names) to the engine; a failure part-way is an error, never ignored.
        ``wake=False``: the caller has readied a sleeping engine for a refit that leaves its KV cache asleep
        (aligner/engine_generation.refit_wake); the next generate wakes it."""
        if wake:
            self._wake()
        t0 = time.perf_counter()
        try:
            buckets = weight_buckets(policy, self.bucket_bytes)
            if self.weight_transport != "shm":
                group, self._group = self._group, None  # dropped unless the update succeeds
                self.last_update, self._group = update_over_group(
                    [self.client], buckets, group=group, host=self.client.local_host(),
                    backend=self.weight_transport)
            else:
                self.last_update = self.client.update_weights(buckets)
        except EngineWeightError as e:
            raise EngineWeightError(f"{e} [{_PARTIAL}]", e.name) from e
        except EngineError as e:
            raise type(e)(f"{e} [{_PARTIAL}]") from e
        self.last_update["seconds"] = time.perf_counter() - t0
