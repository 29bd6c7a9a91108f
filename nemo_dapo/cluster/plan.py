"""Per-GPU memory and step-time arithmetic for a DAPO run on Megatron + TensorRT-LLM (NeMo-Aligner path).

Everything here is an ESTIMATE from closed-form arithmetic, not a measurement; it imports nothing of NeMo, Megatron
or torch, so ``nemo-dapo plan`` runs anywhere. The formulas follow the project's sizing notes (SCALE.md sections 2-3):

* Training state per GPU (Megatron, bf16 params): weights 2 B/param, main grads 4 B/param (2 with a bf16
  ``grad_sync_dtype``), Adam (fp32 master + m + v) 12 B/param, divided by d with the distributed optimizer:
  d = DP x CP for dense params, d = expert-DP = world / (EP x ETP x PP) for expert params (Megatron-LM's
  distributed-optimizer note: "6 + 12/d" bytes per param). The worst pipeline stage holds ceil(L / PP) layers and
  one vocab matrix (both when PP = 1 and the embeddings are untied).
* Activations of one micro-batch of s tokens: with full recompute only each layer's input, 2 s h / (t CP) bytes
  (t = TP with sequence parallelism, else 1), times the micro-batches in flight on pipeline stage 0 under 1F1B
  (min(PP, micro-batches)); plus one layer's working set c s h / (t CP) (c ~ 48 dense, ~ 66 MoE; an estimate);
  plus the unchunked fp32 logits s / CP x V / TP x 4 bytes. Without recompute every layer keeps its working set.
* TRT-LLM engine per GPU: bf16 weights / (gen TP x gen PP); KV cache 2 x layers x KV heads x head dim x 2 bytes per
  token, with the KV heads of a GPU = ceil(groups / gen TP) (heads are replicated when TP exceeds them), reserved
  for batch x (max input + max generation) tokens because a static batch must be able to run to the cap.
* Decode: a step of one engine at batch b costs max(latency floor, bytes / (eta x HBM bandwidth), FLOPs / (0.5 x
  peak)) per pipeline stage, stages in sequence; bytes = engine weights (for MoE only the experts a batch touches)
  + b x context x KV/token. Generation time comes from ONE response-length model (mean, share truncated at the
  cap, the rest a truncated exponential) for three engines: static batches (the legacy NeMo-Aligner path: each
  batch waits for its longest sample), in-flight batching (throughput of the same KV pool, plus the long tail) and
  streaming with early stop (the dynamic-sampling filler aborts what it no longer needs); formulas in
  ``nemo_dapo/cluster/plan_generation.py``. ``trainer.dapo.rollout_engine`` says which one the run uses.
* The engine servers (rollout_engine trtllm | vllm) take their layout, KV pool, concurrency, refit and sleep / wake
  from ``trainer.dapo.engine_server`` instead (``nemo_dapo/cluster/plan_engine_server.py``); the legacy engine's
  ``trt_llm.*`` keys then play no part.
* Training FLOPs per token: old log-prob 2N, update 8N (forward 2N + backward 4N + recompute 2N), N = active params,
  plus causal attention 4 L heads d (S / 2) per forward; time = FLOPs / (GPUs x peak x HFU).
Lines marked GUESS in ``DEFAULT_ASSUMPTIONS`` are judgement calls; override them under ``plan.assume``.
"""
from __future__ import annotations

import math
import sys
import textwrap
from dataclasses import dataclass
from typing import Optional

from nemo_dapo.cluster.plan_engine_server import (SERVER_ENGINES, concurrency, format_server,
                                                 server_layout, server_overhead, server_phases)
from nemo_dapo.cluster.plan_generation import (ENGINE_MODEL, MODEL_LABELS, PlanError, ResponseLengths,
                                              decode_step_seconds, engine_memory, format_generation, generation_times,
                                              inflight_tokens_per_s_per_gpu, needed_fraction)

__all__ = ["PlanError", "make_plan", "format_plan", "run_cli"]

GB = 1e9
KIB = 1024


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gb: float
    hbm_tb_s: float
    bf16_tflops: float  # dense


