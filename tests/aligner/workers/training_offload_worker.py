"""torchrun worker (2 ranks, gloo on CPU; DEVICE=cuda on GPUs): the training-state offload
(nemo_dapo/megatron/state_offload.py through nemo_dapo/aligner/training_offload.py) between two training steps.

CASE=nemo: the DAPO actor built by NeMo 2.1 (tests/support/nemo_cpu.py) at TP=2, trained by ActorPolicy with torch
  AdamW (the optimizer NeMo's non-distributed path wraps), offloaded through ``training_state_offload(actor)``.
CASE=mcore: a megatron-core GPTModel in megatron-core's DDP with the distributed optimizer (``param_data`` /
  ``grad_data`` buffers, the parameters and main grads views into them, Adam states sharded over DP=2), the layout
  ``mcore_distributed_optim`` gives NeMo (the Qwen3-235B recipes), trained by tests/support/megatron_policy.py.
Both: twin models A and B with the same initial weights. A: step 1, offload in the refit's two stages (grads +
optimizer, then weights), onload, step 2; B: step 1, step 2. Recorded per rank: the storage bytes left after the
offload, the bytes the offload reports against an independent count of the tensors, bit-identity after onload, the
two steps' losses / grad norms and the final weights and optimizer states of A against B; on CUDA also
torch.cuda.memory_allocated before / after. Writes $OUT_DIR/<CASE>_rank<r>.json.
"""
import json
import os

CASE, DEVICE = os.environ["CASE"], os.environ.get("DEVICE", "cpu")
if CASE == "mcore" and DEVICE == "cpu":
    os.environ.setdefault("SHIM_LEVEL", "4")  # megatron's optimizer checks param.type() == 'torch.cuda.*'
if CASE == "nemo":
    from tests.support import nemo_cpu  # noqa: F401  (patches first)
else:
    import tests.support.megatron_cpu_shim  # noqa: F401  (before megatron)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from nemo_dapo.megatron.state_offload import PARTS, StateOffload, state_tensors  # noqa: E402
from tests.support.policy_inputs import NoSchedule, random_rollout  # noqa: E402

OUT = os.environ["OUT_DIR"]


def snapshot(chunks, optimizer) -> dict:
    """Clones of every state tensor by part, in state_tensors' order (same objects order for A before / after)."""
    return {p: [t.detach().clone() for t in ts] for p, ts in state_tensors(chunks, optimizer).items()}


def equal(a: dict, b: dict) -> bool:
    return all(len(a[p]) == len(b[p]) and all(torch.equal(x, y) for x, y in zip(a[p], b[p])) for p in PARTS)


def independent_bytes(chunks, optimizer, device) -> int:
    """The training state's bytes counted without the offload's storage walk: each distinct storage once."""
    seen = {}
    for ts in state_tensors(chunks, optimizer).values():
        for t in ts:
            if t.device == device:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


# ---- the two models ----------------------------------------------------------------------------------------------
def nemo_pair():
    from nemo_dapo.aligner.trainer import ActorPolicy
    from nemo_dapo.core.settings import build_loss
    from nemo_dapo.aligner.trainer import algorithm_settings

    tok = nemo_cpu.tiny_tokenizer_dir(os.path.join(OUT, "tok"))
    _, a = nemo_cpu.build_actor(2, 1, mbs=2, gbs=4, tokenizer_dir=tok, optim={"name": "sgd", "lr": 0.0})
    _, b = nemo_cpu.build_actor(2, 1, mbs=2, gbs=4, tokenizer_dir=tok, trainer=a.trainer,
                                optim={"name": "sgd", "lr": 0.0})
    b.model.load_state_dict(a.model.state_dict())
    loss_fn = build_loss(algorithm_settings(a.cfg).loss, max_new_tokens=int(a.cfg.dapo.length_params.max_length))
    out = []
    for actor in (a, b):
        actor.loss_fn = loss_fn
        actor.setup_optimizer_param_groups()  # NeMo's groups (what clip_gradients reads the parameters from)
        opt = torch.optim.AdamW(actor._optimizer_param_groups, lr=1e-2, weight_decay=0.01)
        actor._optimizer = opt  # what training_state_offload(actor) walks (NeMo sets it in configure_optimizers)

        policy = ActorPolicy(actor, opt, NoSchedule(), gradient_clip_val=1.0)
        chunks = list(actor.model) if isinstance(actor.model, list) else [actor.model]
        out.append((policy, chunks, opt, actor))
    return out, loss_fn


