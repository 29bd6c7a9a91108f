"""Per-GPU memory of every phase and the step time of a DAPO run on Megatron + TensorRT-LLM (NeMo-Aligner path).

Everything here is an ESTIMATE from closed-form arithmetic, not a measurement; it imports nothing of NeMo, Megatron
or torch, so ``nemo-dapo plan`` runs anywhere. The pieces:

* ``plan_shapes.py``: GPUs, architectures (``plan.arch``, or ``plan.arch.preset``) and training layouts;
  ``plan_assumptions.py``: every ``plan.assume`` default with its reason and range.
* ``plan_model.py``: training memory and FLOPs
  (6N per trained token, 8N with full recompute; a forward 2N per log-prob pass: the old policy, plus a KL
  reference policy when ``plan.reference_logprob_pass`` is set; DAPO has none).
* ``plan_engine_server.py``: the engine servers' layout and the three colocated phases (train with the engine
  asleep, refit with the KV asleep, generate), the results-gather buffer, concurrency, refit and sleep / wake time.
* ``plan_generation.py``: decode steps from the bytes each GPU reads (its weight shard + the KV it attends over) at
  its memory bandwidth, or, for an engine without CUDA graphs (``plan.cuda_graphs``), the host's kernel launches
  where they take longer, and the generation time of one step under static, in-flight and streaming engines.
* ``plan_async.py``: the same step under partial rollouts and the disaggregated one-step-off layout (trainer
  nodes vs engine nodes, the network refit, the overlap bounded by ``plan.async.max_staleness``).
* ``plan_calibration.py``: the same planner run on published runs (benchmarks/calibration/); the error band it
  finds is printed beside every estimate (``plan_report.py`` prints the plan).

Training state while the engine refits and generates: what the trainer moves, read from the keys the trainer
reads. Adam states are on the host with ``model.dapo.offload_adam_states`` and apex distributed Adam (NeMo-Aligner's
own offload); ``model.dapo.offload_training_state`` moves grads and optimizer states before the refit and the
weights after it (aligner/training_offload.py; what NeMo-RL and verl do colocated): the refit holds the weights,
generation none of the state. What is not modelled is refused with the key: an engine that spans nodes,
an unknown GPU, a missing architecture value. Every assumption is printed with its reason; override under
``plan.assume``.
"""
from __future__ import annotations

import math
import sys

from nemo_dapo.cluster.plan_async import layouts, settings as async_settings
from nemo_dapo.cluster.plan_assumptions import (ASSUMPTION_RANGES, ASSUMPTIONS, DEFAULT_ASSUMPTIONS,
                                               EAGER_LAYER_MS_RANGE, LOGPROB_HFU_RATIO)
from nemo_dapo.cluster.plan_engine_server import (concurrency, gather_buffer_bytes, server_layout, server_overhead,
                                                 server_phases)
from nemo_dapo.cluster.plan_generation import (MODEL_LABELS, PlanError, ResponseLengths,
                                              decode_step_seconds, engine_memory, generation_times,
                                              inflight_tokens_per_s_per_gpu, needed_fraction)
from nemo_dapo.cluster.plan_report import format_plan
from nemo_dapo.cluster.plan_model import (ARCH_KEYS, ARCH_PRESETS, FORWARD_SENDS, GPUS, Arch, Gpu, Layout,
                                         default_hfu, expert_alltoall, params_per_gpu, training_memory,
                                         training_seconds, update_sends)
from nemo_dapo.core import engine_registry

__all__ = ["PlanError", "make_plan", "format_plan", "run_cli", "Arch", "Gpu", "GPUS", "Layout", "ARCH_PRESETS",
           "params_per_gpu", "training_memory", "training_seconds", "engine_memory", "decode_step_seconds",
           "inflight_tokens_per_s_per_gpu"]

GB = 1e9
KIB = 1024


def _range_text(low: float, closed: bool, high):
    if high is None:
        return f"a number {'>=' if closed else '>'} {low}"
    return f"a number in {'[' if closed else '('}{low}, {high}]"


