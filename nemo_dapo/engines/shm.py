"""Shared-memory weight buckets of the protocol (``protocol.py``): the trainer packs a bucket into a POSIX block,
the engine server maps it and removes its name at once, and a token block checks at hello that both see /dev/shm.

A ``WeightSpec`` is ``{name, dtype, shape, offset}``; ``weight_layout`` packs every tensor at a 64-byte aligned
offset, and the collective transport (``weight_group.py``) lays out its broadcast buckets the same way.
"""
from __future__ import annotations

import hmac
import math
import os
import re
import secrets
from multiprocessing import resource_tracker, shared_memory
from typing import Iterable, Optional

import torch

from .base import EngineError
from .protocol import ProtocolError, dtype_name, dtype_of, nbytes

SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared-memory blocks


def _shm_name(kind: str) -> str:
    return f"nemo_dapo_{os.getpid()}_{kind}_{secrets.token_hex(6)}"


def _check_shm_name(name, kind: str) -> str:
    if not isinstance(name, str) or not re.fullmatch(rf"nemo_dapo_\d+_{kind}_[0-9a-f]{{12}}", name):
        raise ProtocolError(f"{name!r} is not the name of a nemo_dapo shared-memory block")
    return name


def _unlink(shm: shared_memory.SharedMemory) -> None:
    """Remove the block's name if it still exists (the peer may have removed it), and forget it either way."""
    try:
        shm.unlink()
    except FileNotFoundError:
        try:
            resource_tracker.unregister(shm._name, "shared_memory")
        except Exception:  # noqa: BLE001 - tracker details differ between Python versions
            pass


IPC_HINT = ("the trainer and the engine server do not share /dev/shm: on Slurm with enroot / pyxis, a site that sets "
             "ENROOT_UNSHARE_IPC (or srun --container-unshare=ipc) gives every container a private /dev/shm; run both "
             "steps without it (containers of one node must share /dev/shm), or run them on one host")


class ShmToken:
    """Client side of the shared-memory check at hello: a small block of random bytes that the server must read back
    (then it removes it). A server that cannot see it does not share /dev/shm, and weight updates could not work."""

    SIZE = 32

    def __init__(self):
        self.value = secrets.token_bytes(self.SIZE)
        self._shm = shared_memory.SharedMemory(name=_shm_name("t"), create=True, size=self.SIZE)
        self._shm.buf[:self.SIZE] = self.value
        self.name = self._shm.name

    def matches(self, echoed) -> bool:
        return isinstance(echoed, str) and hmac.compare_digest(echoed, self.value.hex())

    def close(self) -> None:
        self._shm.close()
        _unlink(self._shm)


def read_token(name) -> str:
    """Server side: the token block's bytes (hex); removes it. ProtocolError naming the likely cause if absent."""
    name = _check_shm_name(name, "t")
    try:
        shm = shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        raise ProtocolError(f"the engine server cannot see the trainer's shared-memory block /dev/shm/{name}: "
                            + IPC_HINT) from None
    try:
        return bytes(shm.buf[:ShmToken.SIZE]).hex()
    finally:
        shm.close()
        _unlink(shm)


def weight_layout(bucket: list) -> tuple:
    """([WeightSpec], bytes needed) of (name, tensor) pairs packed at 64-byte aligned offsets."""
    specs, offset = [], 0
    for name, t in bucket:
        specs.append({"name": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "offset": offset})
        offset += _aligned(nbytes(t.dtype, t.shape))
    return specs, offset


