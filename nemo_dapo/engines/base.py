"""What an engine adapter is: the thin, engine-specific half of a rollout-engine server (torch + stdlib only).

The server (``engines/server.py``) owns the socket and the protocol; an adapter owns one in-flight inference engine
and is driven from the server's single thread:

    adapter.add(request)             queue a request (n samples of one prompt); returns at once
    adapter.step() -> [Completion]   advance every running request a little; return the requests that FINISHED
    adapter.abort(ids) -> [Completion]  stop requests now; their partial samples come back with finish "aborted"
    adapter.load_weights(named)      one bucket of (HF name, tensor); partial buckets are allowed
    adapter.finish_weights()         after the last bucket: post-process, reset prefix caches
    adapter.sleep(level) / wake()    free the KV cache (level 1) and the weights too (level 2) while the trainer trains

Token conventions: ``prompt_ids`` are the prompt's real tokens (no padding); a sample's ``token_ids`` are the
generated tokens, the stop/EOS token included when one ended it; ``logprobs[t]`` is the log-probability of
``token_ids[t]`` under the distribution it was drawn from (after temperature / top-k / top-p), one float per token.
"""
from __future__ import annotations

import json
import math
import operator
import os
from dataclasses import asdict, dataclass, field
from typing import Iterable, Optional, Protocol, Sequence

import torch

from nemo_dapo.core.settings import MIN_TEMPERATURE

FINISH_REASONS = ("stop", "length", "aborted")
MAX_SAMPLES_PER_REQUEST = 1024  # n of one request (DAPO's groups are 16; pass@k evaluations use up to a few hundred)


class EngineError(RuntimeError):
    """Any failure of a rollout engine, with a message naming the engine and what to do."""


class EngineWeightError(EngineError):
    """The engine rejected a weight (unknown name, wrong shape or dtype). ``name`` is the tensor."""

    def __init__(self, message: str, name: str = ""):
        super().__init__(message)
        self.name = name


@dataclass
class Request:
    """n samples of one prompt. ``seed`` None: the engine's own randomness; sample k of a seeded request uses a
    stream derived from (seed, k), so a request's samples are reproducible whatever else the engine runs."""

    id: str
    prompt_ids: list
    n: int = 1
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: Optional[int] = None
    stop_token_ids: list = field(default_factory=list)
    logprobs: bool = True
    ignore_eos: bool = False  # generate exactly max_new_tokens (benchmarks: lengths set by the workload)

    def __post_init__(self):
        if not isinstance(self.id, str) or not 0 < len(self.id) <= 256:
            raise ValueError(f"request id must be a non-empty string of at most 256 characters, got {self.id!r:.80}")
        self.prompt_ids = _token_ids(self.id, "prompt_ids", self.prompt_ids)
        self.stop_token_ids = _token_ids(self.id, "stop_token_ids", self.stop_token_ids)
        if not self.prompt_ids:
            raise ValueError(f"request {self.id}: empty prompt (every request needs at least one token)")
        self.n, self.max_new_tokens, self.top_k = (_integer(self.id, k, getattr(self, k))
                                                   for k in ("n", "max_new_tokens", "top_k"))
        if not 1 <= self.n <= MAX_SAMPLES_PER_REQUEST or self.max_new_tokens < 1:
            raise ValueError(f"request {self.id}: need 1 <= n <= {MAX_SAMPLES_PER_REQUEST} and max_new_tokens >= 1, "
                             f"got n={self.n}, max_new_tokens={self.max_new_tokens}")
        self.temperature, self.top_p = (_number(self.id, k, getattr(self, k)) for k in ("temperature", "top_p"))
        if self.temperature < 0 or not 0.0 < self.top_p <= 1.0 or self.top_k < 0:
            raise ValueError(f"request {self.id}: need temperature >= 0, 0 < top_p <= 1, top_k >= 0; got "
                             f"{self.temperature}, {self.top_p}, {self.top_k}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"request {self.id}: temperature {self.temperature:.3g} is below {MIN_TEMPERATURE}: "
                             "that samples greedily in effect, and a tiny one divides the logits into inf (NaN "
                             "log-probs); use 0 for greedy decoding")
        for k in ("logprobs", "ignore_eos"):
            if not isinstance(getattr(self, k), bool):
                raise ValueError(f"request {self.id}: {k} must be true or false, got {getattr(self, k)!r:.40}")
        if self.seed is not None and not 0 <= _integer(self.id, "seed", self.seed) < 2 ** 63:
            raise ValueError(f"request {self.id}: seed must be an int in [0, 2**63) or null, got {self.seed}")

    def to_wire(self) -> dict:
        return asdict(self)

    @classmethod
    def from_wire(cls, d: dict) -> "Request":
        if not isinstance(d, dict):
            raise ValueError(f"a request must be a JSON object, got {type(d).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"request has unknown fields {unknown}; client and server protocol versions differ?")
        return cls(**d)


def _integer(rid: str, field: str, value) -> int:
    if isinstance(value, bool):
        raise ValueError(f"request {rid}: {field} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"request {rid}: {field} must be an int, got {value!r:.40}") from None


def _number(rid: str, field: str, value) -> float:
    try:  # an int too large for a float (JSON allows any) raises OverflowError here
        number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    except OverflowError:
        number = math.nan
    if not math.isfinite(number):
        raise ValueError(f"request {rid}: {field} must be a finite number, got {value!r:.40}")
    return number


def _token_ids(rid: str, field: str, ids) -> list:
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"request {rid}: {field} must be a list of token ids, got {type(ids).__name__}")
    ids = [_integer(rid, field, t) for t in ids]
    if ids and min(ids) < 0:
        raise ValueError(f"request {rid}: {field} holds a negative token id ({min(ids)})")
    return ids


def check_token_ids(request: "Request", vocab_size: Optional[int], engine: str) -> None:
    """Refuse a request whose prompt holds a token id the engine's vocabulary does not have."""
    if vocab_size and request.prompt_ids and max(request.prompt_ids) >= vocab_size:
        raise ValueError(f"engine {engine!r}: request {request.id}: token id {max(request.prompt_ids)} is outside "
                         f"the vocabulary [0, {vocab_size}); the trainer and the engine use different tokenizers?")


@dataclass
class Sample:
    token_ids: list
    logprobs: Optional[list]
    finish_reason: str  # one of FINISH_REASONS

    def __post_init__(self):
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason {self.finish_reason!r} is not one of {FINISH_REASONS}")
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"{len(self.logprobs)} log-probs for {len(self.token_ids)} tokens")