# Vendor figures (H100 SXM) and third-party spec pages (H20), as collected in SCALE.md section 3.1.
GPUS = {
    "h100": Gpu("H100 SXM 80GB", 80.0, 3.35, 989.0),
    "h20": Gpu("H20 96GB", 96.0, 4.0, 148.0),
}

DEFAULT_ASSUMPTIONS = {
    "mean_prompt_tokens": 250,  # GUESS: DAPO-Math-17k prompts with the template
    "mean_response_tokens": 6000,  # GUESS: mid-run mean response length
    "truncated_fraction": 0.05,  # GUESS: share of responses that hit the generation cap
    "oversample": 3.0,  # generated groups per kept group (the reference's 3x generation batch)
    "pass_rate": None,  # None: model.dapo.algorithm.dynamic_sampling.prior_pass_rate (share of groups the filler keeps)
    "hfu": None,  # None: 0.40 dense / 0.25 MoE on H100, 0.42 / 0.27 on H20 (mid of SCALE.md 3.3 ranges)
    "decode_efficiency": 0.75,  # eta: achieved fraction of HBM bandwidth while decoding
    "decode_step_floor_ms": None,  # None: 10 ms dense, 25 ms MoE (GUESS: per-token latency of one engine)
    "refit_gb_per_s": 5.0,  # GUESS: engine weight refit throughput per GPU (convert + trt.Refitter)
    "handover_gb_per_s": 5.0,  # GUESS: engine servers: HF-named gather over TP/PP/EP + shared-memory handover
    "sleep_wake_s": 5.0,  # GUESS: engine servers: one sleep + wake of a colocated engine
    "pcie_gb_per_s": 25.0,  # host <-> device copies for Adam offload and engine reload
    "engine_workspace_gb": 3.0,  # GUESS: TRT-LLM activations and workspace
    "cuda_reserved_gb": 3.0,  # GUESS: CUDA context, NCCL buffers
    "usable_fraction": 0.95,  # GUESS: allocator fragmentation margin
}
# The range of each assumption as (low, low allowed, high or None): rates, lengths and utilisations must be > 0
# (they divide), fractions lie in [0, 1] or (0, 1], overheads may be 0, and a null takes the default above.
ASSUMPTION_RANGES = {
    "mean_prompt_tokens": (0, False, None), "mean_response_tokens": (0, False, None),
    "truncated_fraction": (0, True, 1), "oversample": (1, True, None), "pass_rate": (0, False, 1),
    "hfu": (0, False, 1), "decode_efficiency": (0, False, 1), "decode_step_floor_ms": (0, True, None),
    "refit_gb_per_s": (0, False, None), "handover_gb_per_s": (0, False, None), "sleep_wake_s": (0, True, None),
    "pcie_gb_per_s": (0, False, None), "engine_workspace_gb": (0, True, None), "cuda_reserved_gb": (0, True, None),
    "usable_fraction": (0, False, 1),
}


