"""Partial rollouts vs abort, or prompt-order vs finishing-order fill, on the CPU job: measured in one run.

Runs ``nemo-dapo train`` (the tiny_cpu recipe through an engine server, streaming dynamic sampling) once per
(policy, seed) for ``rollout.on_filler_full`` = abort (the baseline) and suspend (partial rollouts, max_staleness
1), all from the same base model and stopped by the same budget of generated responses, one run at a time. From each
run's counters it takes

  discarded fraction       tokens generated and thrown away (abort: the aborted requests; suspend: partial work
                           dropped past max_staleness, plus what is still suspended when the run ends) / generated
  tokens per trained resp. generated tokens / trained responses, and where they went: trained, discarded, and the
                           rest (groups dynamic sampling filtered out, the surplus left when the run ends)
  never trained            1 - trained tokens / generated tokens (also the groups dynamic sampling filters out and
                           the surplus left when the run ends: the same for both policies up to the surplus)
  held-out accuracy        summary.json's final_accuracy (eval.n_samples samples per problem)

  RL seconds               the sum of the rollout steps' wall time (timing/step_s)
  time to fill             the median over steps of timing/to_last_needed_s (until the filler was full)
  engine idle              the share of RL seconds with no request in flight (timing/engine_idle_s)
  trained lag              the trained tokens' mean weight-version lag, averaged over steps
  update size              the median over steps after the first of actor/approx_kl (how far a step's updates move
                           the policy on its batch)
  stale mismatch           the median over steps of partial/logp_mismatch_stale (how far the weights moved between
                           sampling the trained tokens older weights sampled and training them)
  left out                 responses algorithm.reject_logp_diff left out of the loss (actor/rejected) per trained
                           response
  cut off a step           tokens aborted (abort) or held suspended at a step's end (suspend), per step
  capped                   the mean over steps of actor/is_capped (the share of trained tokens whose importance
                           weight algorithm.tis_cap truncated: how far the correction is from exact)

and prints one row per run, the medians per policy and a RESULT line of key=value fields (the second policy's medians
against the first's). ``--compare fill_order`` measures the cost of the reproducible mode instead: both with abort,
``rollout.fill_order`` = finish (the baseline) against prompt; ``--compare suspend_order`` the same with partial
rollouts (prompt order then generates in rounds of ``rollout.round_tokens``). ``--compare overlap``: partial rollouts
without (the baseline) and with ``rollout.overlap`` (the engine process generates while the trainer trains; add
``rollout.fill_order=prompt`` for the reproducible overlap, one round during the update), ``--compare
overlap_prompt``: the synchronous loop in finishing order against that reproducible overlap, each run's RL
seconds per 1,000 trained responses, with each run's ``plots/time.png`` and ``plots/staleness.png``; run it with
``trainer.threads=1 rollout.processes=1 "trainer.cpus=[1]" "rollout.server.cpus=[0]"`` so that the trainer and the
engine (one thread each) have one core each, the same in both (``taskset -c 0,1`` instead: the same two cores,
shared).

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/partial_rollouts.py --base-model DIR [--seeds 3] [--engine local]
        [--config-name tiny_cpu_long]

``--base-model``: a warmed model directory (a run's ``base_model/``), so that the runs measure RL only.
A run folder that already holds a ``summary.json`` is reused, not rerun; linked folders (runs made at another time)
are counted in ``linked_runs`` with a warning, since their RL times were not measured beside the other policy's.
``--second-override KEY=VALUE`` (repeatable) sets a key for the second policy's runs only (a cached run that differs is
refused). ``--budget-ratio R`` gives the second policy R x the budget (the same RL time as the first, if R is the
inverse of its time ratio); ``--max-steps N`` stops every run after N updates (with a ``--max-samples`` too large to
stop it first: the same number of updates for both). With ``trainer.val_every=K`` among the overrides it prints the
held-out accuracy of both policies after every K-th step, paired by seed. ``--reeval N``: each run's final model again
on N held-out problems x ``--reeval-samples`` (one held-out file for all runs, written to OUT, each result cached in
RUN/reeval_N_K.json), since the run's own evaluation (128 x 2 responses) has a sampling error of ~0.03 per run, as
large as the differences it is asked to resolve; it prints a second RESULT line (the base model's, each policy's mean
and spread over the seeds, and the change paired by seed).
``--quick`` (what ``tests/benchmarks/test_benchmarks_smoke.py`` runs): one seed, 256 responses unless
``--max-samples``, 16 held-out problems; without ``--base-model`` the first run warms a base for 20 steps and the
second starts from it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPARISONS = {
    "on_filler_full": {"abort": ["rollout.on_filler_full=abort"],
                       "suspend": ["rollout.on_filler_full=suspend", "rollout.max_staleness=1"]},
    "fill_order": {"finish": ["rollout.on_filler_full=abort", "rollout.fill_order=finish"],
                   "prompt": ["rollout.on_filler_full=abort", "rollout.fill_order=prompt"]},
    # partial rollouts in finishing order (the baseline) vs prompt order (rounds of rollout.round_tokens)
    "suspend_order": {"finish": ["rollout.on_filler_full=suspend", "rollout.max_staleness=1",
                                 "rollout.fill_order=finish"],
                      "prompt": ["rollout.on_filler_full=suspend", "rollout.max_staleness=1",
                                 "rollout.fill_order=prompt"]},
    # one-step-off: the engine process generates while the trainer process trains (one thread each)
    "overlap": {"sync": ["rollout.on_filler_full=suspend", "rollout.max_staleness=1", "rollout.overlap=false"],
                "overlap": ["rollout.on_filler_full=suspend", "rollout.max_staleness=1", "rollout.overlap=true"]},
    # the fastest synchronous loop (partial rollouts in finishing order) vs the reproducible one-step-off (prompt
    # order: one round of rollout.round_tokens while the trainer trains)
    "overlap_prompt": {"sync": ["rollout.on_filler_full=suspend", "rollout.max_staleness=1", "rollout.overlap=false",
                                "rollout.fill_order=finish"],
                       "overlap": ["rollout.on_filler_full=suspend", "rollout.max_staleness=1", "rollout.overlap=true",
                                   "rollout.fill_order=prompt"]},
}


def every_run(args) -> list:
    """Keys every run sets, before the comparison's and the caller's: the streamed engine loop, and the truncated
    importance weights that partial rollouts need (and any key that reads the sampler's log-probs)."""
    return [f"rollout.engine={args.engine}", "rollout.streaming=true", "algorithm.tis_cap=2.0"]


def second_policy(args) -> str:
    return list(COMPARISONS[args.compare])[1]


def policy_overrides(policy: str, args) -> list:
    """``--second-override`` applies to the second policy's runs only (after the overrides for every run)."""
    return list(args.second_override) if policy == second_policy(args) else []


def check_cached(run_dir: str, ran: dict, overrides: list) -> None:
    """Refuse a cached run whose config differs from a policy override (another --out is needed)."""
    for item in overrides:
        key, _, value = item.partition("=")
        key = key.lstrip("+")  # Hydra's +key=value / ++key=value add or force a key: the same key in the config
        node = ran
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node != yaml.safe_load(value):
            raise SystemExit(f"{run_dir} ran {key}={node}, not {value} (--second-override): use another --out")


def budget(policy: str, args) -> int:
    """The response budget of ``policy``'s runs: ``--budget-ratio`` x ``--max-samples`` for the second policy."""
    return round(args.max_samples * args.budget_ratio) if policy == second_policy(args) else args.max_samples


def run_once(out: str, policy: str, seed: int, args) -> dict:
    """One run of ``policy`` at ``seed`` (trained unless its folder holds a finished run of the same budget) and
    its measures."""
    run_dir = os.path.join(out, f"{policy}_seed{seed}")
    ensure_run(run_dir, policy, seed, args)
    return dict(policy=policy, seed=seed, **run_measures(run_dir),
                linked=os.path.islink(run_dir))  # a run made elsewhere, at another time (another machine speed)


def ensure_run(run_dir: str, policy: str, seed: int, args) -> None:
    """Train ``run_dir`` unless it holds a finished run; refuse a cached one of another budget or overrides."""
    base = [f"model.path={args.base_model}"] if args.base_model else ["warmup.max_steps=20", "warmup.min_steps=1"]
    overrides = ["--config-name", args.config_name, f"run_dir={run_dir}", *base, f"seed={seed}",
                 *every_run(args), f"trainer.max_samples={budget(policy, args)}",
                 f"trainer.max_steps={args.max_steps}",
                 "trainer.val_every=0", f"data.heldout_size={args.heldout}", f"eval.n_samples={args.eval_samples}",
                 f"trainer.plots={str(args.compare.startswith('overlap')).lower()}",  # RUN/plots/{time,staleness}.png
                 *COMPARISONS[args.compare][policy], *args.override, *policy_overrides(policy, args)]
    if not os.path.exists(os.path.join(run_dir, "summary.json")):
        with open(run_dir + ".log", "w") as log:
            subprocess.run([sys.executable, "-m", "nemo_dapo.cli", "train", *overrides], cwd=ROOT, stdout=log,
                           stderr=subprocess.STDOUT, check=True)
    with open(os.path.join(run_dir, "config.yaml"), encoding="utf-8") as f:  # a cached run of another budget
        config = yaml.safe_load(f)
    ran = config["trainer"]
    for key, want in (("max_samples", budget(policy, args)), ("max_steps", args.max_steps)):
        if ran[key] != want:
            raise SystemExit(f"{run_dir} ran trainer.{key}={ran[key]}, not {want}: use another --out")
    check_cached(run_dir, config, policy_overrides(policy, args))


def run_measures(run_dir: str) -> dict:
    """A finished run's measures, from its metrics.jsonl and summary.json (per trained response where named so)."""
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    last = [r for r in rows if "counters/generated_tokens" in r][-1]
    with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    generated, trained = last["counters/generated_tokens"], last["counters/trained_samples"]
    discarded = last["counters/aborted_tokens"] + last.get("partial/stale_tokens", 0.0) + \
        last.get("partial/suspended_tokens", 0.0)
    steps = [r for r in rows if "timing/step_s" in r]
    trained_tokens = last["counters/trained_tokens"]
    return dict(generated_tokens=generated, trained_responses=trained,
                trained_tokens_per_trained=trained_tokens / trained, discarded_per_trained=discarded / trained,
                filtered_per_trained=(generated - trained_tokens - discarded) / trained,
                rl_seconds=sum(r["timing/step_s"] for r in steps),
                s_per_1k_trained=1000 * sum(r["timing/step_s"] for r in steps) / trained,
                to_filled_s=statistics.median(r["timing/to_last_needed_s"] for r in steps),
                discarded_frac=discarded / generated, tokens_per_trained=generated / trained,
                untrained_frac=1.0 - trained_tokens / generated,
                engine_idle_frac=sum(r.get("timing/engine_idle_s", 0.0) for r in steps) / sum(
                    r["timing/step_s"] for r in steps),
                trained_lag_mean=statistics.mean(r.get("partial/trained_lag_mean", 0.0) for r in steps),
                accuracy=summary["final_accuracy"], base_accuracy=summary["base_accuracy"],
                steps=last["counters/rollout_steps"],
                all_wrong=sum(r.get("filter/filtered_all_wrong", 0.0) for r in rows),
                # unfinished work a step leaves (suspend: held suspended at its end; abort: thrown away), per step
                cut_off_per_step=(last["counters/aborted_tokens"] + sum(r.get("partial/suspended_tokens", 0.0)
                                                                        for r in steps)) / len(steps),
                batch_acc=[r["train/batch_acc"] for r in steps],  # the trained batch's accuracy, step by step
                batch_samples=statistics.median(r.get("train/batch_samples", 0.0) for r in steps),
                val={r["step"]: r["val/accuracy"] for r in rows if "val/accuracy" in r},  # trainer.val_every > 0
                # a step's parts, over the steps after the first (which no overlap can shorten)
                **{f"step_{k}": statistics.median(r[f"timing/{k}"] for r in steps[1:] or steps)
                   for k in ("step_s", "gen_s", "old_logp_s", "update_s")},
                # runs made before the refit was timed have none
                step_refit_s=statistics.median(r.get("timing/refit_s", math.nan) for r in steps[1:] or steps),
                # how far a step's updates move the policy on its batch, over the same steps
                approx_kl=statistics.median(r["actor/approx_kl"] for r in steps[1:] or steps),
                # how far the weights moved between sampling a trained token and training it, seen on the tokens
                # older weights sampled (steps with none have no such line; nan when no step had any)
                stale_mismatch=or_nan(statistics.median, (r["partial/logp_mismatch_stale"] for r in steps
                                                          if "partial/logp_mismatch_stale" in r)),
                # the share of trained tokens whose importance weight tis_cap truncated (nan without TIS)
                capped_frac=or_nan(statistics.mean, (r["actor/is_capped"] for r in steps if "actor/is_capped" in r)),
                # responses algorithm.reject_logp_diff left out of the loss, per trained response (each update
                # counts its own: with ppo_epochs > 1 a response is counted once per epoch)
                rejected_frac=sum(r.get("actor/rejected", 0.0) * r.get("actor/updates", 0.0) for r in steps) / max(
                    sum(r.get("train/batch_samples", 0.0) for r in steps), 1.0))


def or_nan(stat, values) -> float:
    """``stat`` (statistics.median, statistics.mean) of ``values``, nan when there are none."""
    values = list(values)
    return stat(values) if values else math.nan


def steps_paired(results: list, a: str, b: str) -> bool:
    """Whether both policies train as many responses a step (the median over each run's steps, then its policy's
    runs), so that a step of one can stand beside the same step of the other (not so with --second-override
    trainer.train_batch_size)."""
    sizes = [statistics.median(r["batch_samples"] for r in results if r["policy"] == p) for p in (a, b)]
    return sizes[0] == sizes[1]


def batch_acc_shift(results: list, a: str, b: str, lag: int) -> float:
    """Mean of b's trained-batch accuracy at step k minus a's at step k - lag, over the seeds and the steps both ran.

    0 at lag 1 says b's batches are a's one step later, as batches sampled one version back would be."""
    curves = {(r["policy"], r["seed"]): r["batch_acc"] for r in results}
    diffs = [cb[k] - ca[k - lag] for (p, s), cb in curves.items() if p == b
             for ca in [curves[a, s]] for k in range(lag, min(len(ca) + lag, len(cb)))]
    return statistics.mean(diffs) if diffs else float("nan")  # runs shorter than the lag


def val_by_step(results: list, a: str, b: str) -> list:
    """(step, ``paired_change`` of the held-out accuracies) at every step where both policies of every seed ran a
    held-out validation (``trainer.val_every``); the step counts updates, so a row compares the two after the same
    number of rollout steps (updates)."""
    curves = {(r["policy"], r["seed"]): r["val"] for r in results}
    seeds = sorted({s for _, s in curves})
    common = set.intersection(*(set(c) for c in curves.values())) if curves else set()
    return [(step, paired_change({key: curve[step] for key, curve in curves.items()}, a, b, seeds))
            for step in sorted(common)]


def paired_change(acc: dict, a: str, b: str, seeds) -> dict:
    """Policy ``b`` against ``a`` over ``seeds``, from ``acc[policy, seed]``: each policy's mean and spread over the
    seeds (sample standard deviation; nan for one seed), the change b - a paired by seed, its standard error and how
    many seeds it lowers. The spread is the second reading of "within seed noise": a change smaller than the seeds'
    own scatter, beside the paired standard error that asks whether the change is systematic."""
    seeds = list(seeds)
    change = [acc[b, s] - acc[a, s] for s in seeds]
    many = len(seeds) > 1
    out = {"mean_change": statistics.mean(change), "lower": sum(d < 0 for d in change),
           "change_se": statistics.stdev(change) / len(change) ** 0.5 if many else float("nan")}
    for p in (a, b):
        values = [acc[p, s] for s in seeds]
        out[f"accuracy_{p}"] = statistics.mean(values)
        out[f"seed_sd_{p}"] = statistics.stdev(values) if many else float("nan")
    return out


def reeval(out: str, results: list, args) -> None:
    """Each run's final model on ``args.reeval`` held-out problems x ``args.reeval_samples``; paired per seed."""
    from nemo_dapo.local.config import load_config
    from nemo_dapo.local.run_data import HELDOUT_SEED, make_task
    from nemo_dapo.local.run_eval import evaluate_model

    cfg = load_config(args.config_name, [*every_run(args), *args.override])  # the runs' config, for its eval keys
    if cfg.data.task != "arithmetic":
        raise SystemExit("--reeval needs the procedural task (data.task=arithmetic)")
    path = os.path.join(out, f"heldout_{args.reeval}.jsonl")
    with open(path + ".tmp", "w", encoding="utf-8") as f:  # the same problems as the runs' own evaluation, and more
        for row in make_task(cfg).rows("heldout", args.reeval, HELDOUT_SEED):
            f.write(json.dumps(row) + "\n")
    os.replace(path + ".tmp", path)
    e, k = cfg.eval, args.reeval_samples
    sampling = dict(temperature=e.temperature, top_p=e.top_p, max_new_tokens=e.max_new_tokens or
                    cfg.rollout.max_new_tokens)

    def avg_at_k(model_dir: str, cache: str, seed: int) -> float:
        old = {"model": None}
        if os.path.exists(cache):
            with open(cache, encoding="utf-8") as f:
                old = json.load(f)
        if old["model"] and os.path.realpath(old["model"]) == os.path.realpath(model_dir) and all(
                old[key] == value for key, value in sampling.items()):
            return old[f"avg@{k}"]
        res = evaluate_model(model_dir, path, fmt="verl", samples=k, seed=seed, **sampling)
        with open(cache + ".tmp", "w", encoding="utf-8") as f:
            json.dump(res, f)
        os.replace(cache + ".tmp", cache)
        return res[f"avg@{k}"]

    base = avg_at_k(args.base_model, os.path.join(out, f"reeval_base_{args.reeval}_{k}.json"), 1)
    acc = {}
    for r in results:
        run_dir = os.path.join(out, f"{r['policy']}_seed{r['seed']}")
        acc[r["policy"], r["seed"]] = avg_at_k(os.path.join(run_dir, "final_model"),
                                               os.path.join(run_dir, f"reeval_{args.reeval}_{k}.json"), r["seed"])
        print(f"re-evaluated {r['policy']:8s} seed {r['seed']}: {acc[r['policy'], r['seed']]:.4f} "
              f"(run's own {r['accuracy']:.3f})", flush=True)
    a, b = list(COMPARISONS[args.compare])
    c = paired_change(acc, a, b, range(1, args.seeds + 1))
    print(f"RESULT compare={args.compare} reeval_problems={args.reeval} reeval_samples={k} accuracy_base={base:.4f} "
          f"accuracy_{a}={c[f'accuracy_{a}']:.4f} accuracy_{b}={c[f'accuracy_{b}']:.4f} "
          f"mean_change={c['mean_change']:+.4f} change_se={c['change_se']:.4f} lower={c['lower']}_of_{args.seeds} "
          f"seed_sd_{a}={c[f'seed_sd_{a}']:.4f} seed_sd_{b}={c[f'seed_sd_{b}']:.4f}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-model", help="warmed base model directory (required unless --quick)")
    p.add_argument("--quick", action="store_true", help="1 seed, 256 responses (unless --max-samples), 16 held-out "
                   "problems")
    p.add_argument("--config-name", default="tiny_cpu", help="recipe (its base model: --base-model)")
    p.add_argument("--compare", default="on_filler_full", choices=sorted(COMPARISONS),
                   help="on_filler_full: abort vs suspend; fill_order: finish vs prompt (both abort); "
                   "suspend_order: finish vs prompt (both suspend); overlap: "
                   "suspend without vs with rollout.overlap (pin the trainer and the engine: trainer.cpus, "
                   "rollout.server.cpus); overlap_prompt: sync in finishing order vs overlap in prompt order")
    p.add_argument("--out", default=None, help="default runs/partial_rollouts (runs/fill_order with --compare "
                   "fill_order)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--engine", default="local", choices=("local", "vllm"))
    p.add_argument("--max-samples", type=int, default=None, help="response budget of every run (default 2560; 256 "
                   "with --quick)")
    p.add_argument("--max-steps", type=int, default=1000, help="a step budget (updates) for every run, beside "
                   "--max-samples: the same number of updates for both policies with a large --max-samples")
    p.add_argument("--budget-ratio", type=float, default=1.0, help="the second policy's budget, x --max-samples "
                   "(e.g. the first's RL time: 1.4 for an overlap at x0.71)")
    p.add_argument("--heldout", type=int, default=128)
    p.add_argument("--eval-samples", type=int, default=4)
    p.add_argument("--reeval", type=int, default=0, help="re-evaluate every final model on N held-out problems")
    p.add_argument("--reeval-samples", type=int, default=4, help="samples per problem of --reeval")
    p.add_argument("--second-override", action="append", default=[], metavar="KEY=VALUE",
                   help="an override for the second policy's runs only (repeatable; e.g. trainer.train_batch_size=8 "
                   "for the overlap)")
    p.add_argument("override", nargs="*", help="more key=value overrides for every run")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.heldout, args.eval_samples = 1, 16, 1
    elif not args.base_model:
        p.error("--base-model DIR is required (a run's base_model/), unless --quick")
    args.max_samples = args.max_samples or (256 if args.quick else 2560)
    args.out = args.out or os.path.join(ROOT, "runs", "partial_rollouts" if args.compare == "on_filler_full"
                                        else args.compare)  # runs/fill_order, runs/overlap
    return args


def run_all(args: argparse.Namespace) -> list:
    """Every seed's runs of both policies (reused where their folders hold a finished run), one line each."""
    os.makedirs(args.out, exist_ok=True)
    results = []
    for seed in range(1, args.seeds + 1):
        for policy in COMPARISONS[args.compare]:
            r = run_once(args.out, policy, seed, args)
            if not args.base_model:  # --quick: every later run starts from the first run's warm-up
                args.base_model = os.path.join(args.out, f"{policy}_seed{seed}", "base_model")
            results.append(r)
            print(f"{policy:8s} seed {seed}: discarded {r['discarded_frac']:.3f} | never trained "
                  f"{r['untrained_frac']:.3f} | tokens/trained response "
                  f"{r['tokens_per_trained']:.2f} | held-out {r['base_accuracy']:.3f} -> {r['accuracy']:.3f} | "
                  f"{r['steps']:.0f} steps, RL {r['rl_seconds']:.1f} s, to filled {r['to_filled_s']:.2f} s",
                  flush=True)
    return results


MEDIAN_KEYS = ("discarded_frac", "tokens_per_trained", "accuracy", "rl_seconds", "to_filled_s", "s_per_1k_trained",
               "engine_idle_frac", "trained_lag_mean", "trained_tokens_per_trained", "discarded_per_trained",
               "filtered_per_trained", "all_wrong", "cut_off_per_step", "step_step_s", "step_gen_s", "step_old_logp_s",
               "step_update_s", "step_refit_s", "approx_kl", "stale_mismatch", "rejected_frac", "capped_frac")


def medians(results: list, policies) -> dict:
    """policy -> the median over its seeds of each per-run measure in MEDIAN_KEYS (NaN where no run has it)."""
    return {pol: {k: or_nan(statistics.median, (r[k] for r in results if r["policy"] == pol and not math.isnan(r[k])))
                  for k in MEDIAN_KEYS}
            for pol in policies}


def paired_ratio(results: list, key: str, a: str, b: str, seeds) -> float:
    """The median over seeds of b's ``key`` / a's. The same seed starts both policies from the same state, and the
    benchmark runs a seed's two runs one after the other, so the per-seed ratio pairs them and follows a machine whose
    speed drifts over the benchmark less than the ratio of the two medians does."""
    by_seed = {(r["policy"], r["seed"]): r[key] for r in results}
    return statistics.median(by_seed[b, s] / by_seed[a, s] for s in seeds)


def report(results: list, args: argparse.Namespace) -> None:
    """The median lines, the per-seed comparison, the step-paired lines and the RESULT line."""
    policies = COMPARISONS[args.compare]
    med = medians(results, policies)
    acc = {pol: [r["accuracy"] for r in results if r["policy"] == pol] for pol in policies}
    for pol, m in med.items():
        spread = (max(acc[pol]) - min(acc[pol])) if acc[pol] else 0.0
        print(f"median {pol:8s}: discarded {m['discarded_frac']:.3f} | tokens/trained response "
              f"{m['tokens_per_trained']:.2f} (trained {m['trained_tokens_per_trained']:.2f}, discarded "
              f"{m['discarded_per_trained']:.2f}, filtered or left {m['filtered_per_trained']:.2f}) | held-out "
              f"{m['accuracy']:.3f} (seed range {spread:.3f}) | median step after the first {m['step_step_s']:.3f} s "
              f"(generation {m['step_gen_s']:.3f}, old log-probs {m['step_old_logp_s']:.3f}, update "
              f"{m['step_update_s']:.3f}, refit {m['step_refit_s']:.3f}, actor/approx_kl {m['approx_kl']:.2e}) | "
              f"stale tokens' logp mismatch {m['stale_mismatch']:.4f} | left out {m['rejected_frac']:.1%} | "
              f"capped {m['capped_frac']:.1%} | "
              f"all-wrong groups filtered {m['all_wrong']:.0f} | aborted or held suspended a step "
              f"{m['cut_off_per_step']:.0f} tokens")
    (name_a, a), (name_b, b) = med.items()
    seeds = range(1, args.seeds + 1)
    paired = paired_ratio(results, "tokens_per_trained", name_a, name_b, seeds)
    paired_time = paired_ratio(results, "s_per_1k_trained", name_a, name_b, seeds)
    acc_of = {(r["policy"], r["seed"]): r["accuracy"] for r in results}
    acc_change = [acc_of[name_b, s] - acc_of[name_a, s] for s in seeds]
    print(f"held-out accuracy, {name_b} against {name_a} per seed: {sum(d < 0 for d in acc_change)} of "
          f"{len(acc_change)} lower, mean change {statistics.mean(acc_change):+.3f}; mean {name_a} "
          f"{statistics.mean(acc[name_a]):.3f}, {name_b} {statistics.mean(acc[name_b]):.3f}")
    linked = sum(r["linked"] for r in results)
    if linked:  # a time ratio against runs made at another time measures the machine, not the policies
        print(f"WARNING: {linked} of {len(results)} run folders are links: their RL times were not measured beside "
              "the other policy's, so the time ratios below are not same-run ratios (each run's accuracy stands)")
    paired_steps = steps_paired(results, name_a, name_b)
    if paired_steps:
        shifts = ", ".join(f"lag {lag} {batch_acc_shift(results, name_a, name_b, lag):+.3f}" for lag in (0, 1, 2))
        print(f"trained batches' accuracy, {name_b} at step k minus {name_a} at step k - lag (mean over seeds and "
              f"steps): {shifts}")
    else:
        print(f"not paired step by step: {name_a} and {name_b} train different numbers of responses a step")
    for step, c in val_by_step(results, name_a, name_b) if paired_steps else ():
        print(f"held-out after step {step} (trainer.val_every): {name_a} {c[f'accuracy_{name_a}']:.3f}, "
              f"{name_b} {c[f'accuracy_{name_b}']:.3f}, change {c['mean_change']:+.3f} +- {c['change_se']:.3f}")
    print(f"RESULT compare={args.compare} seeds={args.seeds} responses={args.max_samples} max_steps={args.max_steps} "
          f"budget_ratio={args.budget_ratio} second_override={','.join(args.second_override) or 'none'} "
          f"engine={args.engine} linked_runs={linked} "
          f"discarded_{name_a}={a['discarded_frac']:.3f} discarded_{name_b}={b['discarded_frac']:.3f} "
          f"tokens_per_trained_ratio={b['tokens_per_trained'] / a['tokens_per_trained']:.3f} "
          f"tokens_per_trained_ratio_paired={paired:.3f} "
          f"rl_time_ratio={b['rl_seconds'] / a['rl_seconds']:.3f} "
          f"s_per_1k_trained_{name_a}={a['s_per_1k_trained']:.1f} "
          f"s_per_1k_trained_{name_b}={b['s_per_1k_trained']:.1f} "
          f"s_per_1k_trained_ratio={b['s_per_1k_trained'] / a['s_per_1k_trained']:.3f} "
          f"s_per_1k_trained_ratio_paired={paired_time:.3f} "
          f"to_filled_ratio={b['to_filled_s'] / a['to_filled_s']:.3f} "
          f"accuracy_{name_a}={a['accuracy']:.3f} accuracy_{name_b}={b['accuracy']:.3f} "
          f"engine_idle_{name_a}={a['engine_idle_frac']:.3f} engine_idle_{name_b}={b['engine_idle_frac']:.3f} "
          f"trained_lag_{name_a}={a['trained_lag_mean']:.3f} trained_lag_{name_b}={b['trained_lag_mean']:.3f}")


def main() -> int:
    args = parse_args()
    results = run_all(args)
    report(results, args)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    if args.reeval:
        reeval(args.out, results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
