"""A deterministic pure-Python engine adapter, to test the server, the client and the streaming loop (not a model).

Sample j of a request emits, per ``step()``, one token ``(seed + 7 j + 3 t + prompt[-1] + offset) % vocab`` where
``offset = int(w.sum())`` of its one weight ``w`` [4]; it stops at a stop token or at max_new_tokens. The log-prob
of every token is ``-0.5``. Options: ``step_delay_s`` (sleep per step, so tests can kill or abort mid-generation),
``lengths`` (a list: sample j of the k-th request ever added stops after lengths[(k + j) % len] tokens, for long-
tailed workloads), ``fail_after_steps`` (raise inside step() after that many steps: an engine crash),
``load_delay_s`` (sleep per weight bucket, so tests can kill a trainer mid-transfer), ``vocab_size`` (the token ids
it accepts in prompts, reported at hello; default ``vocab``).
``needs_missing_dependency`` is an engine factory whose dependency does not import; ``refuses_to_start`` one whose
constructor refuses its arguments. ``ToyEngine.closed`` counts the engines closed in this process.
"""
from __future__ import annotations

import time

import torch

from nemo_dapo.engines.base import Completion, EngineError, Sample, check_weight


class ToyEngine:
    name = "toy"
    closed = 0

    def __init__(self, model_dir: str = "", *, vocab: int = 50, step_delay_s: float = 0.0, lengths=None,
                 fail_after_steps: int = 0, max_batch_size: int = 1 << 30, load_delay_s: float = 0.0,
                 vocab_size: int = 0):
        self.vocab, self.step_delay_s, self.lengths = vocab, step_delay_s, lengths
        self.load_delay_s, self.vocab_size = load_delay_s, vocab_size or vocab
        self.fail_after_steps, self.max_batch_size = fail_after_steps, max_batch_size
        self.w = torch.zeros(4)
        self.running: dict = {}  # id -> (request, [tokens per sample], [done flags], [stop len])
        self.queue: list = []
        self.steps = 0
        self.added = 0
        self.asleep = 0
        self.finished_updates = 0

    def info(self) -> dict:
        return {"model": "toy", "vocab_size": self.vocab_size,
                "sleep_releases": {"1": ["kv_cache"], "2": ["kv_cache", "weights"]},
                "wake_tags": ["weights", "kv_cache"]}

    def add(self, request) -> None:
        caps = [request.max_new_tokens] * request.n
        if self.lengths:
            caps = [min(c, self.lengths[(self.added + j) % len(self.lengths)]) for j, c in enumerate(caps)]
        self.added += 1
        self.queue.append((request, [[] for _ in range(request.n)], [False] * request.n, caps))

    def has_work(self) -> bool:
        return bool(self.running or self.queue)

    def _admit(self) -> None:
        live = sum(len(v[1]) for v in self.running.values())
        while self.queue and live + self.queue[0][0].n <= self.max_batch_size:
            item = self.queue.pop(0)
            self.running[item[0].id] = item
            live += item[0].n

    def step(self) -> list:
        self.steps += 1
        if self.fail_after_steps and self.steps > self.fail_after_steps:
            raise RuntimeError("toy engine crashed on purpose")
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        self._admit()
        offset = int(self.w.sum())
        finished = []
        for rid, (req, toks, done, caps) in list(self.running.items()):
            for j in range(req.n):
                if done[j]:
                    continue
                t = len(toks[j])
                tok = ((req.seed or 0) + 7 * j + 3 * t + req.prompt_ids[-1] + offset) % self.vocab
                toks[j].append(tok)
                done[j] = tok in req.stop_token_ids or len(toks[j]) >= caps[j]
            if all(done):
                finished.append(self._completion(rid, "done"))
        return finished

    def _completion(self, rid: str, how: str) -> Completion:
        req, toks, done, caps = self.running.pop(rid)
        samples = []
        for j in range(req.n):
            if how == "aborted" and not done[j]:
                reason = "aborted"
            else:
                reason = "stop" if toks[j] and toks[j][-1] in req.stop_token_ids else "length"
            samples.append(Sample(token_ids=list(toks[j]), logprobs=[-0.5] * len(toks[j]), finish_reason=reason))
        return Completion(id=rid, samples=samples)

    def abort(self, ids) -> list:
        out = []
        for item in [q for q in self.queue if q[0].id in ids]:
            self.queue.remove(item)
            self.running[item[0].id] = item
        for rid in ids:
            if rid in self.running:
                out.append(self._completion(rid, "aborted"))
        return out

    def load_weights(self, named) -> None:
        time.sleep(self.load_delay_s)
        if "weights" in getattr(self, "released", ()):
            raise EngineError(f"engine {self.name!r}: its weights are released by sleep(2); wake them first")
        params = {"w": self.w}
        for name, t in named:
            check_weight(name, t, params.get(name), self.name)
            params[name].copy_(t)

    def finish_weights(self) -> None:
        self.finished_updates += 1

    def sleep(self, level: int) -> None:
        self.asleep = level
        self.released = {"kv_cache", "weights"} if level == 2 else {"kv_cache"}

    def wake(self, tags=None) -> None:
        self.released = getattr(self, "released", set()) - set(tags or ("kv_cache", "weights"))
        self.asleep = self.asleep if self.released else 0

    def close(self) -> None:
        ToyEngine.closed += 1


def needs_missing_dependency(model_dir: str = "", **options):
    """An engine whose runtime dependency is not installed (as vLLM or TensorRT-LLM outside their environment)."""
    import nemo_dapo_missing_dependency  # noqa: F401 - no such module

    return ToyEngine(model_dir, **options)


def refuses_to_start(model_dir: str = "", **options):
    """An engine whose constructor refuses its arguments (as LocalEngine refuses max_batch_size=0)."""
    raise ValueError("need max_batch_size >= 1")