def assumption_problems(cfg: dict) -> list:
    """Every ``plan.assume.*`` value that would give a nonsense estimate (a zero rate divides, a negative length
    or a utilisation above 1 is no machine), each naming its key, its range and the default as the fix."""
    from nemo_dapo.cluster.config_load import select

    problems = []
    for key, value in (select(cfg, "plan.assume", {}) or {}).items():
        name = f"plan.assume.{key}"
        if key not in ASSUMPTION_RANGES:
            problems.append(f"{name}: unknown assumption; fix: use one of {', '.join(ASSUMPTION_RANGES)}")
            continue
        low, closed, high = ASSUMPTION_RANGES[key]
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if value is None or (number and (value >= low if closed else value > low) and (high is None or value <= high)):
            continue
        default = DEFAULT_ASSUMPTIONS[key]
        problems.append(f"{name}={value!r} must be {_range_text(low, closed, high)}; fix: set it in range, or to "
                        f"null for the default ({'from the model and GPU' if default is None else default})")
    return problems


def input_problems(cfg: dict) -> list:
    """Inputs that make any estimate meaningless (parallel sizes and node counts that are not integers >= 1,
    assumptions out of range, a ``plan.cuda_graphs`` that is not a boolean): ``nemo-dapo plan`` refuses them before
    planning."""
    from nemo_dapo.cluster.config_load import select
    from nemo_dapo.cluster.config_validate import sizes

    graphs = select(cfg, "plan.cuda_graphs")
    bad = [] if graphs is None or isinstance(graphs, bool) else [
        f"plan.cuda_graphs={graphs!r} must be true, false or null (null: the engine's own, "
        "nemo_dapo/core/engine_registry.py); fix: set one of those"]
    return sizes(cfg)["bad"] + assumption_problems(cfg) + bad


def _need(value, key: str):
    if value is None:
        raise PlanError(f"{key} is not set; `nemo-dapo plan` needs it (see conf/gpt_dapo_actor.yaml, plan.*)")
    return value


def arch_from_config(cfg: dict) -> Arch:
    """``plan.arch``: explicit values, or ``preset`` (ARCH_PRESETS) whose values explicit ones must agree with."""
    spec = dict(cfg.get("plan", {}).get("arch", {}) or {})
    preset_name = spec.pop("preset", None)
    kw = {k: spec.get(k) for k in ARCH_KEYS}
    if preset_name is not None:
        if preset_name not in ARCH_PRESETS:
            raise PlanError(f"plan.arch.preset={preset_name!r} is not one of {sorted(ARCH_PRESETS)}; fix: pick one "
                            "or set plan.arch.* from the model's config.json")
        preset = ARCH_PRESETS[preset_name]
        for k in ARCH_KEYS:
            ours, theirs = kw[k], getattr(preset, k)
            if ours not in (None, False, 0) and ours != theirs:
                raise PlanError(f"plan.arch.{k}={ours!r} disagrees with plan.arch.preset={preset_name} ({theirs!r}); "
                                "fix: drop one of them")
            kw[k] = theirs
        spec["name"] = spec.get("name") or preset.name
    for k in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
              "kv_channels", "vocab_size", *(("moe_ffn_hidden_size", "moe_router_topk") if kw["num_moe_experts"]
                                             else ())):
        value = _need(kw[k], f"plan.arch.{k}")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlanError(f"plan.arch.{k}={value!r} must be an integer >= 1; fix: set it to the "
                            "model's value (its config.json)")
    return Arch(**{k: v for k, v in kw.items() if v is not None}, name=spec.get("name") or "")