def mcore_pair():
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from nemo_dapo.core.loss import make_loss_fn
    from tests.support.megatron_model import GPTSpec, build_gpt_model, initialize_parallel
    from tests.support.megatron_policy import MegatronPolicy

    initialize_parallel(1, 1, 1, backend="nccl" if DEVICE == "cuda" else "gloo")  # DP = world
    spec = GPTSpec(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                   ffn_hidden_size=48, max_sequence_length=64)
    models = [build_gpt_model(spec) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    out = []
    for m in models:
        ddp = DistributedDataParallel(m.config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=True), m)
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01, clip_grad=1.0,
                                                     bf16=False, fp16=False, use_distributed_optimizer=True), [ddp])
        out.append((MegatronPolicy(ddp, opt, micro_batch_size=2, max_grad_norm=1.0), [ddp], opt, None))
    return out, make_loss_fn(eps_low=0.2, eps_high=0.28)


def train(policy, batch, loss_fn) -> dict:
    batch.old_logp = policy.logprobs(batch)[0]
    m = policy.train_step(batch, norm=float(batch.num_tokens()), loss_fn=loss_fn)
    return {"loss": float(m["loss"]), "grad_norm": float(m.get("grad_norm", float("nan")))}


def main():
    if CASE == "mcore":
        if not dist.is_initialized():
            dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
        if DEVICE == "cuda":
            torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
        pair, loss_fn = mcore_pair()
    else:
        pair, loss_fn = nemo_pair()
    device = torch.device("cuda", torch.cuda.current_device()) if DEVICE == "cuda" else torch.device("cpu")
    from megatron.core import parallel_state

    rank, dp_rank = dist.get_rank(), parallel_state.get_data_parallel_rank()
    # each DP rank its own share, TP ranks alike
    batches = [random_rollout(seed=dp_rank), random_rollout(seed=10 + dp_rank)]
    (pa, ca, oa, actor_a), (pb, cb, ob, _) = pair
    res = {"steps_a": [train(pa, batches[0], loss_fn)], "steps_b": [train(pb, batches[0], loss_fn)]}

    if actor_a is not None:  # the aligner binding the engine generator uses
        from nemo_dapo.aligner.training_offload import AFTER_REFIT, BEFORE_REFIT, training_state_offload

        off = training_state_offload(actor_a, device=device)
    else:
        from nemo_dapo.aligner.training_offload import AFTER_REFIT, BEFORE_REFIT

        off = StateOffload(ca, oa, device=device)
    before = snapshot(ca, oa)
    ids = [id(t) for ts in state_tensors(ca, oa).values() for t in ts]  # the objects the model and optimizer hold
    want_bytes = independent_bytes(ca, oa, device)
    res["ddp_buffers"] = sum(len(getattr(c, "buffers", []) or []) for c in ca if isinstance(getattr(c, "buffers",
                                                                                                   None), list))
    res["parts_counted"] = {p: len(v) for p, v in off.storages().items()}
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        alloc0 = torch.cuda.memory_allocated()
    stage1 = off.offload(BEFORE_REFIT)
    res["weights_after_stage1"] = sum(t.untyped_storage().nbytes() for t in state_tensors(ca, oa)["weights"]
                                      if t.device == device)
    stage2 = off.offload(AFTER_REFIT)
    again = off.offload()  # a second offload (e.g. a validation after the refit) moves nothing
    if DEVICE == "cuda":
        res["allocated_drop"] = alloc0 - torch.cuda.memory_allocated()
        res["storages"] = sum(res["parts_counted"].values())
    left = {p: sum(t.untyped_storage().nbytes() for t in ts if t.device == device)
            for p, ts in state_tensors(ca, oa).items()}
    res.update(stage_bytes=[stage1, stage2, again], want_bytes=want_bytes, left_bytes=left,
               offloaded_parts=list(off.offloaded_parts), reported=off.offloaded_bytes)
    onloaded = off.onload()
    res.update(onloaded=onloaded, onload_again=off.onload(), bit_identical=equal(before, snapshot(ca, oa)),
               same_objects=ids == [id(t) for ts in state_tensors(ca, oa).values() for t in ts])
    res["stats"] = off.pop_stats()

    res["steps_a"].append(train(pa, batches[1], loss_fn))
    res["steps_b"].append(train(pb, batches[1], loss_fn))
    res["final_equal"] = equal(snapshot(ca, oa), snapshot(cb, ob))
    res["moved"] = not equal(before, snapshot(ca, oa))  # step 2 changed the weights (the comparison can fail)
    with open(os.path.join(OUT, f"{CASE}_rank{rank}.json"), "w") as f:
        json.dump(res, f, indent=1)
    dist.barrier()


if __name__ == "__main__":
    main()
