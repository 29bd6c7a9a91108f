"""Rollout generation for `nemo-dapo plan`: engine memory, decode steps, and the generation time of one DAPO step
under three engines from ONE response-length model. Imports nothing of NeMo, Megatron or torch.

Response lengths (``ResponseLengths``): a DAPO-like long tail. A share f of the responses hits the cap l_max
(``plan.assume.truncated_fraction``); the other 1 - f are spread over [0, l_max) by a truncated exponential of
density ~ exp(-a x / l_max), whose shape a is solved so that the mean over ALL responses is m
(``plan.assume.mean_response_tokens``): f l_max + (1 - f) m_u = m, m_u = l_max (1/a - 1/(e^a - 1)). The CDF is
F(x) = (1 - f) (1 - e^(-a x / l_max)) / (1 - e^(-a)) below the cap and 1 at it. For n independent responses the
longest, M_n, has E[M_n^k] = integral over [0, l_max] of k x^(k-1) (1 - F(x)^n) dx (``max_moment``); n = 1 gives the
moments of L itself. A static batch that runs M steps with every slot's KV growing sees the step-weighted mean
context prompt + E[M^2] / (2 E[M]) (``mean_context``).

Every engine has the same layout and the same KV pool (the static engine's reservation, batch x max sequence
tokens), and ``step_s(batch, context)`` is the seconds of one decode step of one engine (``decode_step_seconds``):
each GPU reads its weight shard (for MoE only the experts the batch touches) and the KV it attends over at
``decode_efficiency`` x its HBM bandwidth (or is compute-bound), plus a fixed ``decode_step_overhead_ms`` and, at
TP > 1, two all-reduces per layer of ``allreduce_us``: one rule for every model and GPU. Per engine, N responses
(groups of G), static batch B, prompt p:

(a) static batches, the legacy NeMo-Aligner TRT-LLM path (ModelRunner): each batch costs its longest response,
    T_static = ceil(N / B) E[M_B] step_s(B, p + E[M_B^2] / (2 E[M_B])).
(b) in-flight batching: the KV pool holds C = min(N, max(B, floor(pool / c))) requests at the mean in-flight context
    c = p + E[L^2] / (2 E[L]) (an engine server's C comes from its limits, plan_engine_server.py); the engine decodes
    R = C / step_s(C / PP, c) tokens/s while full (with PP pipeline stages it keeps PP micro-batches of C / PP in
    flight, one per stage; the static ModelRunner batch runs through the stages in sequence). The queue empties at
    t(N) = max(0, N - C) m / R (t(k) is when request k is admitted), and the C requests then in flight finish as one
    wave: at decode step x the C (1 - F(x)) still running take a step at context p + x (at least one request, with
    probability 1 - F(x)^C that any is left), W(C) = sum over x of (1 - F(x)^C) step_s(max(1, C (1 - F(x))) / PP,
    p + x), so T_inflight = t(N) + W(min(C, N)). The wave holds the long tail: with any response truncated it runs
    ~l_max steps, the last ones at batch 1.
(c) streaming with early stop: once the dynamic-sampling filler holds its prompts the requests still running are
    aborted. With pass rate q (share of groups kept) and g = oversample groups generated per kept group, the
    filler is full after a share phi = min(1, 1 / (g q)) of the groups; the last needed group is admitted at
    t(phi N) and its longest response decodes at the full-batch step latency (the pool is still full):
    T_stream = min(T_inflight, t(phi N) + E[M_G] step_s(C / PP, c)), and T_inflight when phi = 1 (nothing to abort).
Since C >= B (or C = N < B: a single batch), step_s(b) / b does not grow with b, E[M_n] is concave in n and a sum
of batch maxima is >= the overall maximum, T_static >= T_inflight >= T_stream (the tests check it over a grid).
The three are estimates of the same arithmetic as the rest of the plan, not measurements.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Optional

from nemo_dapo.cluster.plan_shapes import Arch, Gpu
from nemo_dapo.core import engine_registry

SHAPE_LIMIT = 500.0  # |a| bound of the exponential's shape (keeps e^a finite): means 0.2 % .. 99.8 % of l_max
QUADRATURE_POINTS = 4096
WAVE_STRIDE = 4


class PlanError(ValueError):
    """The config lacks what the estimate needs, or a layout does not fit; the message names the keys and the fix."""


# ---- one engine: memory and decode step (shapes and GPUs from plan.py) ---------------------------------------------
def engine_memory(arch: Arch, *, gen_tp: int, gen_pp: int, batch: int, max_seq: int) -> dict:
    """Bytes per GPU of a TRT-LLM engine: bf16 weights, and KV cache for ``batch`` sequences of ``max_seq`` tokens."""
    kv_heads = math.ceil(arch.num_query_groups / gen_tp)
    kv_per_token = arch.kv_bytes_per_token(layers=math.ceil(arch.num_layers / gen_pp), kv_heads=kv_heads)
    return {"engine_weights": 2 * arch.total_params() / (gen_tp * gen_pp),
            "kv_cache": batch * max_seq * kv_per_token, "kv_per_token": kv_per_token}


@lru_cache(maxsize=64)
def _engine_constants(arch: Arch, gen_tp: int, gen_pp: int) -> tuple:
    """(weight bytes, KV bytes per token, routed-expert bytes per GPU, active params) of one engine GPU."""
    eng = engine_memory(arch, gen_tp=gen_tp, gen_pp=gen_pp, batch=1, max_seq=1)
    experts = 2 * arch.num_layers * arch.expert_layer_params() / (gen_tp * gen_pp)
    return eng["engine_weights"], eng["kv_per_token"], experts, arch.active_params()


def decode_step_seconds(arch: Arch, gpu: Gpu, *, gen_tp: int, gen_pp: int, batch: float, context: float,
                        efficiency: float, floor_s: float = 0.0, overhead_s: float = 0.0,
                        allreduce_s: float = 0.0, launch_s: float = 0.0) -> float:
    """Seconds per decode step of ``batch`` sequences at mean KV length ``context``: each pipeline stage reads its
    bytes (its weight shard, for MoE only the experts the batch touches, plus the KV it attends over) at
    ``efficiency`` x HBM bandwidth, or is compute-bound, whichever is slower; the stages run in sequence. An engine
    without CUDA graphs launches each layer's kernels from the host, ``launch_s`` per layer, while the GPU runs the
    ones already launched: a stage takes the longer of the two (0: graphs, the launches hidden). Plus a fixed
    ``overhead_s`` per step (scheduling, sampling) and, with TP > 1, two all-reduces per layer of ``allreduce_s``
    each; never below ``floor_s``."""
    weights, kv_per_token, expert_bytes, active = _engine_constants(arch, gen_tp, gen_pp)
    if arch.is_moe:  # a batch touches 1 - (1 - k/E)^batch of the experts of each layer
        touched = 1.0 - (1.0 - arch.moe_router_topk / arch.num_moe_experts) ** batch
        weights -= expert_bytes * (1.0 - touched)
    stage_bytes = weights + batch * context * kv_per_token
    flops = batch * (2 * active + arch.attention_flops_per_token(2 * context)) / (gen_tp * gen_pp)
    stage = max(stage_bytes / (efficiency * gpu.hbm_tb_s * 1e12), flops / (0.5 * gpu.bf16_tflops * 1e12),
                math.ceil(arch.num_layers / gen_pp) * launch_s)
    comm = 2 * arch.num_layers * allreduce_s if gen_tp > 1 else 0.0
    return max(floor_s, gen_pp * stage + overhead_s + comm)


def inflight_tokens_per_s_per_gpu(arch: Arch, gpu: Gpu, *, context: float, efficiency: float) -> float:
    """Decode ceiling of an in-flight-batching engine with a full KV pool (weight reads amortised)."""
    bandwidth = efficiency * gpu.hbm_tb_s * 1e12 / (arch.kv_bytes_per_token() * context)
    compute = 0.5 * gpu.bf16_tflops * 1e12 / (2 * arch.active_params() + arch.attention_flops_per_token(2 * context))
    return min(bandwidth, compute)


# ---- the response-length model and the three engine models ---------------------------------------------------------
def _shape_mean(a: float) -> float:
    """Mean of the density ~ exp(-a u) on [0, 1)."""
    return 0.5 - a / 12 if abs(a) < 1e-6 else 1.0 / a - 1.0 / math.expm1(a)


@dataclass(frozen=True)
class ResponseLengths:
    """Response-length distribution (module docstring): cap ``l_max``, overall ``mean``, ``truncated_fraction``."""

    l_max: int
    mean: float
    truncated_fraction: float

    def __post_init__(self):
        f, m, lm = self.truncated_fraction, self.mean, self.l_max
        if not (lm > 0 and 0 <= f <= 1 and 0 < m <= lm):
            raise ValueError(f"response lengths need l_max > 0, 0 <= truncated_fraction <= 1 and 0 < mean <= l_max, "
                             f"got l_max={lm}, truncated_fraction={f}, mean={m}")
        if f < 1 and m < lm and m <= f * lm:
            raise ValueError(f"mean response {m} <= truncated_fraction x l_max = {f * lm:.0f}: the truncated "
                             "responses alone would exceed the mean; lower truncated_fraction or raise the mean")
        object.__setattr__(self, "shape", None if self.at_cap else self._solve_shape())
        h = lm / QUADRATURE_POINTS  # midpoints of the quadrature grid and the CDF there, computed once
        object.__setattr__(self, "_grid", tuple(((i + 0.5) * h, self.cdf((i + 0.5) * h))
                                                for i in range(QUADRATURE_POINTS)))

    @property
    def at_cap(self) -> bool:
        """Every response hits the cap (truncated_fraction 1 or mean = l_max)."""
        return self.truncated_fraction >= 1 or self.mean >= self.l_max

    def _solve_shape(self) -> float:
        target = (self.mean - self.truncated_fraction * self.l_max) / (1 - self.truncated_fraction) / self.l_max
        lo, hi = -SHAPE_LIMIT, SHAPE_LIMIT  # _shape_mean falls from ~1 at lo to ~0 at hi
        if not _shape_mean(hi) <= target <= _shape_mean(lo):
            raise ValueError(f"untruncated mean {target * self.l_max:.0f} tokens is outside what the length model "
                             f"covers on l_max={self.l_max} ({_shape_mean(hi):.1%}..{_shape_mean(lo):.1%} of it)")
        for _ in range(200):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if _shape_mean(mid) > target else (lo, mid)
        return (lo + hi) / 2

    def cdf(self, x: float) -> float:
        """P(L <= x)."""
        if x >= self.l_max:
            return 1.0
        if self.at_cap or x <= 0:
            return 0.0
        u, a = x / self.l_max, self.shape
        spread = u if abs(a) < 1e-9 else math.expm1(-a * u) / math.expm1(-a)
        return (1 - self.truncated_fraction) * spread

    def max_moment(self, n: float, k: int = 1) -> float:
        """E[M_n^k], M_n = the longest of n responses (n = 1: E[L^k]); midpoint rule over [0, l_max]."""
        if n <= 0:
            return 0.0
        return self.l_max / QUADRATURE_POINTS * sum(k * x ** (k - 1) * (1.0 - cdf ** n) for x, cdf in self._grid)

    def wave_seconds(self, n: float, prompt: float, step_s: Callable[[float, float], float],
                     stages: int = 1) -> float:
        """Expected seconds for ``n`` requests that start together to finish, none admitted after them: at decode
        step x the n (1 - F(x)) still running (at least 1 while any is, which has probability 1 - F(x)^n) take one
        step at context prompt + x, spread over ``stages`` pipeline micro-batches."""
        points = QUADRATURE_POINTS // WAVE_STRIDE  # a coarser midpoint rule: each step call is costly
        h = self.l_max / points
        cdfs = ((k + 0.5) * h for k in range(points))
        return h * sum((1.0 - cdf ** n) * step_s(max(1.0, n * (1.0 - cdf)) / stages, prompt + x)
                       for x, cdf in ((x, self.cdf(x)) for x in cdfs))

    def mean_context(self, n: float, prompt: float) -> float:
        """Step-weighted mean KV length of a run of M_n steps after a ``prompt``: p + E[M^2] / (2 E[M])."""
        return prompt + self.max_moment(n, 2) / (2 * self.max_moment(n))


def needed_fraction(oversample: float, pass_rate: float) -> float:
    """phi: the share of generated groups the filler needs before it is full (1 = every group)."""
    return min(1.0, 1.0 / (oversample * pass_rate))


def generation_times(lengths: ResponseLengths, *, requests: float, group_size: int, static_batch: int,
                     pool_tokens: float, prompt: float, needed: float, step_s: Callable[[float, float], float],
                     pipeline_stages: int = 1, max_slots: Optional[int] = None) -> dict:
    """Seconds of generation of one engine's ``requests`` responses under (a) static, (b) in-flight and (c)
    streaming-with-early-stop batching, and their inputs (formulas: module docstring). ``max_slots``: the in-flight
    concurrency C of an engine server (its max_batch_size, max_num_tokens and KV admission, plan_engine_server.py),
    replacing the pool-derived C of the static engine's reservation."""
    b, m = static_batch, lengths.max_moment(1)  # = lengths.mean, by the same quadrature as the batch maxima
    batch_max = lengths.max_moment(b)
    static_step = step_s(b, lengths.mean_context(b, prompt))
    static = math.ceil(requests / b) * batch_max * static_step
    context = lengths.mean_context(1, prompt)
    slots = max(1, min(max(b, math.floor(pool_tokens / context)), math.ceil(requests)))
    if max_slots is not None:
        slots = max(1, min(int(max_slots), math.ceil(requests)))
    full_step = step_s(slots / pipeline_stages, context)
    rate = slots / full_step
    admitted = lambda k: max(0.0, k - slots) * m / rate  # noqa: E731
    last = min(slots, requests)  # the requests still in flight when the queue runs dry decode as one wave
    parts = {"throughput": requests * m / rate, "queue": admitted(requests),
             "last_wave": lengths.wave_seconds(last, prompt, step_s, pipeline_stages)}
    inflight = parts["queue"] + parts["last_wave"]
    longest = lengths.max_moment(requests)
    small_step = step_s(1, prompt + longest / 2)
    stream = inflight if needed >= 1 else min(inflight, admitted(needed * requests)
                                              + lengths.max_moment(group_size) * full_step)
    return {"static": static, "inflight": inflight, "streaming": stream, "batches": math.ceil(requests / b),
            "batch_max": batch_max, "static_step_s": static_step, "slots": slots, "inflight_context": context,
            "inflight_step_s": full_step, "tokens_per_s": rate, "small_step_s": small_step, "longest": longest,
            "needed": needed, "inflight_parts": parts}


