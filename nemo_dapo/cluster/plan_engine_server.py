"""`nemo-dapo plan` for the in-flight engine servers (``trainer.dapo.rollout_engine`` trtllm | vllm): the engine
layout from ``trainer.dapo.engine_server``, per-GPU memory of the two colocated phases, the engine's concurrency and
the refit / sleep / wake time. Imports nothing of NeMo, Megatron or torch. All figures are ESTIMATES.

Layout: engines of TP x PP GPUs tile each node (the validator's ``_engine_server`` rule, reused, refuses a layout
that does not), so engines = world / (TP x PP). MoE experts are split over EP x moe-TP = engine TP (TensorRT-LLM:
``moe_tensor_parallel_size x moe_expert_parallel_size = tensor_parallel_size``), dense weights over TP; both over PP.

Memory (colocated; containers/dapo.sbatch starts the servers before the trainer): the KV pool is
``free_gpu_memory_fraction`` x what is free when the engine starts (GPU memory - engine weights - engine workspace -
CUDA context). Generating: training weights + main grads + Adam (0 when offloaded) + engine weights + KV pool +
workspace + context. Training: training state + activations + logits + context, plus the sleeping engine: sleep
level 0 keeps weights and KV, 1 frees the KV, 2 frees the weights too (workspace kept, GUESS). A phase over the
budget is refused (``PlanError`` naming the key and the fix), never reported as a plan.

Concurrency C = min(max_batch_size, max_num_tokens, KV admission, requests). KV admission follows
``engine_server.capacity_scheduler`` (the value the launcher passes to the engine): ``guaranteed_no_evict``
(TensorRT-LLM's own default) admits a request only if its blocks up to the cap fit, pool / (prompt + l_max);
``max_utilization`` (the YAML's; vLLM's on-demand paging behaves alike) admits at the context, pool / the mean
in-flight context. With block reuse the G samples of a prompt share its
blocks, so a request holds prompt / G of them.

Refit: every step the whole model (2 B/param) is gathered in Hugging Face names over TP, PP and EP and handed to
each engine through shared memory: bytes / ``handover_gb_per_s`` (engines refit in parallel). Sleep and wake cost
``sleep_wake_s``; level 2 also restores the engine weights' memory before the refit (bytes / ``pcie_gb_per_s``).
"""
from __future__ import annotations

import math

from nemo_dapo.cluster.plan_generation import PlanError, engine_memory

GB = 1e9
MB = 1 << 20
SCHEDULERS = ("guaranteed_no_evict", "max_utilization")
KEY = "trainer.dapo.engine_server"


def server_layout(cfg: dict, arch, world: int) -> dict:
    """Engine layout and options of ``trainer.dapo.engine_server``, read strictly (a missing key is an error naming
    it: the values are the YAML's, as the launcher passes them to the engines); the validator refuses bad layouts."""
    from nemo_dapo.cluster.config_load import select
    from nemo_dapo.cluster.config_validate import _engine_server, sizes
    from nemo_dapo.cluster.engine_options import EngineOptionsError, read_server

    problems = list(_engine_server(cfg, sizes(cfg)))
    if problems:
        raise PlanError("; ".join(problems))
    if select(cfg, f"{KEY}.placement", "colocated") == "separate":  # the phases below are those of shared GPUs
        raise PlanError(f"{KEY}.placement=separate: this plan models engines on the training GPUs; plan the recipe "
                        "as it is (placement colocated) to see the disaggregated layouts, trainer and engine nodes "
                        "apart, printed beside it")
    try:
        srv = read_server(cfg)
    except EngineOptionsError as e:
        raise PlanError(str(e)) from None
    tp, pp, ep = srv["tensor_parallel_size"], srv["pipeline_parallel_size"], srv["expert_parallel_size"]
    if ep > 1 and not arch.is_moe:
        raise PlanError(f"{KEY}.expert_parallel_size={ep} for a dense model; fix: set it to 1")
    if arch.is_moe and arch.num_moe_experts % ep:
        raise PlanError(f"{KEY}.expert_parallel_size={ep} does not divide the {arch.num_moe_experts} experts; "
                        "fix: pick an EP that divides them")
    return {"tp": tp, "pp": pp, "ep": ep, "engines": world // (tp * pp),
            "per_node": select(cfg, "trainer.devices", 1) // (tp * pp),
            "max_batch_size": srv["max_batch_size"], "max_num_tokens": srv["max_num_tokens"],
            "max_seq": srv["max_seq_len"], "fraction": srv["free_gpu_memory_fraction"],
            "block_reuse": bool(srv["enable_block_reuse"]), "sleep_level": srv["sleep_level"],
            "bucket_mb": _bucket_mb(select(cfg, f"{KEY}.bucket_mb")),
            "capacity_scheduler": srv["capacity_scheduler"]}