@dataclass(frozen=True)
class Arch:
    """Model shape. SwiGLU MLPs (3 matrices); MoE layers have a router and no shared expert."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int
    tied_embeddings: bool = False
    qkv_bias: bool = False
    num_moe_experts: Optional[int] = None
    moe_ffn_hidden_size: Optional[int] = None
    moe_router_topk: Optional[int] = None
    name: str = ""

    @property
    def is_moe(self) -> bool:
        return bool(self.num_moe_experts)

    def attention_params(self) -> int:
        h, d = self.hidden_size, self.kv_channels
        q_and_o = 2 * h * self.num_attention_heads * d
        kv = 2 * h * self.num_query_groups * d
        bias = (self.num_attention_heads + 2 * self.num_query_groups) * d if self.qkv_bias else 0
        return q_and_o + kv + bias

    def dense_layer_params(self) -> int:
        """Params of one layer that are not experts: attention, norms, and the MLP or the router."""
        h = self.hidden_size
        mlp = h * self.num_moe_experts if self.is_moe else 3 * h * self.ffn_hidden_size
        return self.attention_params() + 2 * h + mlp

    def expert_params(self) -> int:
        """Params of one expert (SwiGLU)."""
        return 3 * self.hidden_size * self.moe_ffn_hidden_size if self.is_moe else 0

    def expert_layer_params(self) -> int:
        return self.num_moe_experts * self.expert_params() if self.is_moe else 0

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def num_embedding_matrices(self) -> int:
        return 1 if self.tied_embeddings else 2

    def total_params(self) -> int:
        per_layer = self.dense_layer_params() + self.expert_layer_params()
        return self.num_layers * per_layer + self.num_embedding_matrices() * self.embedding_params() + self.hidden_size

    def active_params(self) -> int:
        """Params touched per token (all non-expert params + top-k experts per layer)."""
        if not self.is_moe:
            return self.total_params()
        inactive = self.num_layers * (self.num_moe_experts - self.moe_router_topk) * self.expert_params()
        return self.total_params() - inactive

    def kv_bytes_per_token(self, layers: Optional[int] = None, kv_heads: Optional[int] = None) -> int:
        """bf16 K and V of one token over ``layers`` layers with ``kv_heads`` heads (defaults: the whole model)."""
        layers = self.num_layers if layers is None else layers
        kv_heads = self.num_query_groups if kv_heads is None else kv_heads
        return 2 * layers * kv_heads * self.kv_channels * 2

    def attention_flops_per_token(self, seq_len: float) -> float:
        """Forward FLOPs of causal attention scores and values for one token, averaged over a ``seq_len`` sequence."""
        return 4.0 * self.num_layers * self.num_attention_heads * self.kv_channels * seq_len / 2


@dataclass(frozen=True)
class Layout:
    world: int
    tp: int
    pp: int
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def expert_dp(self) -> int:
        """Expert data-parallel size with ETP = TP (NeMo 1.x cannot set ETP), Megatron: world / (ETP x EP x PP)."""
        return self.world // (self.tp * self.ep * self.pp)


def params_per_gpu(arch: Arch, layout: Layout) -> tuple[float, float]:
    """(dense, expert) params held by one GPU of the worst pipeline stage."""
    layers = math.ceil(arch.num_layers / layout.pp)
    embeddings = arch.num_embedding_matrices() if layout.pp == 1 else 1
    dense = (layers * arch.dense_layer_params() + embeddings * arch.embedding_params()) / layout.tp
    expert = layers * arch.expert_layer_params() / (layout.ep * layout.tp)
    return dense, expert


def training_memory(arch: Arch, layout: Layout, *, seq_tokens: int, in_flight: int, recompute: Optional[str],
                    distributed_optimizer: bool, grad_bytes: int) -> dict:
    """Bytes per GPU of the training state and one step's activations (see the module docstring)."""
    dense, expert = params_per_gpu(arch, layout)
    params = dense + expert
    if distributed_optimizer:
        optimizer = 12 * (dense / (layout.dp * layout.cp) + expert / layout.expert_dp)
    else:
        optimizer = 12 * params
    t = layout.tp if layout.sequence_parallel else 1
    per_token_hidden = seq_tokens * arch.hidden_size / (t * layout.cp)
    c = 66 if arch.is_moe else 48
    layers = math.ceil(arch.num_layers / layout.pp)
    if recompute == "full":
        activations = layers * 2 * per_token_hidden * in_flight + c * per_token_hidden
    else:
        activations = layers * c * per_token_hidden * in_flight
    logits = seq_tokens / layout.cp * arch.vocab_size / layout.tp * 4
    return {"weights": 2 * params, "grads": grad_bytes * params, "optimizer": optimizer,
            "activations": activations, "logits": logits}


def default_hfu(arch: Arch, gpu_key: str) -> float:
    if gpu_key == "h20":
        return 0.27 if arch.is_moe else 0.42
    return 0.25 if arch.is_moe else 0.40


def training_seconds(arch: Arch, gpu: Gpu, *, world: int, tokens: float, seq_len: float, hfu: float) -> dict:
    """Old log-prob (2N) and update (8N) time for ``tokens`` trained tokens of sequences of mean length ``seq_len``."""
    attention = arch.attention_flops_per_token(seq_len)
    n = arch.active_params()
    rate = world * gpu.bf16_tflops * 1e12 * hfu
    return {"old_logprob": tokens * (2 * n + attention) / rate,
            "training": tokens * (8 * n + 4 * attention) / rate}