def make_plan(cfg: dict) -> dict:
    """Memory per phase and step-time split for a resolved, plain-dict config (see the module docstring)."""
    from nemo_dapo.cluster.config_load import select
    from nemo_dapo.cluster.config_validate import sizes

    s = sizes(cfg)
    bad = input_problems(cfg)
    if bad:
        raise PlanError("; ".join(bad))
    if s["dp"] is None:
        raise PlanError(f"world size {s['world']} is not divisible by TP x PP x CP; run the validator for details")
    gpu_key = str(_need(select(cfg, "plan.gpu"), "plan.gpu")).lower()
    if gpu_key not in GPUS:
        raise PlanError(f"plan.gpu={gpu_key!r} is not one of {sorted(GPUS)}")
    gpu, arch = GPUS[gpu_key], arch_from_config(cfg)
    a = {**DEFAULT_ASSUMPTIONS, **{k: v for k, v in (select(cfg, "plan.assume", {}) or {}).items() if v is not None}}
    layout = Layout(world=s["world"], tp=s["tp"], pp=s["pp"], cp=s["cp"], ep=s["ep"],
                    sequence_parallel=bool(select(cfg, "model.sequence_parallel", False)),
                    etp=select(cfg, "model.expert_tensor_parallel_size"))
    engine = _need(select(cfg, "trainer.dapo.rollout_engine"), "trainer.dapo.rollout_engine")
    if engine not in engine_registry.planned_engines():
        raise PlanError(f"trainer.dapo.rollout_engine={engine!r}: `nemo-dapo plan` models "
                        f"{sorted(engine_registry.planned_engines())} (the others, e.g. 'local', the project's "
                        "small-model engine, are not sized here)")
    if select(cfg, "plan.generate_offload") is not None:  # the validator says so too; a plan must not read it
        from nemo_dapo.cluster.config_validate import GENERATE_OFFLOAD_GONE

        raise PlanError(GENERATE_OFFLOAD_GONE)
    budget = a["usable_fraction"] * gpu.memory_gb * GB
    phases, gen = _memory_phases(cfg, arch, layout, a, gpu=gpu, budget=budget)
    plan = {"gpu": gpu, "gpu_key": gpu_key, "arch": arch, "layout": layout, "assume": a, "phases": phases,
            "budget": budget, "fits": all(sum(p.values()) <= budget for p in phases.values()), "gen": gen}
    plan["time"] = _step_time(cfg, plan)
    if not gen["graphs"] and plan["time"]["gen"]:
        # only the assumption differs; _generation's writes into the shared plan["gen"] (concurrency, scheduler)
        # come from the engine layout alone, so they are rewritten with the same values
        high = {**plan, "assume": {**a, "eager_layer_ms": EAGER_LAYER_MS_RANGE[1]}}
        plan["time"]["eager_high"] = (EAGER_LAYER_MS_RANGE[1], _step_time(cfg, high)["total"])
    plan["async"] = async_settings(cfg)
    plan["run"] = {**{k: select(cfg, f"trainer.dapo.{k}") for k in ("max_steps", "max_epochs", "save_interval")},
                   "save_top_k": select(cfg, "exp_manager.checkpoint_callback_params.save_top_k")}
    plan["layouts"] = layouts(cfg, plan, plan["async"], training_state=training_state, bubble=_pipeline_bubble,
                              step_fn=decode_step_fn(plan))
    return plan


def _offloaded(cfg: dict, optim: str) -> dict:
    """Which training-state parts are on the host while the engine generates (module docstring); the refit keeps
    the weights (plan_engine_server.server_phases)."""
    from nemo_dapo.cluster.config_load import select

    if select(cfg, "model.dapo.offload_training_state"):
        return {"weights": True, "grads": True, "optimizer": True}
    return {"optimizer": bool(select(cfg, "model.dapo.offload_adam_states")) and optim == "distributed_fused_adam"}



def _gen_rows_per_dp(cfg: dict, dp: int) -> float:
    """Responses one data-parallel rank asks for in one generate call: the largest generation batch of prompts
    (dynamic sampling's max_gen_batch_size, else prompts_per_step) x group_size, split over DP."""
    from nemo_dapo.cluster.config_load import select

    ds = "model.dapo.algorithm.dynamic_sampling"
    prompts = select(cfg, "trainer.dapo.prompts_per_step")
    if select(cfg, f"{ds}.enabled", True):
        prompts = max(prompts, select(cfg, f"{ds}.max_gen_batch_size") or select(cfg, f"{ds}.gen_batch_size") or 0)
    return prompts * select(cfg, "model.dapo.algorithm.group_size") / dp