class WeightBuffer:
    """Trainer side: the shared-memory block of one weight update, reused bucket after bucket (a new, bigger one
    when a bucket needs more room). ``reserve`` says when a new block must be attached (protocol docstring)."""

    def __init__(self):
        self._shm: Optional[shared_memory.SharedMemory] = None

    @property
    def name(self) -> Optional[str]:
        return self._shm.name if self._shm is not None else None

    def reserve(self, size: int) -> Optional[str]:
        """Make room for ``size`` bytes; the name of a NEW block (attach it before filling it), else None."""
        if self._shm is not None and self._shm.size >= size:
            return None
        self.close()
        self._shm = shared_memory.SharedMemory(name=_shm_name("w"), create=True, size=max(size, 1))
        try:
            _back_with_memory(self._shm)
        except BaseException:
            self.close()
            raise
        return self._shm.name

    def fill(self, bucket: list, specs: list) -> None:
        for spec, (_, t) in zip(specs, bucket):
            view = spec_view(self._shm.buf, spec)
            view.copy_(t.detach().reshape(view.shape).to("cpu"))
            del view

    def pack(self, bucket: Iterable[tuple]) -> tuple:
        """Copy (name, tensor) pairs into the block; returns (block name, [WeightSpec])."""
        bucket = list(bucket)
        specs, size = weight_layout(bucket)
        self.reserve(size)
        self.fill(bucket, specs)
        return self._shm.name, specs

    @property
    def size(self) -> int:
        return self._shm.size if self._shm is not None else 0

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
            _unlink(self._shm)
            self._shm = None


def _back_with_memory(shm: shared_memory.SharedMemory) -> None:
    """Allocate the block's pages now. A new block is a sparse file on tmpfs: filling it past a full /dev/shm would
    kill the trainer with SIGBUS (no engine error, no checkpoint); allocated here, a full /dev/shm is an error."""
    path = os.path.join(SHM_DIR, shm.name.lstrip("/"))
    if not hasattr(os, "posix_fallocate") or not os.path.exists(path):
        return  # not Linux: the platform's own shared memory, not tmpfs
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, shm.size)
    except OSError as e:
        st = os.statvfs(SHM_DIR)
        free, total = st.f_bavail * st.f_frsize / 2 ** 20, st.f_blocks * st.f_frsize / 2 ** 20
        raise EngineError(f"{SHM_DIR} has no room for a weight bucket of {shm.size / 2 ** 20:.0f} MiB ({free:.0f} "
                          f"MiB free of {total:.0f} MiB: {e.strerror}): lower the bucket size "
                          "(rollout.server.bucket_mb, on the cluster trainer.dapo.engine_server.bucket_mb), give the "
                          "container a larger /dev/shm (docker run --shm-size), or send the weights over a process "
                          "group (weight_transport: gloo)") from e
    finally:
        os.close(fd)


def _aligned(n: int, to: int = 64) -> int:
    return (n + to - 1) // to * to


def spec_view(buf, spec: dict) -> torch.Tensor:
    dtype, shape = dtype_of(spec["dtype"]), tuple(spec["shape"])
    count = math.prod(shape)
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype, count=count, offset=int(spec["offset"])).view(shape)


class AttachedBuffer:
    """Engine side: a view onto the trainer's block. Its name is removed as soon as it is mapped (so nothing is left
    in /dev/shm whatever happens to the trainer); the mapping lives until :meth:`close`."""

    def __init__(self, name: str):
        self.name = _check_shm_name(name, "w")
        try:
            self._shm = shared_memory.SharedMemory(name=name)
        except FileNotFoundError:
            raise ProtocolError(f"no shared-memory block /dev/shm/{name}: " + IPC_HINT) from None
        _unlink(self._shm)

    def tensors(self, specs: list) -> list:
        """[(name, tensor view)] for the specs; views are valid until :meth:`close`."""
        out = []
        for spec in specs:
            if not spec_fits(spec, self._shm.size):
                raise ProtocolError(f"weight {spec['name']!r} ends past the {self._shm.size}-byte block")
            out.append((spec["name"], spec_view(self._shm.buf, spec)))
        return out

    def close(self) -> None:
        try:
            self._shm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with the process
            pass


def spec_fits(spec: dict, size: int) -> bool:
    """Whether a (client-given) spec is well formed and lies inside a block of ``size`` bytes."""
    shape, offset = spec["shape"], spec["offset"]
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape) and type(offset) is int):
        raise ProtocolError(f"weight {spec.get('name')!r}: shape must be a list of ints >= 0 and offset an int, got "
                            f"{shape!r}, {offset!r}")
    return 0 <= offset and offset + nbytes(dtype_of(spec["dtype"]), shape) <= size