# ---- from a config to a report ----------------------------------------------------------------------------------
ARCH_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
             "vocab_size", "tied_embeddings", "qkv_bias", "num_moe_experts", "moe_ffn_hidden_size", "moe_router_topk")


def _range_text(low: float, closed: bool, high: Optional[float]) -> str:
    if high is None:
        return f"a number {'>=' if closed else '>'} {low}"
    return f"a number in {'[' if closed else '('}{low}, {high}]"


def assumption_problems(cfg: dict) -> list:
    """Every ``plan.assume.*`` value that would give a nonsense estimate (a zero rate divides, a negative length
    or a utilisation above 1 is no machine), each naming its key, its range and the default as the fix."""
    from nemo_dapo.cluster.config_validate import select

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
    assumptions out of range): ``nemo-dapo plan`` refuses them before planning."""
    from nemo_dapo.cluster.config_validate import sizes

    return sizes(cfg)["bad"] + assumption_problems(cfg)


def _need(value, key: str):
    if value is None:
        raise PlanError(f"{key} is not set; `nemo-dapo plan` needs it (see conf/gpt_dapo_actor.yaml, plan.*)")
    return value


def arch_from_config(cfg: dict) -> Arch:
    spec = cfg.get("plan", {}).get("arch", {}) or {}
    kw = {k: spec.get(k) for k in ARCH_KEYS}
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
    from nemo_dapo.cluster.config_validate import select, sizes

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
                    sequence_parallel=bool(select(cfg, "model.sequence_parallel", False)))
    engine = _need(select(cfg, "trainer.dapo.rollout_engine"), "trainer.dapo.rollout_engine")
    if engine not in ENGINE_MODEL:
        raise PlanError(f"trainer.dapo.rollout_engine={engine!r}: `nemo-dapo plan` models "
                        f"{sorted(ENGINE_MODEL)} ('local', the project's small-model engine, is not sized here)")
    budget = a["usable_fraction"] * gpu.memory_gb * GB
    phases, gen = _memory_phases(cfg, arch, layout, a, gpu=gpu, budget=budget)
    plan = {"gpu": gpu, "gpu_key": gpu_key, "arch": arch, "layout": layout, "assume": a, "phases": phases,
            "budget": budget, "fits": all(sum(p.values()) <= budget for p in phases.values()), "gen": gen}
    plan["time"] = _step_time(cfg, plan, gpu_key)
    return plan


def _memory_phases(cfg: dict, arch: Arch, layout: Layout, a: dict, *, gpu: Gpu, budget: float) -> tuple:
    """({"train": {part: bytes}, "generate": {part: bytes}}, generation settings) per GPU."""
    from nemo_dapo.cluster.config_validate import DISTRIBUTED_OPTIMIZERS, select

    mbs, gbs = select(cfg, "model.micro_batch_size"), select(cfg, "model.global_batch_size")
    seq = select(cfg, "model.encoder_seq_length")  # micro-batches are padded up to the longest sample: worst case
    optim = select(cfg, "model.optim.name")
    train = training_memory(arch, layout, seq_tokens=mbs * seq, in_flight=min(layout.pp, gbs // (mbs * layout.dp)),
                            recompute=select(cfg, "model.activations_checkpoint_granularity"),
                            distributed_optimizer=optim in DISTRIBUTED_OPTIMIZERS,
                            grad_bytes=2 if select(cfg, "model.optim.grad_sync_dtype") in ("bf16", "fp16") else 4)
    trt = select(cfg, "trainer.dapo.trt_llm", {})
    gen = {"tp": layout.tp, "pp": 1 if trt.get("reshard") else layout.pp, "trt": bool(trt.get("enable")),
           "engine": _need(select(cfg, "trainer.dapo.rollout_engine"), "trainer.dapo.rollout_engine"),
           "batch": select(cfg, "model.dapo.rollout_micro_batch_size"),
           "max_seq": trt.get("max_input_len", 0) + select(cfg, "model.dapo.length_params.max_length"),
           # NeMo-Aligner offloads only apex distributed-Adam states while generating
           "offloaded": bool(select(cfg, "model.dapo.offload_adam_states")) and optim == "distributed_fused_adam"}
    if gen["engine"] in SERVER_ENGINES:
        srv = server_layout(cfg, arch, layout.world)
        phases, kv = server_phases(arch, srv, train, offloaded=gen["offloaded"], gpu=gpu, budget=budget, a=a)
        gen.update(tp=srv["tp"], pp=srv["pp"], trt=True, max_seq=srv["max_seq"], server=srv, kv=kv,
                   kv_per_token=kv["kv_per_token"])
        return phases, gen
    engine = {}
    if gen["trt"]:
        engine = engine_memory(arch, gen_tp=gen["tp"], gen_pp=gen["pp"], batch=gen["batch"], max_seq=gen["max_seq"])
        gen["kv_per_token"] = engine.pop("kv_per_token")
        engine["engine_workspace"] = a["engine_workspace_gb"] * GB
    reserve = {"cuda_reserved": a["cuda_reserved_gb"] * GB}
    phases = {
        "train": {**train, **({} if trt.get("unload_engine_train") else engine), **reserve},
        "generate": {"weights": train["weights"], "grads": train["grads"],
                     "optimizer": 0.0 if gen["offloaded"] else train["optimizer"], **engine, **reserve},
    }
    return phases, gen


def _response_lengths(a: dict, l_max: int) -> ResponseLengths:
    try:
        return ResponseLengths(l_max, min(a["mean_response_tokens"], l_max), a["truncated_fraction"])
    except ValueError as e:
        raise PlanError(f"plan.assume.mean_response_tokens / truncated_fraction: {e}") from None


def _generation(cfg: dict, plan: dict, *, generated: float, l_max: int, oversample: float) -> dict:
    """Generation seconds of the three engine models (plan_generation.py) and the figures behind them."""
    from nemo_dapo.cluster.config_validate import select

    arch, gpu, a, g = plan["arch"], plan["gpu"], plan["assume"], plan["gen"]
    lengths, prompt = _response_lengths(a, l_max), a["mean_prompt_tokens"]
    t = {"lengths": lengths, "generation": None, "gen": None,
         "ceiling": inflight_tokens_per_s_per_gpu(arch, gpu, context=lengths.mean_context(1, prompt),
                                                  efficiency=a["decode_efficiency"])}
    if not g["trt"]:
        return t  # Megatron generation (debug path) is not estimated
    floor = a["decode_step_floor_ms"]  # 0 is a valid choice: no latency floor
    floor = (floor if floor is not None else (25.0 if arch.is_moe else 10.0)) / 1e3
    step = lambda b, ctx: decode_step_seconds(arch, gpu, gen_tp=g["tp"], gen_pp=g["pp"], batch=b,  # noqa: E731
                                              context=ctx, efficiency=a["decode_efficiency"], floor_s=floor)
    engines = plan["layout"].world // (g["tp"] * g["pp"])
    max_slots = None
    if "server" in g:
        scheduler = g["server"]["capacity_scheduler"]
        g["concurrency"] = concurrency(g["server"], g["kv"], scheduler=scheduler, prompt=prompt, l_max=l_max,
                                       mean_context=lengths.mean_context(1, prompt), requests=generated / engines,
                                       group_size=select(cfg, "model.dapo.algorithm.group_size"))
        g["scheduler"], max_slots = scheduler, g["concurrency"]["slots"]
    pass_rate = a["pass_rate"] or _need(select(cfg, "model.dapo.algorithm.dynamic_sampling.prior_pass_rate"),
                                        "model.dapo.algorithm.dynamic_sampling.prior_pass_rate")
    if not 0 < pass_rate <= 1:
        raise PlanError(f"pass rate {pass_rate} (plan.assume.pass_rate or dynamic_sampling.prior_pass_rate) must be "
                        "in (0, 1]")
    gen = generation_times(lengths, requests=generated / engines,
                           group_size=select(cfg, "model.dapo.algorithm.group_size"), static_batch=g["batch"],
                           pool_tokens=g["batch"] * g["max_seq"], prompt=prompt,
                           needed=needed_fraction(oversample, pass_rate), step_s=step, pipeline_stages=g["pp"],
                           max_slots=max_slots)
    return {**t, "gen": gen, "engines": engines, "batches_per_engine": gen["batches"], "pass_rate": pass_rate,
            "steps_per_batch": gen["batch_max"], "step_ms": gen["static_step_s"] * 1e3,
            "generation": gen[ENGINE_MODEL[g["engine"]]]}


def _step_time(cfg: dict, plan: dict, gpu_key: str) -> dict:
    from nemo_dapo.cluster.config_validate import select

    arch, gpu, layout, a, g = plan["arch"], plan["gpu"], plan["layout"], plan["assume"], plan["gen"]
    prompts, group = select(cfg, "trainer.dapo.prompts_per_step"), select(cfg, "model.dapo.algorithm.group_size")
    l_max = select(cfg, "model.dapo.length_params.max_length")
    oversample = a["oversample"] if select(cfg, "model.dapo.algorithm.dynamic_sampling.enabled", True) else 1.0
    generated = prompts * group * oversample
    t = {"generated_samples": generated, "oversample": oversample,
         **_generation(cfg, plan, generated=generated, l_max=l_max, oversample=oversample)}
    seq_len = a["mean_prompt_tokens"] + t["lengths"].mean
    hfu = a["hfu"] or default_hfu(arch, gpu_key)
    t.update(training_seconds(arch, gpu, world=layout.world, tokens=prompts * group * seq_len, seq_len=seq_len,
                              hfu=hfu), hfu=hfu)
    engine_bytes = plan["phases"]["generate"].get("engine_weights", 0.0)
    adam = plan["phases"]["train"]["optimizer"] if g["offloaded"] else 0.0
    parts = {"adam_offload": 2 * adam / (a["pcie_gb_per_s"] * GB)}
    if "server" in g:
        parts.update(server_overhead(arch, g["server"], a))
    else:
        parts["refit"] = engine_bytes / (a["refit_gb_per_s"] * GB)
        if select(cfg, "trainer.dapo.trt_llm.unload_engine_train"):
            parts["engine_reload"] = engine_bytes / (a["pcie_gb_per_s"] * GB)
    other = sum(parts.values())
    t["refit_and_offload"], t["overhead"] = other, parts
    t["total"] = t["old_logprob"] + t["training"] + other + (t["generation"] or 0.0)
    if t["gen"]:  # the step under each engine model, everything but generation unchanged
        t["totals"] = {k: t["total"] - t["generation"] + t["gen"][k] for k in MODEL_LABELS}
    return t


def _format_time(plan: dict) -> list:
    """The step-time block of the report: fixed phases, then generation and step total under each engine model."""
    t, g, lengths = plan["time"], plan["gen"], plan["time"]["lengths"]
    lines = ["", f"step time, s (est.; {t['generated_samples']:.0f} samples generated, HFU {t['hfu']:.0%})",
             *textwrap.wrap(f"response lengths (one model for every engine): mean {lengths.mean:.0f} tokens, "
                            f"{lengths.truncated_fraction:.0%} truncated at {lengths.l_max}, the rest a truncated "
                            f"exponential (shape {lengths.shape or 0:.2f}); see nemo_dapo/cluster/plan_generation.py",
                            117, initial_indent="  ", subsequent_indent="    "),
             f"  old log-probs (2N/token)          {t['old_logprob']:10.0f}",
             f"  training (8N/token)               {t['training']:10.0f}",
             f"  refit + Adam offload + reload     {t['refit_and_offload']:10.0f}",
             "      " + ", ".join(f"{k.replace('_', ' ')} {v:.0f}" for k, v in t["overhead"].items())
             + (f" (model {2 * plan['arch'].total_params() / GB:.0f} GB / handover "
                f"{plan['assume']['handover_gb_per_s']}"
                f" GB/s; sleep + wake {plan['assume']['sleep_wake_s']} s)" if "server" in g else "")]
    if not t["gen"]:
        return lines + [f"  {'generation':<34}not estimated (Megatron generation, debug path)",
                        f"  {'total':<45}{t['total']:10.0f} ({t['total'] / 60:3.0f} min)"]
    return lines + format_generation(t["gen"], t["totals"], engine=g["engine"], batch=g["batch"],
                                     gpus_per_engine=g["tp"] * g["pp"], ceiling=t["ceiling"],
                                     oversample=t["oversample"], pass_rate=t["pass_rate"], total=t["total"])


def format_plan(plan: dict, title: str = "") -> str:
    arch, gpu, lay, g, t, a = plan["arch"], plan["gpu"], plan["layout"], plan["gen"], plan["time"], plan["assume"]
    gb = lambda x: f"{x / GB:7.1f}"  # noqa: E731
    moe = (f", {arch.num_moe_experts} experts top-{arch.moe_router_topk}" if arch.is_moe else "")
    lines = [f"nemo-dapo plan {title}".rstrip() + "  -- ESTIMATES from closed-form arithmetic, not measurements",
             f"cluster     {lay.world} x {gpu.name} ({gpu.memory_gb:.0f} GB, {gpu.hbm_tb_s} TB/s, "
             f"{gpu.bf16_tflops:.0f} TFLOP/s bf16 dense)",
             f"model       {arch.name or 'model'}: {arch.total_params() / 1e9:.2f} B params, "
             f"{arch.active_params() / 1e9:.2f} B active{moe}",
             f"training    TP{lay.tp} PP{lay.pp} CP{lay.cp} EP{lay.ep} (ETP=TP) -> DP {lay.dp}, expert-DP "
             f"{lay.expert_dp}, sequence parallel {'on' if lay.sequence_parallel else 'off'}"]
    if "server" in g:
        lines += format_server(g["server"], g["kv"], g["concurrency"], g["engine"], g["scheduler"])
    elif g["trt"]:
        lines.append(f"generation  TRT-LLM engines TP{g['tp']} PP{g['pp']} x {t['engines']}, static batch {g['batch']}"
                     f", KV reserved for {g['max_seq']} tokens/seq ({g['kv_per_token'] / KIB:.0f} KiB/token/GPU)")
    lines += ["", "per-GPU memory, GB (est.)        train   generate"]
    names = {"weights": "weights (bf16)", "grads": "main grads", "optimizer": "Adam states (fp32 master, m, v)",
             "activations": "activations (recompute as set)", "logits": "fp32 logits of one micro-batch",
             "engine_weights": "engine weights (bf16)", "kv_cache": "engine KV cache"
             + (" (free fraction)" if "server" in g else " (static batch)"),
             "engine_workspace": "engine workspace (GUESS)", "cuda_reserved": "CUDA context + NCCL (GUESS)"}
    tr, ge = plan["phases"]["train"], plan["phases"]["generate"]
    for key, label in names.items():
        if key in tr or key in ge:
            cell = lambda p: gb(p[key]) if key in p else "      -"  # noqa: E731
            lines.append(f"  {label:<31}{cell(tr)}  {cell(ge)}")
    verdict = "fits" if plan["fits"] else "DOES NOT FIT"
    lines.append(f"  {'total':<31}{gb(sum(tr.values()))}  {gb(sum(ge.values()))}   budget {gb(plan['budget']).strip()}"
                 f" ({a['usable_fraction']:.0%} of {gpu.memory_gb:.0f}) -> {verdict}")
    lines += [*_format_time(plan),
              "", *textwrap.wrap("assumptions: " + ", ".join(f"{k}={v}" for k, v in a.items()), 119),
              "formulas and sources: nemo_dapo/cluster/plan.py and plan_generation.py (module docstrings)"]
    return "\n".join(lines)


def run_cli(args) -> int:
    """``nemo-dapo plan``: exit code 0 = valid and fits, 1 = does not fit, 2 = invalid config or missing keys."""
    from omegaconf import OmegaConf

    from nemo_dapo.cluster.config_validate import check_config, load_config

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
    print(format_plan(plan, title=str(args.recipe)))
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
