"""The step of one recipe under four layouts, for `nemo-dapo plan`: today's colocated synchronous step, the same
with partial rollouts, and the disaggregated one-step-off layout (trainer nodes and engine nodes) without and with
partial rollouts. Imports nothing of NeMo, Megatron or torch. All figures are ESTIMATES of the same arithmetic as
the rest of the plan (plan_model.py, plan_generation.py), in steady state (the first step's cold start is not
counted).

Settings (``plan.async``): ``max_staleness`` S, the policy versions a response may span beyond the one it started
on (issue 22: a response spans at most S + 1 versions); ``trainer_nodes`` (disaggregated: the nodes that train,
the rest generate; null = the whole-node split with the shortest step); ``old_logprob_pass`` (the trainer's own
old-log-prob pass, the proximal policy of the decoupled objective; False = the engines' log-probs are the old
policy, as verl's ``use_rollout_log_probs``).

(1) Colocated synchronous: the plan's step (plan.py), generation under the recipe's engine model.
(2) Colocated + partial rollouts: when the filler is full the running requests are suspended and continue after
    the refit, so no step waits for a last wave: the engines decode the step's share of tokens at their full-batch
    rate R = C / step_s(C / PP, c) (the in-flight figures of plan_generation.py). A step needs n = prompts x G / q
    responses (q = pass rate with dynamic sampling, else 1); generation = n (E[L] + w / (1 - p)) / R +
    re-prefill, where a response admitted at a uniform point u of a generation phase of length T may decode
    x = (1 - u + S) T / step_s tokens before it spans more than S + 1 versions; past that it is dropped, its x
    tokens wasted (p = P(L > x) and w = E[x 1(L > x)], averaged over u), and generated again (the responses kept
    have the length distribution: no survivor bias is credited). The suspended requests' KV is recomputed after
    the refit (the weights changed): C requests x the mean in-flight context c, a forward at the log-prob passes'
    utilisation.
    At S = 0 nothing may continue: that is today's abort, and the layout is not offered.
(3) Disaggregated one-step-off: ``trainer_nodes`` x devices GPUs train with the recipe's TP / PP / CP / EP (DP
    shrinks; the same utilisation, i.e. linear scaling in GPUs), the others run engines of the recipe's engine
    layout; no sleep, wake or offload on either side. While the trainer trains on batch k the engines generate
    batch k + 1 with the previous weights, so at S >= 1 step = max(train side, generation side) + network refit,
    and at S = 0 (no overlap allowed) step = train side + generation side + network refit. The refit sends the
    whole bf16 model over the interconnect at ``network_gb_per_s`` (engines receive in parallel) and stalls both
    sides (no double-buffered engine weights). A larger S absorbs timing noise (not modelled) but cannot make a
    step shorter than its slower side.
(4) Disaggregated + partial rollouts: as (3), the engines generating continuously at their full-batch rate with the
    drop rule of (2), the phase being the whole step. The trainer builds less (``built``): with
    ``trainer.dapo.rollout.overlap`` it generates in prompt-order rounds and overlaps one round with the train
    side, a round of the step's responses x min(round_tokens, E[L]) tokens at the full-batch rate plus its
    re-prefill, so step = train side + generation side + refit - min(train side, generation side, round) (the drops
    of (4) kept).
Refused (a line saying why, no estimate): a split whose trainer GPUs do not divide into the recipe's training
layout or do not hold its training state; a cluster of one node (no whole-node split); an engine that spans nodes
(the validator's rule); ``network_gb_per_s`` <= 0 (plan.assume ranges).
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

from nemo_dapo.cluster.plan_engine_server import concurrency
from nemo_dapo.cluster.plan_generation import PlanError, ResponseLengths, generation_times
from nemo_dapo.cluster.plan_model import expert_alltoall, training_seconds
from nemo_dapo.core import engine_registry

GB = 1e9
UNIFORM_POINTS = 16  # midpoints over the admission point u of a generation phase
LAYOUT_LABELS = {"colocated": "colocated synchronous (today)",
                 "colocated_partial": "colocated + partial rollouts",
                 "disaggregated": "disaggregated one-step-off",
                 "disaggregated_partial": "disaggregated one-step-off + partial rollouts"}
KEY = "plan.async"


def settings(cfg: dict) -> dict:
    """``plan.async.*`` read strictly: every key must be set (conf/gpt_dapo_actor.yaml documents them)."""
    from nemo_dapo.cluster.config_load import select

    out = {}
    for key, kind in (("max_staleness", int), ("trainer_nodes", int), ("old_logprob_pass", bool)):
        value = select(cfg, f"{KEY}.{key}")
        if value is None and key != "trainer_nodes":
            raise PlanError(f"{KEY}.{key} is not set; fix: set it (conf/gpt_dapo_actor.yaml documents it)")
        bad = value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))
                                     or (kind is int and value < (0 if key == "max_staleness" else 1)))
        if bad:
            want = "an integer >= 0" if key == "max_staleness" else "an integer >= 1 or null" \
                if key == "trainer_nodes" else "true or false"
            raise PlanError(f"{KEY}.{key}={value!r} must be {want}")
        out[key] = value
    rounds = select(cfg, "trainer.dapo.rollout.round_tokens")
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        raise PlanError(f"trainer.dapo.rollout.round_tokens={rounds!r} must be an integer >= 1")
    out["round_tokens"] = rounds
    return out


def partial_seconds(lengths: ResponseLengths, *, responses: float, rate: float, step_s: float, staleness: int,
                    phase: Callable[[float], float], fixed: float = 0.0) -> dict:
    """Seconds one engine decodes ``responses`` at ``rate`` tokens/s when a running response continues across
    refits for at most ``staleness`` further versions (module docstring (2)); ``phase(gen)``: the length of one
    generation phase when generation takes ``gen`` seconds; ``fixed``: seconds added to generation (re-prefill).
    Returns the generation seconds, the dropped share of admitted responses and the share of decoded tokens that
    dropped responses waste."""
    if staleness < 1:
        raise PlanError(f"{KEY}.max_staleness=0: no response may continue after a refit (today's abort); partial "
                        "rollouts need it >= 1")
    mean = lengths.max_moment(1)

    def drops(gen: float) -> tuple:
        """(P(drop), E[tokens a dropped attempt wastes] per attempt) for a phase of gen seconds."""
        t = phase(gen)
        p = lost = 0.0
        for i in range(UNIFORM_POINTS):
            x = (1.0 - (i + 0.5) / UNIFORM_POINTS + staleness) * t / step_s
            p += (1.0 - lengths.cdf(x)) / UNIFORM_POINTS
            lost += min(x, lengths.l_max) * (1.0 - lengths.cdf(x)) / UNIFORM_POINTS
        return p, lost

    def needed(gen: float) -> float:
        p, lost = drops(gen)
        if p >= 1.0:
            return math.inf
        return responses * (mean + lost / (1.0 - p)) / rate + fixed

    low = responses * mean / rate + fixed  # no drops: the least it can take
    high = low
    for _ in range(60):  # needed() falls as the phase grows; the fixed point lies where gen = needed(gen)
        if needed(high) <= high:
            break
        high *= 2.0
    else:
        raise PlanError(f"{KEY}.max_staleness={staleness}: almost every response outlives its allowed versions "
                        f"(a phase is too short for the {lengths.l_max}-token cap); fix: raise it")
    for _ in range(60):
        mid = 0.5 * (low + high)
        low, high = (mid, high) if needed(mid) > mid else (low, mid)
    p, lost = drops(high)
    waste = lost / (1.0 - p)
    return {"generation": high, "dropped": p, "wasted": waste / (mean + waste), "prefill": fixed}


def layouts(cfg: dict, plan: dict, s: dict, *, training_state: Callable, bubble: Callable,
            step_fn: Callable) -> dict:
    """{layout: row} for the four layouts of the module docstring; a row is {"step", "parts", ...} or
    {"refused": reason}. ``s``: settings(cfg). ``training_state(cfg, arch, layout)``, ``bubble(cfg, layout, tokens_per_update)`` and
    ``step_fn`` (one engine's decode step, batch and context -> seconds) are plan.py's (passed in: plan.py imports
    this module)."""
    t, g = plan["time"], plan["gen"]
    rows = {"colocated": {"step": t["total"], "parts": _colocated_parts(t)}}
    if not t.get("gen") or "server" not in g:
        reason = "the recipe's engine is not an in-flight engine server (partial rollouts and a network refit " \
                 "need trainer.dapo.rollout_engine trtllm or vllm)"
        return {**rows, **{k: {"refused": reason} for k in LAYOUT_LABELS if k != "colocated"}}
    rows["colocated_partial"] = _guard(lambda: _colocated_partial(cfg, plan, s))
    splits = _splits(cfg, plan, s, training_state=training_state, bubble=bubble, step_fn=step_fn)
    if "refused" in splits:
        rows.update(disaggregated=splits, disaggregated_partial=splits)
        return rows
    for key, partial in (("disaggregated", False), ("disaggregated_partial", True)):
        tries = [_guard(lambda: _disaggregated(plan, s, trial, partial=partial)) for trial in splits["trials"]]
        fine = [r for r in tries if "refused" not in r]
        rows[key] = min(fine, key=lambda r: r["step"]) if fine else tries[0]
    return rows


def _guard(make: Callable) -> dict:
    try:
        return make()
    except PlanError as e:
        return {"refused": str(e)}


def _colocated_parts(t: dict) -> dict:
    return {"generation": t["generation"] or 0.0, "old log-probs": t["old_logprob"],
            "reference log-probs": t["reference_logprob"], "training": t["training"],
            "refit, offload, sleep and wake": t["refit_and_offload"]}


def _needed_responses(cfg: dict, plan: dict) -> float:
    """Responses generated per step when nothing is wasted: prompts x G, over the pass rate with dynamic sampling."""
    from nemo_dapo.cluster.config_load import select

    t = plan["time"]
    kept = select(cfg, "trainer.dapo.prompts_per_step") * select(cfg, "model.dapo.algorithm.group_size")
    return kept / t["pass_rate"] if t["oversample"] > 1.0 else kept


def _prefill_seconds(plan: dict, slots: float, context: float) -> float:
    """One engine recomputes the KV of ``slots`` suspended requests of ``context`` tokens (a forward)."""
    arch, gpu, g, t = plan["arch"], plan["gpu"], plan["gen"], plan["time"]
    flops = slots * context * (2 * arch.active_params() + arch.attention_flops_per_token(context))
    return flops / (g["tp"] * g["pp"] * gpu.bf16_tflops * 1e12 * t["logprob_hfu"])


def _colocated_partial(cfg: dict, plan: dict, s: dict) -> dict:
    t, gen = plan["time"], plan["time"]["gen"]
    responses = _needed_responses(cfg, plan) / t["engines"]
    fixed = _prefill_seconds(plan, gen["slots"], gen["inflight_context"])
    part = partial_seconds(t["lengths"], responses=responses, rate=gen["tokens_per_s"], step_s=gen["inflight_step_s"],
                           staleness=s["max_staleness"], phase=lambda x: x, fixed=fixed)
    parts = {**_colocated_parts(t), "generation": part["generation"] - fixed, "re-prefill after refit": fixed}
    return {"step": sum(parts.values()), "parts": parts, "dropped": part["dropped"], "wasted": part["wasted"]}


def _splits(cfg: dict, plan: dict, s: dict, *, training_state: Callable, bubble: Callable,
            step_fn: Callable) -> dict:
    """{"trials": [...]} of the trainer / engine splits to try (``plan.async.trainer_nodes``, or every whole-node
    split when null), each with its train side, engine side and network refit; or {"refused": why}."""
    from nemo_dapo.cluster.config_load import select

    nodes, devices = select(cfg, "trainer.num_nodes", 1), select(cfg, "trainer.devices", 1)
    if nodes < 2:
        return {"refused": f"trainer.num_nodes={nodes}: the disaggregated layout splits whole nodes between trainer "
                           "and engines; it needs >= 2"}
    wanted = [s["trainer_nodes"]] if s["trainer_nodes"] else list(range(1, nodes))
    if wanted[0] >= nodes:
        return {"refused": f"{KEY}.trainer_nodes={wanted[0]} leaves no engine node of trainer.num_nodes={nodes}; "
                           f"fix: set it in 1..{nodes - 1}"}
    lay = plan["layout"]
    mp, expert = lay.tp * lay.pp * lay.cp, lay.expert_tp * lay.ep * lay.pp
    group = mp * expert // math.gcd(mp, expert)
    tried, trials = [], []
    for n in wanted:
        if (n * devices) % group:
            continue
        trial = _trainer(cfg, plan, s, n * devices, devices, training_state=training_state, bubble=bubble)
        if "refused" in trial:
            tried.append(f"{n} of {nodes} nodes: {trial['refused']}")
            continue
        trial.update(trainer_nodes=n, engine_gpus=(nodes - n) * devices, network_refit=_network_refit(plan),
                     chosen="set" if s["trainer_nodes"] else "the shortest of every whole-node split")
        trial["engine"] = _engines(cfg, plan, trial["engine_gpus"], step_fn)
        trials.append(trial)
    if not trials:
        why = "; ".join(tried) or (f"the trainer's GPUs must be a multiple of {group} (TP x PP x CP = {mp}, ETP x EP x "
                                   f"PP = {expert}) and fewer than the {nodes * devices} of the cluster")
        return {"refused": f"no split of {nodes} nodes x {devices} GPUs holds the recipe's training layout: {why}; "
                           "fix: a training layout with a smaller model-parallel or expert group (model.*), or "
                           f"more nodes"}
    return {"trials": trials}


def _trainer(cfg: dict, plan: dict, s: dict, world: int, devices: int, *, training_state: Callable,
             bubble: Callable) -> dict:
    """The train side on ``world`` GPUs (``devices`` a node): the recipe's training layout with DP shrunk, its
    memory and seconds."""
    lay, t, a = plan["layout"], plan["time"], plan["assume"]
    layout = replace(lay, world=world)
    memory = {**training_state(cfg, plan["arch"], layout), "cuda_reserved": a["cuda_reserved_gb"] * GB}
    if sum(memory.values()) > plan["budget"]:
        return {"refused": f"training state {sum(memory.values()) / GB:.1f} GB/GPU > budget "
                           f"{plan['budget'] / GB:.1f} GB at DP {layout.dp}"}
    b = bubble(cfg, layout, t["seq_len"] * _global_batch(cfg))
    a2a = expert_alltoall(plan["arch"], layout, tokens=t["trained_tokens"], devices=devices,
                          gb_per_s=a["alltoall_gb_per_s"])
    secs = training_seconds(plan["arch"], plan["gpu"], world=world, tokens=t["trained_tokens"], seq_len=t["seq_len"],
                            hfu=t["hfu"], logprob_hfu=t["logprob_hfu"], recompute=t["recompute"],
                            logprob_passes=t["logprob_passes"], bubble=b, alltoall_s=a2a["seconds"])
    if not s["old_logprob_pass"]:
        secs["old_logprob"] = 0.0
    return {"layout": layout, "memory": memory, "train": secs, "train_side": sum(secs.values())}


def _global_batch(cfg: dict) -> int:
    from nemo_dapo.cluster.config_load import select

    return select(cfg, "model.global_batch_size")




def _engines(cfg: dict, plan: dict, engine_gpus: int, step_fn: Callable) -> dict:
    """The generation side on ``engine_gpus``: the recipe's engine layout, options and engine model, with the
    step's requests spread over fewer engines (concurrency and generation recomputed, plan_generation.py)."""
    from nemo_dapo.cluster.config_load import select

    t, g = plan["time"], plan["gen"]
    engines = engine_gpus // (g["tp"] * g["pp"])
    lengths, prompt = t["lengths"], plan["assume"]["mean_prompt_tokens"]
    group = select(cfg, "model.dapo.algorithm.group_size")
    requests = t["generated_samples"] / engines
    conc = concurrency(g["server"], g["kv"], scheduler=g["scheduler"], prompt=prompt, l_max=lengths.l_max,
                       mean_context=lengths.mean_context(1, prompt), requests=requests, group_size=group)
    gen = generation_times(lengths, requests=requests, group_size=group, static_batch=g["batch"],
                           pool_tokens=g["batch"] * g["max_seq"], prompt=prompt, needed=t["gen"]["needed"],
                           step_s=step_fn, pipeline_stages=g["pp"], max_slots=conc["slots"])
    return {"engines": engines, "gen": gen, "generation": gen[engine_registry.ENGINES[g["engine"]].plan],
            "responses": _needed_responses(cfg, plan) / engines}


def _network_refit(plan: dict) -> float:
    """Seconds to send the whole bf16 model over the interconnect once (the engines receive in parallel)."""
    return 2 * plan["arch"].total_params() / (plan["assume"]["network_gb_per_s"] * GB)


def _overlap(train_side: float, generation: float, refit: float, staleness: int) -> float:
    """One-step-off step: the slower side plus the refit when a version of lag is allowed, else both in turn."""
    return (max(train_side, generation) if staleness >= 1 else train_side + generation) + refit


def _disaggregated(plan: dict, s: dict, split: dict, *, partial: bool) -> dict:
    eng, t = split["engine"], plan["time"]
    generation, extra, refit, train_side = eng["generation"], {}, split["network_refit"], split["train_side"]
    if partial:
        gen = eng["gen"]
        fixed = _prefill_seconds(plan, gen["slots"], gen["inflight_context"])
        part = partial_seconds(t["lengths"], responses=eng["responses"], rate=gen["tokens_per_s"],
                               step_s=gen["inflight_step_s"], staleness=s["max_staleness"],
                               phase=lambda x: max(train_side, x) + refit, fixed=fixed)
        generation, extra = part["generation"], {"dropped": part["dropped"], "wasted": part["wasted"],
                                                 "prefill": fixed}
        # what the trainer builds (rollout.overlap, prompt order): one round of round_tokens per sample overlaps
        # the train side, the rest of generation runs in turn with it
        round_s = eng["responses"] * min(s["round_tokens"], t["lengths"].max_moment(1)) / gen["tokens_per_s"] + fixed
        hidden = min(train_side, generation, round_s)
        extra["built"] = {"step": train_side + generation + refit - hidden, "round": round_s, "hidden": hidden}
    return {"step": _overlap(train_side, generation, refit, s["max_staleness"]),
            "parts": {"train side": train_side, "generation side": generation, "network refit": refit},
            "trainer_nodes": split["trainer_nodes"], "engine_gpus": split["engine_gpus"], "engines": eng["engines"],
            "trainer_layout": split["layout"], "trainer_memory": sum(split["memory"].values()),
            "train": split["train"], "chosen": split["chosen"], "overlap": s["max_staleness"] >= 1, **extra}