def _bucket_mb(value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PlanError(f"{KEY}.bucket_mb={value!r} must be an integer >= 1 (MiB per weight-update bucket)")
    return value


def gather_buffer_bytes(*, rows: float, owners: int, l_max: int, logprobs: bool = True) -> float:
    """Device bytes of the model-parallel results exchange (aligner/engine_generation.broadcast_generation: each
    owner broadcasts its part in turn as tensors, so the transient is the largest owner part): ceil(rows / owners)
    rows of int64 response ids (R + 1 wide with the length), an fp32 mask and fp32 log-probs, R = the widest
    response, at most l_max (the formula its author gave in the project's notes)."""
    return math.ceil(rows / owners) * (8 * (l_max + 1) + 4 * l_max * (1 + int(logprobs)))


def server_phases(arch, layout: dict, train: dict, *, offloaded: dict, gpu, budget: float, a: dict,
                  gather: float = 0.0) -> tuple:
    """({"train", "refit", "generate"}: {part: bytes}, KV facts) per GPU; refuses a phase over ``budget``.

    ``offloaded``: which training-state parts are on the host while the engine generates ({"optimizer": True} for
    Adam offload, all three for model.dapo.offload_training_state); the refit keeps the weights it gathers
    (aligner/training_offload.py offloads them after it); ``gather``: the results-gather buffer."""
    eng = engine_memory(arch, gen_tp=layout["tp"], gen_pp=layout["pp"], batch=0, max_seq=1)
    weights, kv_per_token = eng["engine_weights"], eng["kv_per_token"]
    workspace, reserved = a["engine_workspace_gb"] * GB, a["cuda_reserved_gb"] * GB
    free_at_start = gpu.memory_gb * GB - weights - workspace - reserved
    kv = layout["fraction"] * free_at_start
    resident = {k: 0.0 if offloaded.get(k) else train[k] for k in ("weights", "grads", "optimizer")}
    generate = {**resident, "engine_weights": weights, "kv_cache": kv, "engine_workspace": workspace,
                "results_gather": gather, "cuda_reserved": reserved}
    room = budget - (sum(generate.values()) - kv)
    if sum(generate.values()) > budget:
        most = math.floor(100 * room / free_at_start) / 100  # floored: the fraction printed must fit
        fix = (f"lower {KEY}.free_gpu_memory_fraction to <= {most:.2f}" if room > 0 else
               f"raise {KEY}.tensor_parallel_size x pipeline_parallel_size (engine weights {weights / GB:.1f} GB/GPU)"
               " or set model.dapo.offload_training_state=True (or offload_adam_states with apex distributed Adam)")
        raise PlanError(f"generating phase needs {sum(generate.values()) / GB:.1f} GB/GPU > budget "
                        f"{budget / GB:.1f} GB: the KV pool of {KEY}.free_gpu_memory_fraction={layout['fraction']} "
                        f"x {free_at_start / GB:.1f} GB free at engine start = {kv / GB:.1f} GB does not fit next to "
                        f"{(budget - room) / GB:.1f} GB of training state, engine and results exchange; fix: {fix}")
    pool_tokens = kv / kv_per_token
    if pool_tokens < layout["max_seq"]:
        raise PlanError(f"the KV pool holds {pool_tokens:.0f} tokens per engine < one request of {KEY}.max_seq_len="
                        f"{layout['max_seq']}; fix: raise {KEY}.free_gpu_memory_fraction or the engine TP")
    level = layout["sleep_level"]
    asleep = {0: {"engine_weights": weights, "kv_cache": kv}, 1: {"engine_weights": weights}, 2: {}}[level]
    # the workspace stays at every level: the engines' sleep frees the KV cache and (level 2) the weights only
    training = {**{k: v for k, v in train.items()}, **asleep, "engine_workspace": workspace, "cuda_reserved": reserved}
    if sum(training.values()) > budget:
        fix = f"set {KEY}.sleep_level={level + 1} (frees {'the KV cache' if level == 0 else 'the engine weights'})" \
            if level < 2 else "use full recompute or a larger training TP/PP"
        raise PlanError(f"training phase with the engine at {KEY}.sleep_level={level} needs "
                        f"{sum(training.values()) / GB:.1f} GB/GPU > budget {budget / GB:.1f} GB; fix: {fix}")
    # Refit (after the training peak is released, KV still asleep at levels 1 and 2; level 0 never frees it): the
    # training state as while generating but the weights, which the gather reads, the engine's weights (restored
    # first at sleep level 2), a bucket being gathered on the trainer's device and one being loaded on the engine's
    # (bucket_mb each).
    refit = {**resident, "weights": train["weights"], "engine_weights": weights,
             "refit_buckets": 2 * layout["bucket_mb"] * MB, **({"kv_cache": kv} if level == 0 else {}),
             "engine_workspace": workspace, "cuda_reserved": reserved}
    if sum(refit.values()) > budget:
        raise PlanError(f"refit phase needs {sum(refit.values()) / GB:.1f} GB/GPU > budget {budget / GB:.1f} GB "
                        f"(training state {sum(resident.values()) / GB:.1f} + engine weights {weights / GB:.1f} + "
                        f"buckets); fix: lower {KEY}.bucket_mb, set model.dapo.offload_training_state, or raise "
                        f"{KEY}.tensor_parallel_size")
    return ({"train": training, "refit": refit, "generate": generate},
            {"kv_per_token": kv_per_token, "pool_tokens": pool_tokens, "free_at_start": free_at_start})


def concurrency(layout: dict, kv: dict, *, scheduler: str, prompt: float, l_max: int, mean_context: float,
                group_size: int, requests: float) -> dict:
    """Requests in flight per engine and which limit binds (module docstring)."""
    if scheduler not in SCHEDULERS:
        raise PlanError(f"{KEY}.capacity_scheduler={scheduler!r} must be one of {SCHEDULERS}")
    shared_prompt = prompt / group_size if layout["block_reuse"] else prompt
    per_request = shared_prompt + (l_max if scheduler == "guaranteed_no_evict" else mean_context - prompt)
    limits = {"max_batch_size": layout["max_batch_size"], "max_num_tokens": layout["max_num_tokens"],
              f"KV pool ({scheduler})": math.floor(kv["pool_tokens"] / per_request), "requests": math.ceil(requests)}
    binding = min(limits, key=limits.get)
    return {"slots": max(1, limits[binding]), "binding": binding, "limits": limits, "per_request": per_request,
            "kv_needed": layout["max_batch_size"] * mean_context * kv["kv_per_token"]}


def server_overhead(arch, layout: dict, a: dict) -> dict:
    """Seconds per step of the refit (gather + shared-memory handover) and of sleep / wake."""
    model_bytes = 2 * arch.total_params()
    out = {"refit": model_bytes / (a["handover_gb_per_s"] * GB), "sleep_wake": 0.0}
    if layout["sleep_level"]:
        out["sleep_wake"] = a["sleep_wake_s"]
        if layout["sleep_level"] == 2:
            out["sleep_wake"] += model_bytes / (layout["tp"] * layout["pp"]) / (a["pcie_gb_per_s"] * GB)
    return out


def format_server(layout: dict, kv: dict, conc: dict, engine: str, scheduler: str) -> list:
    """Report lines of the engine-server layout and its concurrency."""
    import textwrap

    limits = ", ".join(f"{k} {v}" for k, v in conc["limits"].items())
    lines = [f"generation  {engine} engine servers TP{layout['tp']} PP{layout['pp']} EP{layout['ep']} x "
            f"{layout['engines']} ({layout['per_node']}/node, colocated), max_seq_len {layout['max_seq']}, "
            f"sleep level {layout['sleep_level']}",
            f"            KV pool {layout['fraction']} x {kv['free_at_start'] / GB:.1f} GB free at engine start = "
            f"{kv['pool_tokens'] / 1e6:.2f} M tokens/engine ({kv['kv_per_token'] / 1024:.0f} KiB/token/GPU); "
            f"the in-flight batch needs {conc['kv_needed'] / GB:.1f} GB/GPU (max_batch_size x mean context)",
            f"            in flight {conc['slots']}/engine, bound by {conc['binding']} (limits: {limits}; "
            f"{conc['per_request']:.0f} tokens reserved per request, capacity scheduler {scheduler}"
            f"{', prompt blocks shared by the group' if layout['block_reuse'] else ''})"]
    return [wrapped for line in lines for wrapped in textwrap.wrap(line, 119, subsequent_indent=" " * 14)]