def training_state(cfg: dict, arch: Arch, layout: Layout) -> dict:
    """Bytes per GPU of the training state and one step's activations of ``layout`` (plan_model.training_memory
    with the recipe's micro-batch, recompute, optimizer and log-prob chunk)."""
    from nemo_dapo.cluster.config_load import select
    from nemo_dapo.cluster.config_validate import DISTRIBUTED_OPTIMIZERS

    mbs, gbs = select(cfg, "model.micro_batch_size"), select(cfg, "model.global_batch_size")
    seq = select(cfg, "model.encoder_seq_length")
    tokens = select(cfg, "model.dapo.micro_batch_tokens") or mbs * seq  # packed micro-batches, worst case
    in_flight = min(layout.pp, max(1, gbs // (mbs * layout.dp)))
    return training_memory(arch, layout, seq_tokens=tokens, in_flight=in_flight,
                           recompute=select(cfg, "model.activations_checkpoint_granularity"),
                           distributed_optimizer=select(cfg, "model.optim.name") in DISTRIBUTED_OPTIMIZERS,
                           grad_bytes=2 if select(cfg, "model.optim.grad_sync_dtype") in ("bf16", "fp16") else 4,
                           logprob_chunk=select(cfg, "model.dapo.logprob_chunk_size"))


def _memory_phases(cfg: dict, arch: Arch, layout: Layout, a: dict, *, gpu: Gpu, budget: float) -> tuple:
    """({phase: {part: bytes}}, generation settings) per GPU."""
    from nemo_dapo.cluster.config_load import select

    optim = select(cfg, "model.optim.name")
    train = training_state(cfg, arch, layout)
    trt = select(cfg, "trainer.dapo.trt_llm", {})
    offloaded = _offloaded(cfg, optim)
    gen = {"tp": layout.tp, "pp": 1 if trt.get("reshard") else layout.pp, "trt": bool(trt.get("enable")),
           "engine": _need(select(cfg, "trainer.dapo.rollout_engine"), "trainer.dapo.rollout_engine"),
           "batch": select(cfg, "model.dapo.rollout_micro_batch_size"),
           "max_seq": trt.get("max_input_len", 0) + select(cfg, "model.dapo.length_params.max_length"),
           "offloaded": offloaded}
    graphs = select(cfg, "plan.cuda_graphs")
    gen["graphs"] = engine_registry.ENGINES[gen["engine"]].cuda_graphs if graphs is None else graphs
    if engine_registry.is_served(gen["engine"]):
        srv = server_layout(cfg, arch, layout.world)
        mp = layout.tp * layout.pp * layout.cp
        owners = max(1, mp // (srv["tp"] * srv["pp"]))
        gather = gather_buffer_bytes(rows=_gen_rows_per_dp(cfg, layout.dp), owners=owners,
                                     l_max=select(cfg, "model.dapo.length_params.max_length"))
        phases, kv = server_phases(arch, srv, train, offloaded=offloaded, gpu=gpu, budget=budget, a=a, gather=gather)
        gen.update(tp=srv["tp"], pp=srv["pp"], trt=True, max_seq=srv["max_seq"], server=srv, kv=kv,
                   kv_per_token=kv["kv_per_token"])
        return phases, gen
    engine = {}
    if gen["trt"]:
        engine = engine_memory(arch, gen_tp=gen["tp"], gen_pp=gen["pp"], batch=gen["batch"], max_seq=gen["max_seq"])
        gen["kv_per_token"] = engine.pop("kv_per_token")
        engine["engine_workspace"] = a["engine_workspace_gb"] * GB
    reserve = {"cuda_reserved": a["cuda_reserved_gb"] * GB}
    resident = {k: 0.0 if offloaded.get(k) else train[k] for k in ("weights", "grads", "optimizer")}
    phases = {"train": {**train, **({} if trt.get("unload_engine_train") else engine), **reserve},
              "generate": {**resident, **engine, **reserve}}
    return phases, gen


def _response_lengths(a: dict, l_max: int) -> ResponseLengths:
    try:
        return ResponseLengths(l_max, min(a["mean_response_tokens"], l_max), a["truncated_fraction"])
    except ValueError as e:
        raise PlanError(f"plan.assume.mean_response_tokens / truncated_fraction: {e}") from None


def decode_step_fn(plan: dict):
    """``step_s(batch, context)`` of one engine of ``plan`` with its assumptions (plan_generation.py)."""
    arch, gpu, a, g = plan["arch"], plan["gpu"], plan["assume"], plan["gen"]
    floor = (a["decode_step_floor_ms"] or 0.0) / 1e3
    return lambda b, ctx: decode_step_seconds(arch, gpu, gen_tp=g["tp"], gen_pp=g["pp"], batch=b, context=ctx,
                                              efficiency=a["decode_efficiency"], floor_s=floor,
                                              overhead_s=a["decode_step_overhead_ms"] / 1e3,
                                              allreduce_s=a["allreduce_us"] / 1e6,
                                              launch_s=0.0 if g["graphs"] else a["eager_layer_ms"] / 1e3)


def _generation(cfg: dict, plan: dict, *, generated: float, l_max: int, oversample: float) -> dict:
    """Generation seconds of the three engine models (plan_generation.py) and the figures behind them."""
    from nemo_dapo.cluster.config_load import select

    arch, gpu, a, g = plan["arch"], plan["gpu"], plan["assume"], plan["gen"]
    lengths, prompt = _response_lengths(a, l_max), a["mean_prompt_tokens"]
    t = {"lengths": lengths, "generation": None, "gen": None,
         "ceiling": inflight_tokens_per_s_per_gpu(arch, gpu, context=lengths.mean_context(1, prompt),
                                                  efficiency=a["decode_efficiency"])}
    if not g["trt"]:
        return t  # Megatron generation (debug path) is not estimated
    engines = plan["layout"].world // (g["tp"] * g["pp"])
    group = select(cfg, "model.dapo.algorithm.group_size")
    max_slots = None
    if "server" in g:
        scheduler = g["server"]["capacity_scheduler"]
        g["concurrency"] = concurrency(g["server"], g["kv"], scheduler=scheduler, prompt=prompt, l_max=l_max,
                                       mean_context=lengths.mean_context(1, prompt), requests=generated / engines,
                                       group_size=group)
        g["scheduler"], max_slots = scheduler, g["concurrency"]["slots"]
    pass_rate = a["pass_rate"] or _need(select(cfg, "model.dapo.algorithm.dynamic_sampling.prior_pass_rate"),
                                        "model.dapo.algorithm.dynamic_sampling.prior_pass_rate")
    if not 0 < pass_rate <= 1:
        raise PlanError(f"pass rate {pass_rate} (plan.assume.pass_rate or dynamic_sampling.prior_pass_rate) must be "
                        "in (0, 1]")
    gen = generation_times(lengths, requests=generated / engines, group_size=group, static_batch=g["batch"],
                           pool_tokens=g["batch"] * g["max_seq"], prompt=prompt,
                           needed=needed_fraction(oversample, pass_rate), step_s=decode_step_fn(plan),
                           pipeline_stages=g["pp"], max_slots=max_slots)
    return {**t, "gen": gen, "engines": engines, "batches_per_engine": gen["batches"], "pass_rate": pass_rate,
            "steps_per_batch": gen["batch_max"], "step_ms": gen["static_step_s"] * 1e3,
            "generation": gen[engine_registry.ENGINES[g["engine"]].plan]}


def _pipeline_bubble(cfg: dict, layout: Layout, tokens_per_update: float) -> float:
    """1F1B bubble fraction (PP - 1) / m, m = packed micro-batches per DP rank per optimizer step."""
    from nemo_dapo.cluster.config_load import select

    if layout.pp == 1:
        return 0.0
    per_mb = select(cfg, "model.dapo.micro_batch_tokens") or \
        select(cfg, "model.micro_batch_size") * select(cfg, "model.encoder_seq_length")
    m = max(1.0, tokens_per_update / layout.dp / per_mb)
    return (layout.pp - 1) / m


def alltoall(cfg: dict, plan: dict, layout: Layout, tokens: float) -> dict:
    """plan_model.expert_alltoall of ``layout`` with the recipe's GPUs per node and ``plan.assume``'s bandwidth."""
    from nemo_dapo.cluster.config_load import select

    return expert_alltoall(plan["arch"], layout, tokens=tokens, devices=_need(select(cfg, "trainer.devices"),
                                                                               "trainer.devices"),
                           gb_per_s=plan["assume"]["alltoall_gb_per_s"])


def _step_time(cfg: dict, plan: dict) -> dict:
    from nemo_dapo.cluster.config_load import select

    arch, gpu, layout, a, g = plan["arch"], plan["gpu"], plan["layout"], plan["assume"], plan["gen"]
    prompts, group = select(cfg, "trainer.dapo.prompts_per_step"), select(cfg, "model.dapo.algorithm.group_size")
    l_max = select(cfg, "model.dapo.length_params.max_length")
    oversample = a["oversample"] if select(cfg, "model.dapo.algorithm.dynamic_sampling.enabled", True) else 1.0
    generated = prompts * group * oversample
    t = {"generated_samples": generated, "oversample": oversample,
         **_generation(cfg, plan, generated=generated, l_max=l_max, oversample=oversample)}
    seq_len = a["mean_prompt_tokens"] + t["lengths"].mean
    tokens = prompts * group * seq_len
    recompute = select(cfg, "model.activations_checkpoint_granularity") == "full"
    passes = 2 if select(cfg, "plan.reference_logprob_pass") else 1
    epochs = int(_need(select(cfg, "trainer.dapo.ppo_epochs"), "trainer.dapo.ppo_epochs"))
    hfu = a["hfu"] or default_hfu(arch)
    logprob_hfu = a["logprob_hfu"] or LOGPROB_HFU_RATIO * hfu
    bubble = _pipeline_bubble(cfg, layout, seq_len * select(cfg, "model.global_batch_size"))
    a2a = alltoall(cfg, plan, layout, tokens)
    a2a["sends"] = FORWARD_SENDS * passes + epochs * update_sends(recompute)
    a2a["step_seconds"] = a2a["sends"] * a2a["seconds"] * (1.0 + bubble)
    t.update(training_seconds(arch, gpu, world=layout.world, tokens=tokens, seq_len=seq_len, hfu=hfu,
                              logprob_hfu=logprob_hfu, recompute=recompute, logprob_passes=passes,
                              bubble=bubble, alltoall_s=a2a["seconds"], epochs=epochs),
             hfu=hfu, logprob_hfu=logprob_hfu,
             recompute=recompute, logprob_passes=passes, bubble=bubble, trained_tokens=tokens, seq_len=seq_len,
             alltoall=a2a)
    train = plan["phases"]["train"]
    moved = sum(train[k] for k, off in g["offloaded"].items() if off)
    parts = {"offload": 2 * moved / (a["pcie_gb_per_s"] * GB)}
    if "server" in g:
        parts.update(server_overhead(arch, g["server"], a))
    else:
        engine_bytes = plan["phases"]["generate"].get("engine_weights", 0.0)
        parts["refit"] = engine_bytes / (a["refit_gb_per_s"] * GB)
        if select(cfg, "trainer.dapo.trt_llm.unload_engine_train"):
            parts["engine_reload"] = engine_bytes / (a["pcie_gb_per_s"] * GB)
    other = sum(parts.values())
    t["refit_and_offload"], t["overhead"] = other, parts
    t["total"] = t["old_logprob"] + t["reference_logprob"] + t["training"] + other + (t["generation"] or 0.0)
    if t["gen"]:  # the step under each engine model, everything but generation unchanged
        t["totals"] = {k: t["total"] - t["generation"] + t["gen"][k] for k in MODEL_LABELS}
    return t


def run_cli(args) -> int:
    """``nemo-dapo plan``: exit code 0 = valid and fits, 1 = does not fit, 2 = invalid config or missing keys."""
    from omegaconf import OmegaConf

    from nemo_dapo.cluster.config_load import load_config
    from nemo_dapo.cluster.config_validate import check_config
    from nemo_dapo.cluster.plan_calibration import error_band

    try:
        cfg = OmegaConf.to_container(load_config(args.recipe, args.overrides), resolve=True)
    except (FileNotFoundError, ValueError) as e:
        print(f"nemo-dapo plan: error: {e}", file=sys.stderr)
        return 2
    refused = input_problems(cfg)
    for p in refused:  # no estimate at all: it would be arithmetic on nonsense
        print(f"nemo-dapo plan: error: {p}", file=sys.stderr)
    if refused:
        return 2
    problems = check_config(cfg)
    for p in problems:
        print(f"config problem: {p}")
    try:
        plan = make_plan(cfg)
    except PlanError as e:
        print(f"nemo-dapo plan: error: cannot plan: {e}", file=sys.stderr)
        return 2
    except (ArithmeticError, TypeError, ValueError) as e:
        if not problems:
            raise  # a valid config the planner cannot take: a bug
        print(f"nemo-dapo plan: error: cannot plan with the config problems above ({type(e).__name__}: {e}); fix "
              "them first", file=sys.stderr)
        return 2
    print(format_plan(plan, title=str(args.recipe), band=error_band()))
    return 2 if problems else (0 if plan["fits"] else 1)


def add_arguments(p) -> None:
    p.add_argument("recipe", help="recipe name under conf/recipes/ or a YAML path")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="overrides, e.g. model.dapo.rollout_micro_batch_size=48 (+key=value adds a key)")


# (name, help, add_arguments(parser), run(args) -> exit code): the shape of nemo_dapo.cli.SUBCOMMANDS entries.
CLI = ("plan", "per-GPU memory and step-time estimate of a cluster recipe (no NeMo or GPU needed)", add_arguments,
       run_cli)


def add_cli(subparsers):
    """Add ``plan RECIPE [key=value ...]`` to an argparse ``subparsers`` (handler in ``func`` and ``run``)."""
    p = subparsers.add_parser(CLI[0], help=CLI[1], description=CLI[1])
    add_arguments(p)
    p.set_defaults(func=run_cli, run=run_cli)
    return p
