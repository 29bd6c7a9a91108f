"""Where a tensor must live for a torch.distributed collective, and where a rank waits long (torch only).

NCCL reduces only CUDA tensors; gloo (the CPU tests, and the CPU half of a mixed ``cpu:gloo,cuda:nccl`` group)
takes CPU tensors. Every layer that runs a collective asks here, so the rule exists once.

A rank that waits for other ranks' engines (a generation of minutes to hours) waits on the CPU, in a gloo group
(``cpu_wait_group``), never inside an NCCL collective: there it would spin a kernel on its GPU the whole time (the
GPU a colocated engine's worker computes on: without MPS the two processes take turns on it), and NCCL's watchdog
ends the process at the group's time-out (30 minutes for the groups NeMo's strategy and megatron-core create).
"""
from __future__ import annotations

import datetime
from typing import Optional

import torch
import torch.distributed as dist


def collective_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """The device a collective on ``group`` (default: the world) needs: the current CUDA device when its backend is
    NCCL alone, else the CPU (also when torch.distributed is not initialised: nothing to talk to)."""
    if not dist.is_initialized():
        return torch.device("cpu")
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


WAIT_TIMEOUT = datetime.timedelta(hours=24)  # a safety net: a rank that dies closes its gloo sockets (its peers fail
# at once), and an engine that stops answering fails its owner after the client's request_timeout_s


def every_group(group: dist.ProcessGroup) -> list:
    """The sorted global ranks of every group of ``group``'s kind (each rank's ``group``, gathered; e.g. megatron's
    model-parallel groups), sorted: the same list on every rank. Collective over the world."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, tuple(sorted(dist.get_process_group_ranks(group))))
    return sorted(set(every))


def cpu_wait_group(group: dist.ProcessGroup, timeout: datetime.timedelta = WAIT_TIMEOUT, groups=None):
    """A gloo group of the same ranks as this rank's ``group``, with its own ``timeout``, to wait in (module doc).
    Collective over the world: every rank creates every group of that kind (``groups``, default ``every_group``), in
    one order, as ``dist.new_group`` requires."""
    mine = tuple(sorted(dist.get_process_group_ranks(group)))
    twin = None
    for ranks in (every_group(group) if groups is None else groups):
        made = dist.new_group(list(ranks), backend="gloo", timeout=timeout)
        if ranks == mine:
            twin = made
    return twin
