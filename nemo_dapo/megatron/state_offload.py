"""Free the device memory of a training state (weights, gradients, optimizer states) while a colocated engine
generates, and put it back bit for bit.

What is moved: three parts, collected afresh at every offload (a torch optimizer creates its states at its first
step, so nothing is cached between calls):
  weights    every parameter of the model chunks; with megatron-core's ``DistributedDataParallel`` also each
             buffer's ``param_data`` (``buffers`` + ``expert_parallel_buffers``; allocated with the distributed
             optimizer, the parameters are views into it);
  grads      each parameter's ``main_grad`` (DDP: views into the buffer's ``grad_data``; NeMo's O2 wrapper: views
             into its contiguous main-grad buckets) and ``grad``, each DDP buffer's ``grad_data``, and the ``grad``
             of the optimizer's own parameters (fp32 main params);
  optimizer  the innermost torch optimizer(s) behind the wrappers (NeMo's ``McoreDistributedOptimizer``
             ``.mcore_optimizer``, megatron-core's ``ChainedOptimizer.chained_optimizers``, ``.optimizer`` of
             megatron-core's ``DistributedOptimizer`` / ``Float16OptimizerWithFloat16Params`` and of NeMo's
             ``MainParamsOptimizerWrapper``): every tensor of its ``state`` (exp_avg, exp_avg_sq, momentum) and the
             parameters of its param groups, which are the fp32 main-param shards behind a mixed-precision or
             distributed optimizer (behind a plain optimizer they are the model's parameters: weights already).

How: the unit moved is a STORAGE, not a tensor. Tensors that share one (a DDP buffer and the parameters and main
grads viewed into it, tied embeddings) are copied once, under the first part that names it (weights, then grads,
then optimizer). Offload copies the storage's bytes into a host buffer (pinned on CUDA, kept for the next offload)
and resizes the storage to 0 bytes (``untyped_storage().resize_(0)``): its block goes back to the caching allocator
(``torch.cuda.empty_cache()`` then returns it to the device, for the engine's process). Onload resizes the storage
back and copies the bytes in. Every tensor object stays what it was (shape, strides, storage offset, autograd
identity, the optimizer state's keys); only its storage's memory leaves and comes back. So a view stays valid: the
parameters viewed into ``param_data`` and the ``main_grad`` views into ``grad_data`` read the restored bytes after
onload, and the optimizer, the DDP hooks and the refit gather keep working on the same objects.

Conventions: only storages on ``device`` move (torch Adam's CPU ``step`` counters stay); between offload and onload
nothing may read an offloaded tensor (its storage holds 0 bytes; on CUDA a read is an illegal memory access), so
callers onload before any use (``StateOffload.onload`` is idempotent). Imports nothing beyond torch: the model and
optimizer classes are recognised by their attributes.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch

PARTS = ("weights", "grads", "optimizer")
GB = 1e9


def _tensors_in(value) -> Iterator[torch.Tensor]:
    """The tensors inside nested dicts / lists / tuples (an optimizer's state)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors_in(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors_in(v)


def _ddp_buffers(chunk) -> list:
    """megatron-core DDP's param-and-grad buffers of one model chunk ([] for a model without mcore DDP; on any other
    module ``buffers`` is nn.Module's method)."""
    out = []
    for name in ("buffers", "expert_parallel_buffers"):
        value = getattr(chunk, name, None)
        out += list(value) if isinstance(value, (list, tuple)) else []
    return out


def inner_optimizers(optimizer) -> list:
    """The torch optimizers behind ``optimizer``'s wrappers (module doc), each once."""
    out, todo, seen = [], [optimizer], set()
    while todo:
        opt = todo.pop(0)
        if opt is None or id(opt) in seen:
            continue
        seen.add(id(opt))
        if getattr(opt, "chained_optimizers", None) is not None:  # megatron-core ChainedOptimizer (dense + experts)
            todo.extend(opt.chained_optimizers)
        elif getattr(opt, "mcore_optimizer", None) is not None:  # NeMo's McoreDistributedOptimizer
            todo.append(opt.mcore_optimizer)
        elif getattr(opt, "optimizer", None) is not None and opt.optimizer is not opt:  # a wrapper's inner one
            todo.append(opt.optimizer)
        elif isinstance(opt, torch.optim.Optimizer):
            out.append(opt)
    return out


def state_tensors(chunks: Iterable, optimizer=None) -> dict:
    """{part: [tensor]} of the training state of ``chunks`` (model chunks) and ``optimizer`` (module doc)."""
    chunks = list(chunks)
    params = [p for c in chunks for p in c.parameters()]
    buffers = [b for c in chunks for b in _ddp_buffers(c)]
    weights = params + [b.param_data for b in buffers if getattr(b, "param_data", None) is not None]
    grads = [g for p in params for g in (getattr(p, "main_grad", None), p.grad) if isinstance(g, torch.Tensor)]
    grads += [b.grad_data for b in buffers if getattr(b, "grad_data", None) is not None]
    opt = []
    for inner in inner_optimizers(optimizer):
        group_params = [p for g in inner.param_groups for p in g["params"]]
        grads += [p.grad for p in group_params if p.grad is not None]
        opt += group_params + list(_tensors_in(list(inner.state.values())))
    return {"weights": weights, "grads": grads, "optimizer": opt}


def _storage_key(t: torch.Tensor) -> int:
    # the StorageImpl's address: stable while the storage lives, also after resize_(0) (unlike data_ptr)
    return t.untyped_storage()._cdata


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over all of ``storage`` (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


@dataclass
class _Held:
    """One offloaded storage: the live storage object (0 bytes while offloaded) and its bytes on the host."""

    storage: torch.UntypedStorage
    host: torch.Tensor
    part: str


class StateOffload:
    """Offload / onload of the training state of ``chunks`` + ``optimizer`` on ``device`` (module doc).

    ``offload(parts)`` may run in stages (e.g. grads and optimizer before a refit, which reads the weights, and the
    weights after it); ``onload()`` brings back everything offloaded. ``pin``: pinned host buffers (default: on
    CUDA). ``last``: {"offload_s", "onload_s", "offloaded_bytes"} of the latest calls."""

    def __init__(self, chunks, optimizer=None, *, device: Optional[torch.device] = None, pin: Optional[bool] = None):
        self.chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
        self.optimizer = optimizer
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
        if self.device.type == "cuda" and self.device.index is None:
            # tensors name their index: "cuda" would match none of them, and nothing would move
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.pin = (self.device.type == "cuda") if pin is None else bool(pin)
        self._held: dict = {}  # storage key -> _Held, while offloaded
        self._host: dict = {}  # storage key -> host buffer, reused by the next offload of that storage
        self.last: dict = {}

    # ---- what is moved -------------------------------------------------------------------------------------------
    def storages(self) -> dict:
        """{part: [(key, storage)]}: each device storage once, under the first part naming it (module doc)."""
        tensors, claimed, out = state_tensors(self.chunks, self.optimizer), set(), {p: [] for p in PARTS}
        for part in PARTS:
            for t in tensors[part]:
                if t.device != self.device:
                    continue
                key = _storage_key(t)
                if key not in claimed:
                    claimed.add(key)
                    out[part].append((key, t.untyped_storage()))
        return out

    @property
    def offloaded_parts(self) -> tuple:
        return tuple(p for p in PARTS if any(h.part == p for h in self._held.values()))

    @property
    def offloaded_bytes(self) -> int:
        return sum(h.host.numel() for h in self._held.values())

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- moves ---------------------------------------------------------------------------------------------------
    def offload(self, parts: Iterable[str] = PARTS) -> int:
        """Move ``parts`` to the host; returns the bytes moved. Storages already offloaded are left alone."""
        parts = tuple(parts)
        unknown = sorted(set(parts) - set(PARTS))
        if unknown:
            raise ValueError(f"unknown training-state parts {unknown}; choose from {PARTS}")
        t0 = time.perf_counter()
        todo = [(key, s, part) for part, items in self.storages().items() if part in parts
                for key, s in items if key not in self._held and s.nbytes() > 0]
        stuck = [part for _, s, part in todo if not s.resizable()]
        if stuck:  # refuse before anything moved: a half-offloaded state is worse than none
            raise RuntimeError(f"cannot offload the training state: {len(stuck)} {sorted(set(stuck))} storages are "
                               "not resizable (tensors made from numpy or shared memory?)")
        moved = []
        for key, storage, part in todo:
            n = storage.nbytes()
            host = self._host.get(key)
            if host is None or host.numel() != n:
                host = torch.empty(n, dtype=torch.uint8, device="cpu", pin_memory=self.pin)
                self._host[key] = host
            host.copy_(_bytes_of(storage), non_blocking=self.pin)
            moved.append(_Held(storage, host, part))
        self._sync()  # the copies are complete before the device memory is released
        for (key, _, _), held in zip(todo, moved):
            held.storage.resize_(0)
            self._held[key] = held
        n = sum(h.host.numel() for h in moved)
        self.last.update(offload_s=self.last.get("offload_s", 0.0) + time.perf_counter() - t0,
                         offloaded_bytes=self.offloaded_bytes)
        return n

    def onload(self) -> int:
        """Bring every offloaded storage back (same storage objects, the same bytes); returns the bytes moved."""
        if not self._held:
            return 0
        t0 = time.perf_counter()
        n = 0
        for held in self._held.values():
            held.storage.resize_(held.host.numel())
            _bytes_of(held.storage).copy_(held.host, non_blocking=self.pin)
            n += held.host.numel()
        self._sync()
        self._held.clear()
        self.last["onload_s"] = self.last.get("onload_s", 0.0) + time.perf_counter() - t0
        return n

    def pop_stats(self) -> dict:
        """The moves since the last call: {"offload_s", "onload_s", "offloaded_bytes" (the peak held)}; resets."""
        out, self.last = dict(self.last), {}
        return out
