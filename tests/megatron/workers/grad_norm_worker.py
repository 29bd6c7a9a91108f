"""torchrun worker (2 ranks, gloo, DP = 2; EP = 2 for the MoE model): the gradient norm megatron-core's optimizer steps
with, read before the step (``nemo_dapo.megatron.step.megatron_grad_norm``), for the optimizer NeMo builds for
``mcore_distributed_optim``: megatron-core's DDP with the distributed optimizer, a dense model (one optimizer) and
an MoE model (the ``ChainedOptimizer`` of dense and expert parameters), the latter wrapped in NeMo's
``McoreDistributedOptimizer`` as the trainer receives it.

Per case: one backward; the norm before the step against (a) the norm megatron-core's own ``step`` returns right
after and (b) the test support's independent sum over the all-reduced gradients of a twin model (same weights, same
data) in DDP without the distributed optimizer; then a NaN planted in one local gradient element on rank 0 before
the DP reduction: the norm is non-finite on every rank, ``skip_update`` skips, and megatron-core's own step (shown for
the record) leaves NaN weights. Writes $OUT_DIR/rank<r>.json.
"""
import json
import math
import os

os.environ.setdefault("SHIM_LEVEL", "4")  # megatron's optimizer checks param.type() == 'torch.cuda.*'
import tests.support.megatron_cpu_shim  # noqa: F401,E402  (before megatron)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402

from nemo_dapo.megatron.step import megatron_grad_norm, skip_update  # noqa: E402
from tests.support.megatron_model import (GPTSpec, build_gpt_model, destroy_parallel,  # noqa: E402
                                         initialize_parallel)
from tests.support.megatron_policy import grad_norm  # noqa: E402


def backward(ddp, seed: int, plant_nan: bool = False) -> None:
    ddp.zero_grad_buffer()
    g = torch.Generator().manual_seed(seed + 7 * dist.get_rank())  # each DP rank its own data
    ids = torch.randint(0, 64, (2, 12), generator=g)
    pos = torch.arange(12).unsqueeze(0).expand(2, -1)
    loss = ddp(ids, pos, None, labels=ids.roll(-1, 1))  # [b, s] per-token losses
    loss.float().mean().backward()
    if plant_nan and dist.get_rank() == 0:  # as a backward overflow would leave it, before the DP reduction
        next(p for p in ddp.parameters() if p.requires_grad).main_grad.view(-1)[0] = float("nan")
    ddp.finish_grad_sync()  # DP reduction into the grad buffers, as the schedule's finalize does


def wrapped(model, distributed: bool):
    return DistributedDataParallel(model.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed), model)


def case(num_experts):
    spec = GPTSpec(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                   ffn_hidden_size=48, max_sequence_length=16, num_experts=num_experts)
    model, twin = build_gpt_model(spec), build_gpt_model(spec)
    twin.load_state_dict(model.state_dict())
    ddp, ddp_twin = wrapped(model, True), wrapped(twin, False)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0, bf16=False, fp16=False,
                                                 use_distributed_optimizer=True), [ddp])
    out = {"optimizer": type(opt).__name__}
    if num_experts:
        from nemo.core.optim.mcore_optim import McoreDistributedOptimizer

        opt = McoreDistributedOptimizer(opt)  # what NeMo's actor holds; the trainer unwraps .mcore_optimizer
    mcore = getattr(opt, "mcore_optimizer", opt)

    backward(ddp, 0)
    backward(ddp_twin, 0)
    out["independent"] = grad_norm(ddp_twin)
    out["ours"] = megatron_grad_norm(mcore)
    out["ours_again"] = megatron_grad_norm(mcore)  # reading it twice changes nothing
    _, out["megatrons"], _ = mcore.step()
    out["megatrons"] = float(out["megatrons"])

    backward(ddp, 1, plant_nan=True)
    norm = megatron_grad_norm(mcore)
    out["nan_norm_finite"] = math.isfinite(norm)
    out["nan_skipped"] = skip_update(0.5, norm)[1]  # a finite loss: only the norm tells
    mcore.step()
    out["weights_finite_after_megatrons_step"] = all(bool(torch.isfinite(p).all()) for p in ddp.parameters())
    return out


def main():
    dist.init_process_group("gloo")
    initialize_parallel(1, 1, 1)
    res = {"dense": case(None)}
    destroy_parallel()
    initialize_parallel(1, 1, 2)  # EP = 2: the expert parameters get an optimizer of their own
    res["moe"] = case(4)
    with open(os.path.join(os.environ["OUT_DIR"], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
