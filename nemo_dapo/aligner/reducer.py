"""The step loop's ``Reducer`` over NeMo-Aligner's data-parallel group.

The loop runs once per data-parallel (DP) rank; the ranks of one tensor/pipeline-parallel group see the same data
and compute the same numbers. ``megatron.reduction.DPReducer`` does the reductions on CPU tensors, which the gloo
backend accepts; a NeMo job on GPUs runs NCCL, which reduces only CUDA tensors, so this subclass moves each tensor to
the backend's device for the collective and returns it where it came from.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from nemo_dapo.megatron.reduction import DPReducer


def collective_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """The device a collective on ``group`` needs: the current CUDA device for NCCL, else the CPU."""
    backend = dist.get_backend(group)
    if backend == "nccl" or (isinstance(backend, str) and "nccl" in backend and "gloo" not in backend):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class DataParallelReducer(DPReducer):
    """``Reducer`` (core/types.py) over megatron's DP group, on any backend. ``rank``/``world_size``: DP rank/size."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None):
        super().__init__(group)
        self.device = collective_device(self.group)

    def _reduce(self, x: torch.Tensor, op) -> torch.Tensor:
        x = torch.as_tensor(x)
        if self.device.type == "cpu" or self.world_size == 1:
            return super()._reduce(x, op)
        return super()._reduce(x.to(self.device), op).to(x.device)