@dataclass
class Completion:
    """A finished request: its n samples in index order."""

    id: str
    samples: list  # [Sample] * n

    def to_wire(self) -> dict:
        return {"id": self.id, "samples": [asdict(s) for s in self.samples]}

    @classmethod
    def from_wire(cls, d: dict) -> "Completion":
        return cls(id=d["id"], samples=[Sample(**s) for s in d["samples"]])

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)


class EngineAdapter(Protocol):
    name: str

    def info(self) -> dict:
        """Static facts for the hello reply: at least ``model`` and ``vocab_size``."""
        ...

    def add(self, request: Request) -> None: ...

    def step(self) -> list: ...

    def has_work(self) -> bool: ...

    def abort(self, ids: Sequence[str]) -> list: ...

    def load_weights(self, named: Iterable[tuple]) -> None:
        """Copy (HF name, tensor) pairs into the model; raise EngineWeightError naming a rejected tensor. The
        tensors are views of shared memory owned by the trainer: copy, never keep a reference."""
        ...

    def finish_weights(self) -> None: ...

    def sleep(self, level: int) -> None: ...

    def wake(self, tags: Optional[Sequence[str]] = None) -> None:
        """Wake what sleep released: ``tags`` a subset of WAKE_TAGS (wake only that part: "weights" lets a refit
        load into the engine's weight memory while its KV cache stays released), None everything still asleep."""
        ...

    def close(self) -> None: ...


# What a sleep can release, in the protocol's words (an engine maps them to its own memory tags).
WAKE_TAGS = ("weights", "kv_cache")


def check_weight(name: str, tensor: torch.Tensor, target: Optional[torch.Tensor], engine: str,
                 into: Optional[torch.dtype] = None) -> None:
    """Raise EngineWeightError unless ``target`` (the engine's parameter of that name) can take ``tensor``: its
    name, shape and kind of dtype, and (a tensor with values: not on the meta device) values the dtype it is cast to
    can hold (``into``, default ``target``'s; a float64 1e300 would load into float32 as inf)."""
    if target is None:
        raise EngineWeightError(f"engine {engine!r}: no parameter named {name!r}; the trainer sends Hugging Face "
                                "names: check that both sides load the same architecture", name)
    if tuple(target.shape) != tuple(tensor.shape):
        raise EngineWeightError(f"engine {engine!r}: weight {name!r} has shape {tuple(tensor.shape)}, the engine's "
                                f"is {tuple(target.shape)}; the trainer and the engine hold different model configs",
                                name)
    if not (tensor.dtype.is_floating_point and target.dtype.is_floating_point) and tensor.dtype != target.dtype:
        raise EngineWeightError(f"engine {engine!r}: weight {name!r} has dtype {tensor.dtype}, the engine's is "
                                f"{target.dtype}", name)
    into = target.dtype if into is None else into
    if tensor.dtype.is_floating_point and into.is_floating_point and narrower(tensor.dtype, into):
        check_finite(name, tensor, engine, into=into)  # the server checked finiteness; this is for the range


