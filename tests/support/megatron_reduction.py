"""Test-only megatron helpers beside nemo_dapo.megatron.reduction and refit_gather: megatron's per-token loss path
(the 3-tuple, proven equal to the 2-tuple scaling the product uses), the global valid-token count from local masks,
and the whole model's gathered state dict."""
from __future__ import annotations

from typing import Iterable, Optional, Union

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from nemo_dapo.core.collective import collective_device
from nemo_dapo.megatron.refit_gather import iter_refit_buckets


def per_token_output(token_loss_sum: torch.Tensor, local_tokens: Union[int, torch.Tensor], metrics: dict) -> tuple:
    """The 3-tuple for megatron's per-token path (``config.calculate_per_token_loss=True`` with megatron DDP):
    the micro-batch's UNNORMALISED token-loss sum and its local valid-token count; megatron divides the gradients by
    the count summed over micro-batches and DP ranks. Token-mean losses only (see the module doc for its limits)."""
    count = torch.as_tensor(local_tokens).to(torch.int).reshape(())
    return token_loss_sum, count, {**metrics, "loss_sum": token_loss_sum.detach()}


def global_token_count(local_masks: Iterable[torch.Tensor], group: Optional[dist.ProcessGroup] = None) -> int:
    """N: valid tokens of all this rank's micro-batch masks, summed over ``group`` (default: megatron's DP x CP
    group; with CP every rank passes the masks of its own sequence shard, so the sum counts each token once).
    Summed in int64, exact at any size."""
    local = torch.zeros((), dtype=torch.int64)
    for m in local_masks:
        local += m.bool().sum().cpu()
    if group is None and parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        local = local.to(collective_device(group))
        dist.all_reduce(local, group=group)
    return int(local)


def full_state_dict(model, *, dtype: Optional[torch.dtype] = None, bucket_bytes: int = 1 << 28) -> dict:
    """{full name: tensor} of the whole model on every rank (TP = EP = PP = 1 layout), e.g. for export."""
    out = {}
    for bucket in iter_refit_buckets(model, bucket_bytes=bucket_bytes, infer_tp_size=1, infer_tp_rank=0,
                                     dtype=dtype):
        out.update(bucket)
    return out
