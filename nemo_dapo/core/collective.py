"""Where a tensor must live for a torch.distributed collective (torch only).

NCCL reduces only CUDA tensors; gloo (the CPU tests, and the CPU half of a mixed ``cpu:gloo,cuda:nccl`` group)
takes CPU tensors. Every layer that runs a collective asks here, so the rule exists once.
"""
from __future__ import annotations

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