def narrower(dtype: torch.dtype, into: torch.dtype) -> bool:
    """Whether floating-point ``into`` holds a smaller range than ``dtype`` (float32 -> float16 or bfloat16)."""
    return torch.finfo(into).max < torch.finfo(dtype).max


def check_finite(name: str, tensor: torch.Tensor, engine: str, chunk: int = 1 << 24,
                 into: Optional[torch.dtype] = None) -> None:
    """Raise EngineWeightError if a floating-point weight holds NaN or inf, or (``into``: the dtype the engine casts
    it to, where narrower) a value that dtype cannot hold. Checked in chunks: no full-size mask."""
    if not tensor.dtype.is_floating_point or tensor.device.type == "meta":
        return
    narrowing = into is not None and into.is_floating_point and narrower(tensor.dtype, into)
    limit = torch.finfo(into).max if narrowing else math.inf
    flat = tensor.reshape(-1)
    for start in range(0, flat.numel(), chunk):
        part = flat[start:start + chunk]
        if not bool(torch.isfinite(part).all()):
            raise EngineWeightError(f"engine {engine!r}: weight {name!r} holds NaN or inf values; refusing it (the "
                                    "trainer's weights diverged, or a conversion overflowed the dtype)", name)
        if narrowing and part.numel() and float(part.abs().max()) > limit:
            raise EngineWeightError(f"engine {engine!r}: weight {name!r} holds {float(part.abs().max()):.3g}, "
                                    f"beyond {str(into).replace('torch.', '')}'s range (the engine's dtype): it "
                                    "would load as inf; refusing it", name)


HF_EMBED, HF_HEAD = "model.embed_tokens.weight", "lm_head.weight"


@dataclass(frozen=True)
class HFCheckpoint:
    """What an adapter of an engine that loads a Hugging Face directory itself (vLLM, TensorRT-LLM) reads of it
    first: ``config`` (config.json), ``shapes`` (:func:`checkpoint_shapes`), ``eos_ids`` (config.json's
    ``eos_token_id`` as a list; empty when unset) and ``tied``: the output layer is the embedding
    (``tie_word_embeddings`` and no ``lm_head.weight`` stored), so a trainer's ``lm_head.weight`` is the embedding's
    tensor."""

    config: dict
    shapes: dict
    eos_ids: list
    tied: bool


def read_checkpoint(model_dir: str, engine: str) -> HFCheckpoint:
    """Read ``model_dir`` (never downloads); raise EngineError naming ``engine`` and what is missing."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise EngineError(f"engine {engine!r}: no config.json in {model_dir!r} (never downloads)") from None
    shapes = checkpoint_shapes(model_dir, engine)
    eos = [int(e) for e in torch.tensor(config.get("eos_token_id") or []).reshape(-1).tolist()]
    return HFCheckpoint(config, shapes, eos, bool(config.get("tie_word_embeddings")) and HF_HEAD not in shapes)


def checkpoint_shapes(model_dir: str, engine: str) -> dict:
    """HF name -> shape of every tensor in the directory's safetensors files (headers only): what an engine's
    weight update is checked against (``check_weight``)."""
    from safetensors import safe_open
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise EngineError(f"engine {engine!r}: no *.safetensors in {model_dir!r} (save_pretrained writes them)")
    shapes = {}
    for f in files:
        with safe_open(os.path.join(model_dir, f), framework="pt") as fh:
            shapes.update((k, tuple(fh.get_slice(k).get_shape())) for k in fh.keys())
    return shapes


def check_usable(name: str, *, closed: bool, broken: Optional[str], updating: bool, asleep: bool,
                 stepping: bool = False) -> None:
    """Raise EngineError when an adapter cannot serve the call: closed, broken (by a failed update), or, for a
    generation step (``stepping``), in the middle of a weight update or asleep."""
    why = ("closed" if closed else f"unusable: {broken}; restart it" if broken else
           "in a weight update; call finish_weights()" if stepping and updating else
           "asleep; call wake()" if stepping and asleep else None)
    if why:
        raise EngineError(f"engine {name!r} is {why}")
