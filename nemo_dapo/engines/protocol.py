"""The rollout-engine protocol, version 1: messages, framing and shared-memory weight handles (torch + stdlib).

Transport: ``multiprocessing.connection`` over a Unix socket (``unix:/path``) or loopback TCP (``tcp://127.0.0.1:P``),
authenticated by an HMAC key (``authkey``). Every frame is one UTF-8 JSON object: no pickles cross the boundary, so
the two sides may run different Python / torch versions (the engine lives in its own environment).

Client -> server: every command carries ``cmd`` (a client-chosen int) and is answered by exactly one
``{"op": "reply", "cmd": k, ...}`` or ``{"op": "error", "cmd": k, "type": ..., "message": ..., "name": ...}``.

    hello            {version}                       -> {version, engine, info}; a version mismatch is an error
    submit           {requests: [Request]}           -> {}   queued; completions follow as they finish
    abort            {ids: [str]}                    -> {aborted: n}; the aborted requests' completions follow
    update_weights   {shm, tensors: [WeightSpec]}    -> {loaded: n}; one bucket, read from shared memory
    update_weights_done {}                           -> {}   post-process, reset caches; generation may resume
    sleep            {level: 1|2}                    -> {}   level 1 frees the KV cache, 2 the weights too
    wake             {}                              -> {}
    health           {}                              -> {running, weights_ok, sleeping, uptime_s, engine}
    shutdown         {}                              -> {}   then the server exits

Server -> client, unprompted:

    completion       {id, samples: [{token_ids, logprobs, finish_reason}]}   one per finished request
    fatal            {message}                                               the engine died; the server exits

A ``WeightSpec`` is ``{name, dtype, shape, offset}``: the tensor is ``nbytes(dtype, shape)`` bytes at ``offset`` of the
POSIX shared-memory block ``shm`` (CPU). Buckets are sent one at a time and the client waits for the reply before it
reuses the block, so the extra memory is one bucket. (On GPUs the same spec carries a CUDA IPC handle instead of a
shared-memory name; that path comes with the TensorRT-LLM engine.)
"""
from __future__ import annotations

import json
import math
from multiprocessing import connection, resource_tracker, shared_memory
from typing import Iterable, Optional

import torch

PROTOCOL_VERSION = 1
DEFAULT_AUTHKEY = b"nemo_dapo-engine"

_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                                      torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool)}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype {dtype} cannot be sent to an engine; use one of {sorted(_DTYPES)}")
    return name


def dtype_of(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r} in a weight spec; known: {sorted(_DTYPES)}")
    return _DTYPES[name]


def nbytes(dtype: torch.dtype, shape) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


# ---- addresses and framing --------------------------------------------------------------------------------------
def parse_address(address: str):
    """'unix:/path' -> ('/path', 'AF_UNIX'); 'tcp://HOST:PORT' -> ((HOST, PORT), 'AF_INET')."""
    if address.startswith("unix:"):
        return address[len("unix:"):], "AF_UNIX"
    if address.startswith("tcp://"):
        host, _, port = address[len("tcp://"):].rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"engine address {address!r}: expected tcp://HOST:PORT")
        return (host, int(port)), "AF_INET"
    raise ValueError(f"engine address {address!r}: expected unix:/path/to/socket or tcp://HOST:PORT")


def listen(address: str, authkey: bytes) -> connection.Listener:
    addr, family = parse_address(address)
    return connection.Listener(addr, family=family, authkey=authkey)


def connect(address: str, authkey: bytes) -> connection.Connection:
    addr, family = parse_address(address)
    return connection.Client(addr, family=family, authkey=authkey)


def send(conn: connection.Connection, msg: dict) -> None:
    conn.send_bytes(json.dumps(msg, separators=(",", ":")).encode())


def recv(conn: connection.Connection) -> dict:
    msg = json.loads(conn.recv_bytes().decode())
    if not isinstance(msg, dict) or "op" not in msg:
        raise ValueError(f"malformed engine message (no 'op'): {str(msg)[:200]}")
    return msg


# ---- shared-memory weight buckets -------------------------------------------------------------------------------
class WeightBuffer:
    """Trainer side: one shared-memory block, reused bucket after bucket (grown when a bucket needs more)."""

    def __init__(self, size: int = 0):
        self._shm: Optional[shared_memory.SharedMemory] = None
        if size:
            self._ensure(size)

    def _ensure(self, size: int) -> None:
        if self._shm is not None and self._shm.size >= size:
            return
        self.close()
        self._shm = shared_memory.SharedMemory(create=True, size=max(size, 1))

    def pack(self, bucket: Iterable[tuple]) -> tuple:
        """Copy (name, tensor) pairs into the block; returns (block name, [WeightSpec])."""
        bucket = [(n, t.detach()) for n, t in bucket]
        specs, offset = [], 0
        for name, t in bucket:
            specs.append({"name": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "offset": offset})
            offset += _aligned(nbytes(t.dtype, t.shape))
        self._ensure(offset)
        for spec, (_, t) in zip(specs, bucket):
            view = _view(self._shm.buf, spec)
            view.copy_(t.reshape(view.shape).to("cpu"))
            del view
        return self._shm.name, specs

    @property
    def size(self) -> int:
        return self._shm.size if self._shm is not None else 0

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm.unlink()
            self._shm = None


def _aligned(n: int, to: int = 64) -> int:
    return (n + to - 1) // to * to


def _view(buf, spec: dict) -> torch.Tensor:
    dtype, shape = dtype_of(spec["dtype"]), tuple(spec["shape"])
    count = math.prod(shape)
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype, count=count, offset=int(spec["offset"])).view(shape)


class AttachedBuffer:
    """Engine side: a view onto the trainer's block. The trainer owns (and unlinks) it: we only detach."""

    def __init__(self, name: str):
        self.name = name
        self._shm = shared_memory.SharedMemory(name=name)
        # Python < 3.13 registers attached blocks with this process's resource tracker, which would unlink the
        # trainer's block when the engine exits; the owner is the trainer.
        try:
            resource_tracker.unregister(self._shm._name, "shared_memory")
        except Exception:  # noqa: BLE001 - tracker details differ between Python versions; leaking a warning is fine
            pass

    def tensors(self, specs: list) -> list:
        """[(name, tensor view)] for the specs; views are valid until :meth:`close`."""
        out = []
        for spec in specs:
            end = int(spec["offset"]) + nbytes(dtype_of(spec["dtype"]), spec["shape"])
            if end > self._shm.size:
                raise ValueError(f"weight {spec['name']!r} ends at byte {end}, past the {self._shm.size}-byte block")
            out.append((spec["name"], _view(self._shm.buf, spec)))
        return out

    def close(self) -> None:
        try:
            self._shm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with the process
            pass
