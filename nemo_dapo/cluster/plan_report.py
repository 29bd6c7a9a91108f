"""The report of `nemo-dapo plan`: layout, per-GPU memory of every phase, the step time under each engine model
with the calibration band (plan_calibration.py), and every assumption with its reason. Imports nothing of NeMo,
Megatron or torch."""
from __future__ import annotations

import textwrap

from nemo_dapo.cluster.plan_assumptions import ASSUMPTIONS
from nemo_dapo.cluster.plan_engine_server import format_server
from nemo_dapo.cluster.plan_generation import format_generation

GB = 1e9
KIB = 1024
PHASE_LABELS = {"train": "train", "refit": "refit", "generate": "generate"}


def _format_time(plan: dict, band) -> list:
    """The step-time block of the report: fixed phases, then generation and step total under each engine model."""
    t, g, lengths = plan["time"], plan["gen"], plan["time"]["lengths"]
    n = "8N" if t["recompute"] else "6N"
    lines = ["", f"step time, s (est.; {t['generated_samples']:.0f} samples generated, update HFU {t['hfu']:.0%}, "
                 f"log-prob passes {t['logprob_hfu']:.1%}, PP bubble {t['bubble']:.1%})",
             *textwrap.wrap(f"response lengths (one model for every engine): mean {lengths.mean:.0f} tokens, "
                            f"{lengths.truncated_fraction:.0%} truncated at {lengths.l_max}, the rest a truncated "
                            f"exponential (shape {lengths.shape or 0:.2f}); see nemo_dapo/cluster/plan_generation.py",
                            117, initial_indent="  ", subsequent_indent="    "),
             f"  old log-probs (2N/token)          {t['old_logprob']:10.0f}",
             f"  reference log-probs (2N/token)    {t['reference_logprob']:10.0f}"
             + ("" if t["logprob_passes"] > 1 else "  (none: plan.reference_logprob_pass off, as DAPO)"),
             f"  {'training (' + n + '/token, ' + ('full recompute)' if t['recompute'] else 'no recompute)'):<34}"
             f"{t['training']:10.0f}",
             *_alltoall_lines(plan),
             f"  refit + offload + reload          {t['refit_and_offload']:10.0f}",
             "      " + ", ".join(f"{k.replace('_', ' ')} {v:.0f}" for k, v in t["overhead"].items())
             + (f" (model {2 * plan['arch'].total_params() / GB:.0f} GB / handover "
                f"{plan['assume']['handover_gb_per_s']}"
                f" GB/s; sleep + wake {plan['assume']['sleep_wake_s']} s)" if "server" in g else "")]
    if not t["gen"]:
        return lines + [f"  {'generation':<34}not estimated (Megatron generation, debug path)",
                        f"  {'total':<45}{t['total']:10.0f} ({t['total'] / 60:3.0f} min){_band_text(band)}"]
    out = format_generation(t["gen"], t["totals"], engine=g["engine"], batch=g["batch"],
                            gpus_per_engine=g["tp"] * g["pp"], ceiling=t["ceiling"], oversample=t["oversample"],
                            pass_rate=t["pass_rate"], total=t["total"])
    out[-1] += _band_text(band)
    return lines + out + _eager_lines(plan)


def _alltoall_lines(plan: dict) -> list:
    """The MoE all-to-all's share of the passes above, where an EP group spans nodes (plan_model.expert_alltoall)."""
    a2a, lay = plan["time"]["alltoall"], plan["layout"]
    if not a2a["seconds"]:
        return []
    text = (f"of which MoE all-to-all across nodes {a2a['step_seconds']:.0f} ({a2a['sends']} sends of "
            f"{a2a['seconds']:.0f}: 2 a forward, 4 an update, 6 with recompute): EP{lay.ep} x ETP{lay.expert_tp} = "
            f"{lay.ep * lay.expert_tp} GPUs span {a2a['nodes']} nodes, {a2a['off_node']:.0%} of the routed tokens "
            f"leave the node, {a2a['bytes'] / GB:.0f} GB a GPU a send at {plan['assume']['alltoall_gb_per_s']} GB/s "
            f"(plan.assume.alltoall_gb_per_s)")
    return textwrap.wrap(text, 117, initial_indent="      ", subsequent_indent="      ")


