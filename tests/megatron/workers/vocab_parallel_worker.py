"""torchrun worker for tests/megatron/test_vocab_parallel.py (gloo, CPU, 2 ranks).

Runs every case of CASES at TP=2 and then at TP=1 (DP=2), plus one case with an explicit 2-rank group while
megatron's TP group has size 1 (proves ``group=`` is honoured). Each rank saves its inputs, outputs and gradients to
``$OUT_DIR/rank{r}.pt``; the test compares them with the single-device reference, so no tolerance lives here.
"""
import os

import tests.support.megatron_cpu_shim  # noqa: F401  (before megatron: test-only CUDA patches)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402

from nemo_dapo.megatron.vocab_parallel import (vocab_parallel_logits_logprobs_entropy,  # noqa: E402
                                               vocab_parallel_logprobs_entropy)

V, H = 48, 8
# name: (leading shape, chunk_size, temperature, masked, reduce_grad_hidden, use the logits entry point, logit scale)
CASES = {
    "n13_chunk5": ((13,), 5, 1.0, False, True, False, 1.0),
    "bt_mask_temp": ((3, 5), 4, 0.8, True, True, False, 1.0),
    "n1": ((1,), 4, 1.0, False, True, False, 1.0),
    "n0": ((0,), 4, 1.0, False, True, False, 1.0),
    "sp_partial_grad": ((9,), 4, 1.0, False, False, False, 1.0),
    "logits_entry": ((4, 3), 5, 1.0, False, True, True, 1.0),
    "large_logits": ((6,), 4, 1.0, False, True, False, 150.0),  # exp() over- or underflows without a common max
}


def make_case(lead, dtype, seed, scale):
    g = torch.Generator().manual_seed(seed)  # same on every rank: the TP ranks see replicated data
    hidden = (torch.randn(*lead, H, generator=g) * scale).to(dtype)
    weight = (torch.randn(V, H, generator=g) / H ** 0.5).to(dtype)
    targets = torch.randint(0, V, lead, generator=g)
    mask = (torch.rand(lead, generator=g) < 0.7).float()
    a, b = torch.randn(lead, generator=g), torch.randn(lead, generator=g)
    return dict(hidden=hidden, weight=weight, targets=targets, mask=mask, a=a, b=b)


def run_case(inputs, chunk, temperature, masked, reduce_grad_hidden, logits_entry, group=None):
    if group is None:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        tp = parallel_state.get_tensor_model_parallel_world_size()
    else:
        tp_rank, tp = dist.get_rank(group), dist.get_world_size(group)
    w_shard = inputs["weight"].chunk(tp, dim=0)[tp_rank].clone().requires_grad_()
    hidden = inputs["hidden"].clone().requires_grad_()
    if logits_entry:
        logits = (hidden @ w_shard.t()).detach().requires_grad_()
        logp, ent = vocab_parallel_logits_logprobs_entropy(logits, inputs["targets"], chunk_size=chunk,
                                                           temperature=temperature, group=group)
    else:
        logp, ent = vocab_parallel_logprobs_entropy(hidden, w_shard, inputs["targets"],
                                                    mask=inputs["mask"] if masked else None, chunk_size=chunk,
                                                    temperature=temperature, group=group,
                                                    reduce_grad_hidden=reduce_grad_hidden)
    ((logp * inputs["a"]).sum() + (ent * inputs["b"]).sum()).backward()
    out = dict(logp=logp.detach(), ent=ent.detach(), tp=tp, tp_rank=tp_rank)
    if logits_entry:
        out["grad_logits"] = logits.grad
    else:
        out["grad_hidden"], out["grad_weight"] = hidden.grad, w_shard.grad
    return out


def run_all(results, tp_label, group=None, names=None):
    for i, (name, (lead, chunk, temp, masked, rgh, logits_entry, scale)) in enumerate(CASES.items()):
        if names is not None and name not in names:
            continue
        for dtype in (torch.float32, torch.bfloat16):
            inputs = make_case(lead, dtype, seed=100 + i, scale=scale)
            key = f"{tp_label}/{name}/{str(dtype).split('.')[-1]}"
            results[key] = dict(inputs=inputs, masked=masked, temperature=temp,
                                **run_case(inputs, chunk, temp, masked, rgh, logits_entry, group))


def main():
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    results = {}
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    run_all(results, "tp2")
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    run_all(results, "tp1")
    run_all(results, "explicit_group", group=dist.new_group([0, 1]), names={"n13_chunk5"})
    parallel_state.destroy_model_parallel()
    torch.save(results, os.path.join(os.environ["OUT_DIR"], f"rank{dist.get_rank()}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