# The generation models; the one a ``trainer.dapo.rollout_engine`` runs is its registry row's ``plan``
# (nemo_dapo.core.engine_registry.PLAN_MODELS; "streaming" is what early stopping would save, selected by none).
MODEL_LABELS = {"static": "static batches", "inflight": "in-flight batching", "streaming": "streaming + early stop"}


def format_generation(gen: dict, totals: dict, *, engine: str, batch: int, gpus_per_engine: int, ceiling: float,
                      oversample: float, pass_rate: float, total: float) -> list:
    """Report lines: generation seconds and the step total under each engine model, the selected one marked."""
    selected = engine_registry.ENGINES[engine].plan
    details = {
        "static": f"{gen['batches']} batches/engine x {gen['batch_max']:.0f} steps (E[longest of {batch}]) x "
                  f"{gen['static_step_s'] * 1e3:.1f} ms",
        "inflight": f"{gen['slots']} in flight, mean context {gen['inflight_context']:.0f}: {gen['tokens_per_s']:.0f} "
                    f"tok/s/engine ({gen['tokens_per_s'] / gpus_per_engine:.0f}/GPU, ceiling {ceiling:.0f}); "
                    f"tail >= {gen['longest']:.0f} x {gen['small_step_s'] * 1e3:.1f} ms",
        "streaming": f"filler full after {gen['needed']:.0%} of the groups (oversample {oversample}, pass rate "
                     f"{pass_rate}), the rest aborted",
    }
    lines = [f"  {'':34}generation       step"]
    for key, label in MODEL_LABELS.items():
        mark = f"  <- trainer.dapo.rollout_engine={engine}" if key == selected else ""
        lines += [f"  generation, {label:<22}{gen[key]:10.0f} {totals[key]:10.0f} ({totals[key] / 60:3.0f} min){mark}",
                  f"      {details[key]}"]
    label = f"total ({engine}: {MODEL_LABELS[selected]})"
    return lines + [f"  {label:<45}{total:10.0f} ({total / 60:3.0f} min)"]