def _eager_lines(plan: dict) -> list:
    """What decoding without CUDA graphs costs in this plan, and the step at the top of the published range."""
    if "eager_high" not in plan["time"]:
        return []
    g, a, arch = plan["gen"], plan["assume"], plan["arch"]
    layers = -(-arch.num_layers // g["pp"])
    high_ms, high_s = plan["time"]["eager_high"]
    per_layer = a["eager_layer_ms"]
    text = (f"no CUDA graphs ({g['engine']}: nemo_dapo/core/engine_registry.py, or plan.cuda_graphs): the host "
            f"launches {layers} layers x {per_layer} ms = {layers * per_layer:.1f} ms of kernels a decode step "
            f"(plan.assume.eager_layer_ms), longer than the GPU's work at small batches (the tail); at {high_ms} ms a "
            f"layer, the top of the published range, the step is {high_s:.0f} s ({high_s / 60:.0f} min)")
    return textwrap.wrap(text, 117, initial_indent="  ", subsequent_indent="      ")


def _band_text(band) -> str:
    if band is None:
        return ""
    return f", {band['low']:+.0%} / {band['high']:+.0%} on published runs"


LAYOUT_ASSUMPTIONS = (
    "steady state: every step generates its share; the first step's cold start is not counted",
    "partial rollouts: a response admitted at a uniform point of a generation phase may decode the rest of it plus "
    "max_staleness phases, else it is dropped and generated again; the suspended requests' KV is recomputed after "
    "each refit at the log-prob passes' utilisation",
    "disaggregated: the trainer keeps the recipe's TP / PP / CP / EP with DP shrunk and the same utilisation (linear "
    "in GPUs), the engines the recipe's engine layout; no sleep, wake or offload; the split is whole nodes",
    "one-step-off: step = max(train side, generation side) + network refit at max_staleness >= 1, their sum at 0; "
    "the refit sends the whole bf16 model at network_gb_per_s and stalls both sides (no double-buffered weights); "
    "a deeper staleness absorbs timing noise (not modelled) but no step is shorter than its slower side",
    "built: the trainer's rollout.overlap runs one prompt-order round (the step's responses x min(round_tokens, "
    "E[L]) tokens at the full-batch rate) beside the train side; the rest of generation runs in turn with it",
)


def _layout_detail(key: str, row: dict, plan: dict) -> str:
    parts = " + ".join(f"{k} {v:.0f}" for k, v in row["parts"].items())
    if key.startswith("colocated"):
        text = parts
    else:
        lay, p = row["trainer_layout"], row["parts"]
        join = "max({}, {})".format(*[f"{k} {p[k]:.0f}" for k in ("train side", "generation side")]) \
            if row["overlap"] else f"train side {p['train side']:.0f} + generation side {p['generation side']:.0f}"
        text = (f"{row['trainer_nodes']} trainer nodes ({lay.world} GPUs, TP{lay.tp} PP{lay.pp} CP{lay.cp} "
                f"EP{lay.ep} DP{lay.dp}, {row['trainer_memory'] / GB:.1f} GB/GPU) + {row['engine_gpus']} engine GPUs "
                f"({row['engines']} engines; split: {row['chosen']}): {join} + network refit {p['network refit']:.0f}"
                f" ({2 * plan['arch'].total_params() / GB:.0f} GB at {plan['assume']['network_gb_per_s']} GB/s); "
                f"train side = " + " + ".join(f"{k.replace('_', ' ')} {v:.0f}" for k, v in row["train"].items()))
        if "prefill" in row:
            text += f"; generation includes re-prefill {row['prefill']:.0f}"
    if "dropped" in row:
        text += (f"; {row['dropped']:.1%} of responses outlive max_staleness and are generated again "
                 f"({row['wasted']:.1%} of generated tokens wasted)")
    if "built" in row:
        b = row["built"]
        text += (f"; what the trainer builds (trainer.dapo.rollout.overlap, prompt-order rounds) overlaps one round "
                 f"of round_tokens={plan['async']['round_tokens']} ({b['round']:.0f}), hiding {b['hidden']:.0f}: "
                 f"step {b['step'] / 60:.0f} min")
    return text


def fastest(rows: dict) -> str:
    """The layout with the shortest step among those estimated (plan["layouts"]; a refused one has no step)."""
    fine = {k: r for k, r in rows.items() if "refused" not in r}
    return min(fine, key=lambda k: fine[k]["step"])


def format_layouts(plan: dict, band) -> list:
    """Report lines: the step under each layout (plan_async.py), the fastest, and the layout assumptions."""
    from nemo_dapo.cluster.plan_async import LAYOUT_LABELS

    rows, base, s = plan["layouts"], plan["layouts"]["colocated"]["step"], plan["async"]
    lines = ["", f"layouts (est., the same {plan['layout'].world} GPUs; nemo_dapo/cluster/plan_async.py; "
                 f"plan.async.max_staleness={s['max_staleness']}, old_logprob_pass={s['old_logprob_pass']})"]
    for key, label in LAYOUT_LABELS.items():
        row = rows[key]
        if "refused" in row:
            lines += textwrap.wrap(f"{label:<48} not estimated: {row['refused']}", 117, initial_indent="  ",
                                   subsequent_indent="      ")
            continue
        mark = "  <- what the recipe runs" if key == "colocated" else ""
        lines.append(f"  {label:<46}{row['step']:7.0f} s ({row['step'] / 60:3.0f} min) {base / row['step']:5.2f}x"
                     f"  {_layout_band(key, band)}{mark}")
        lines += textwrap.wrap(_layout_detail(key, row, plan), 115, initial_indent="      ",
                               subsequent_indent="      ")
    best = fastest(rows)
    if best == "colocated":
        lines.append(f"  fastest: {LAYOUT_LABELS[best]} (no other layout estimated here is faster)")
    else:
        lines.append(f"  fastest: {LAYOUT_LABELS[best]}, {base / rows[best]['step']:.2f}x faster than today "
                     f"({rows[best]['step']:.0f} s vs {base:.0f} s per step, est.)")
    lines.append("  layout assumptions:")
    for text in LAYOUT_ASSUMPTIONS:
        lines += textwrap.wrap(text, 115, initial_indent="    ", subsequent_indent="      ")
    return lines


CHECKPOINT_BYTES_PER_PARAM = 2 + 12  # bf16 weights + Adam's fp32 master weights, m and v (plan_model.py)


def format_run(plan: dict) -> list:
    """Report lines: the whole run's wall time and GPU-hours, as the recipe runs and in the fastest layout."""
    from nemo_dapo.cluster.plan_async import LAYOUT_LABELS

    steps, epochs, world = plan["run"]["max_steps"], plan["run"]["max_epochs"], plan["layout"].world
    head = ("whole run (est.; rollout steps only: validation, checkpoint writes and the first step's cold start not "
            "counted)")
    if not isinstance(steps, int) or isinstance(steps, bool):
        text = f"trainer.dapo.max_steps={steps!r} is not an integer: not estimated (fix: rollout steps, or -1)"
        return ["", head, f"  {text}"]
    if steps < 1:
        text = (f"trainer.dapo.max_steps={steps}: the run ends after max_epochs={epochs} passes over the prompts, a "
                "length the plan does not know (the steps times the step above)")
        return ["", head, *textwrap.wrap(text, 117, initial_indent="  ", subsequent_indent="      ")]
    rows = plan["layouts"]
    best = fastest(rows)

    def hours(step_s: float) -> str:
        return f"{steps * step_s / 3600:.0f} h, {steps * step_s / 3600 * world / 1e3:.1f}k GPU-hours"

    text = (f"{steps} rollout steps (trainer.dapo.max_steps; max_epochs={epochs} may end it sooner) on {world} GPUs: "
            f"{hours(rows['colocated']['step'])} as the recipe runs")
    if "eager_high" in plan["time"]:
        text += f" ({hours(plan['time']['eager_high'][1])} at {plan['time']['eager_high'][0]} ms a layer)"
    if best != "colocated":
        text += f"; {hours(rows[best]['step'])} with {LAYOUT_LABELS[best]} (the fastest)"
    return ["", head, *textwrap.wrap(text, 117, initial_indent="  ", subsequent_indent="      "),
            *_checkpoint_lines(plan)]


def _checkpoint_lines(plan: dict) -> list:
    """The size of one checkpoint (bf16 weights + Adam's fp32 master weights and moments: 2 + 12 bytes a parameter,
    plan_model.py's optimizer bytes) and what the kept ones hold on disk."""
    run, size = plan["run"], CHECKPOINT_BYTES_PER_PARAM * plan["arch"].total_params()
    top_k = run["save_top_k"]
    kept = (f"save_top_k={top_k} best + the latest: up to {(top_k + 1) * size / 1e12:.1f} TB on disk"
            if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k >= 0 else f"save_top_k={top_k!r}")
    text = (f"each checkpoint {size / 1e12:.2f} TB ({CHECKPOINT_BYTES_PER_PARAM} bytes a parameter: bf16 weights, "
            f"fp32 master weights and Adam moments), written every trainer.dapo.save_interval={run['save_interval']} "
            f"steps; {kept}")
    return textwrap.wrap(text, 117, initial_indent="  ", subsequent_indent="      ")


def _layout_band(key: str, band) -> str:
    if band is None:
        return ""
    kind = band.get("layouts", {}).get(key)
    if kind is None:
        return "uncalibrated"
    return f"{kind['low']:+.0%} / {kind['high']:+.0%} on {kind['rows']} run{'s' if kind['rows'] > 1 else ''}"


def format_plan(plan: dict, title: str = "", band=None) -> str:
    """The printed plan; ``band``: plan_calibration.error_band() (None: not shown)."""
    arch, gpu, lay, g, t, a = plan["arch"], plan["gpu"], plan["layout"], plan["gen"], plan["time"], plan["assume"]
    gb = lambda x: f"{x / GB:7.1f}"  # noqa: E731
    moe = (f", {arch.num_moe_experts} experts top-{arch.moe_router_topk} of width {arch.moe_ffn_hidden_size}"
           + (f", shared expert {arch.moe_shared_expert_size}" if arch.moe_shared_expert_size
              else ", no shared expert")
           if arch.is_moe else "")
    etp = "ETP=TP" if lay.etp is None else f"ETP{lay.etp}"
    lines = [f"nemo-dapo plan {title}".rstrip() + "  -- ESTIMATES from closed-form arithmetic, not measurements",
             f"cluster     {lay.world} x {gpu.name} ({gpu.memory_gb:.0f} GB, {gpu.hbm_tb_s} TB/s, "
             f"{gpu.bf16_tflops:.0f} TFLOP/s bf16 dense; {gpu.source})",
             f"model       {arch.name or 'model'}: {arch.total_params() / 1e9:.2f} B params, "
             f"{arch.active_params() / 1e9:.2f} B active{moe}, head dim {arch.head_dim}",
             f"training    TP{lay.tp} PP{lay.pp} CP{lay.cp} EP{lay.ep} ({etp}) -> DP {lay.dp}, expert-DP "
             f"{lay.expert_dp}, sequence parallel {'on' if lay.sequence_parallel else 'off'}"]
    if "server" in g:
        lines += format_server(g["server"], g["kv"], g["concurrency"], g["engine"], g["scheduler"])
    elif g["trt"]:
        lines.append(f"generation  TRT-LLM engines TP{g['tp']} PP{g['pp']} x {t['engines']}, static batch {g['batch']}"
                     f", KV reserved for {g['max_seq']} tokens/seq ({g['kv_per_token'] / KIB:.0f} KiB/token/GPU)")
    phases = plan["phases"]
    off = [k for k, v in g["offloaded"].items() if v]
    lines += ["", "per-GPU memory, GB (est.)      " + "".join(f"{PHASE_LABELS[p]:>9}" for p in phases)
              + (f"   (on the host while generating: {', '.join(off)}; the refit keeps the weights)" if off else "")]
    names = {"weights": "weights (bf16)", "grads": "main grads", "optimizer": "Adam states (fp32 master, m, v)",
             "activations": "activations (recompute as set)", "logits": "log-prob logits (chunked)",
             "engine_weights": "engine weights (bf16)", "kv_cache": "engine KV cache"
             + (" (free fraction)" if "server" in g else " (static batch)"),
             "refit_buckets": "refit buckets (2 x bucket_mb)", "results_gather": "results exchange (broadcast)",
             "engine_workspace": "engine workspace (GUESS)", "cuda_reserved": "CUDA context + NCCL (GUESS)"}
    for key, label in names.items():
        if any(key in p for p in phases.values()):
            lines.append(f"  {label:<31}" + "".join(f"  {gb(p[key]) if key in p else '      -'}"
                                                    for p in phases.values()))
    verdict = "fits" if plan["fits"] else "DOES NOT FIT"
    lines.append(f"  {'total':<31}" + "".join(f"  {gb(sum(p.values()))}" for p in phases.values())
                 + f"   budget {gb(plan['budget']).strip()} ({a['usable_fraction']:.0%} of {gpu.memory_gb:.0f})"
                 f" -> {verdict}")
    lines += [*_format_time(plan, band), *format_layouts(plan, band), *format_run(plan), "",
              "assumptions (plan.assume.*; one set for every recipe and calibration row):"]
    for key, value in a.items():
        lines += textwrap.wrap(f"{key}={value}: {ASSUMPTIONS[key][1]}", 117, initial_indent="  ",
                               subsequent_indent="      ")
    if band is not None:
        lines += textwrap.wrap(f"calibration: on {band['rows']} published runs ({band['names']}) the step estimate was"
                               " "
                               f"{band['low']:+.0%} .. {band['high']:+.0%} off and each published phase "
                               f"{band['phase_low']:+.0%} .. {band['phase_high']:+.0%} (benchmarks/calibration/)",
                               119)
    lines.append("formulas and sources: nemo_dapo/cluster/plan*.py (module docstrings)")
    return "\n".join(lines)
