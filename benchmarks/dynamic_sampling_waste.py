"""Responses generated per trained response: the reference's dynamic sampling against ``BatchFiller``.

    python benchmarks/dynamic_sampling_waste.py            # batches 32/128/512 groups, 30 steps, 5 seeds
    python benchmarks/dynamic_sampling_waste.py --quick    # batch 32, 8 steps, 2 seeds (a few seconds)

Generation is simulated: every prompt draw gets a pass probability p ~ Beta(a, b) and its group of G = 16 responses
has Binomial(G, p) correct ones. A group is informative iff 0 < correct < G. Scenarios (Beta shapes):
  hard    Beta(0.15, 1.5)  early in training / hard data: mean pass rate 0.09, a third of the groups informative
  medium  Beta(0.3, 0.3)   U-shaped: prompts tend to be either solved or not
  easy    Beta(1.5, 0.2)   late in training / easy data: mean pass rate 0.88, many all-correct groups
  drift   hard -> easy     (a, b) moves linearly over the run, as the policy improves
Policies, each filling training batches of N groups for every step (no generation budget: every step completes):
  reference     generation batch 3N prompts; keep informative groups; refill with further 3N batches until N are
                kept; train on the first N and DISCARD the surplus (the reference recipe, REFERENCE.md section 2).
                Written out here independently of BatchFiller; a consistency check runs BatchFiller configured the
                same way (max_age=0, adaptive=False, gen_batch_size=3N) on the same random stream.
  ours          BatchFiller defaults: adaptive generation batch from the observed pass rate, surplus carried one step.
  carry_only    BatchFiller with adaptive=False and gen_batch_size=3N: separates carry-over from adaptive sizing.
Metric: generated groups / trained groups over the whole run (= responses per trained response, G cancels); groups
still held after the last step count as generated and not trained. Per-step means of generation batches, discarded
groups, and the share of trained groups that were generated in an earlier step (carried, one step off-policy).
Every number is the median over seeds. Counts only: machine load does not affect them. The "floor (1/P)" rows give
the fewest generated groups per trained group that any policy training on fresh informative groups can reach.
Ends with one line `RESULT key=value ...` (ratios ours / reference at the largest batch size).
"""
from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

G = 16
OVERSAMPLE = 3  # the reference's generation batch: 3x the training batch
SHAPES = {"hard": (0.15, 1.5), "medium": (0.3, 0.3), "easy": (1.5, 0.2)}
SCENARIOS = ("hard", "medium", "easy", "drift")


def beta_params(scenario: str, step: int, steps: int) -> tuple[float, float]:
    if scenario != "drift":
        return SHAPES[scenario]
    w = step / max(steps - 1, 1)
    (a0, b0), (a1, b1) = SHAPES["hard"], SHAPES["easy"]
    return a0 + w * (a1 - a0), b0 + w * (b1 - b0)


def keep_probability(a: float, b: float) -> float:
    """P(0 < Binomial(G, p) < G) for p ~ Beta(a, b), from the Beta moments E[p^k] = prod_i (a + i) / (a + b + i)."""
    all_right = math.prod((a + i) / (a + b + i) for i in range(G))
    all_wrong = math.prod((b + i) / (a + b + i) for i in range(G))
    return 1.0 - all_right - all_wrong


def draw_correct_counts(rng: random.Random, n: int, ab: tuple[float, float]) -> list:
    """Correct responses in each of n groups of G, for n fresh prompt draws."""
    out = []
    for _ in range(n):
        p = rng.betavariate(*ab)
        out.append(sum(rng.random() < p for _ in range(G)))
    return out


def run_reference(rng: random.Random, scenario: str, n_groups: int, steps: int) -> list:
    """Per-step dicts (generated, gen_batches, discarded, carried_in, trained) of the reference recipe."""
    log = []
    for step in range(steps):
        kept = generated = batches = 0
        while kept < n_groups:
            counts = draw_correct_counts(rng, OVERSAMPLE * n_groups, beta_params(scenario, step, steps))
            kept += sum(0 < k < G for k in counts)
            generated += len(counts)
            batches += 1
        log.append(dict(generated=generated, gen_batches=batches, discarded=kept - n_groups, carried_in=0,
                        trained=n_groups))
    return log


def run_filler(rng: random.Random, scenario: str, n_groups: int, steps: int, **filler_kw) -> tuple[list, int]:
    """Per-step dicts as in run_reference, driving BatchFiller as the training loop does; also groups left held."""
    import torch

    from nemo_dapo.core.dynamic_sampling import BatchFiller, Group

    acc = [torch.tensor([1.0] * k + [0.0] * (G - k)) for k in range(G + 1)]  # shared: Groups never modify them
    filler = BatchFiller(n_groups, on_budget_exhausted="unbounded", **filler_kw)
    log, uid = [], 0
    for step in range(steps):
        while not filler.ready():
            counts = draw_correct_counts(rng, filler.next_gen_batch_size(), beta_params(scenario, step, steps))
            filler.add([Group(uid=uid + i, acc=acc[k], rewards=acc[k] * 2 - 1) for i, k in enumerate(counts)])
            uid += len(counts)
        trained = len(filler.take())
        s = filler.step_stats()
        log.append(dict(generated=s["generated_groups"], gen_batches=s["num_gen_batches"], discarded=s["discarded"],
                        carried_in=s["carried_in"], trained=trained))
    return log, filler.step_stats()["carried_in"]


def summarize(log: list) -> dict:
    steps, trained = len(log), sum(r["trained"] for r in log)
    return dict(gen_per_trained=sum(r["generated"] for r in log) / trained,
                gen_batches=sum(r["gen_batches"] for r in log) / steps,
                max_gen_batches=max(r["gen_batches"] for r in log),
                discarded=sum(r["discarded"] for r in log) / steps,
                stale_pct=100.0 * sum(r["carried_in"] for r in log) / trained)


POLICIES = {
    "reference": lambda rng, sc, n, steps: run_reference(rng, sc, n, steps),
    "ours": lambda rng, sc, n, steps: run_filler(rng, sc, n, steps)[0],
    "carry_only": lambda rng, sc, n, steps: run_filler(rng, sc, n, steps, adaptive=False,
                                                        gen_batch_size=OVERSAMPLE * n)[0],
}


def check_reference_matches_filler(scenario: str, n_groups: int, steps: int, seed: int) -> bool:
    """The hand-written reference and BatchFiller(max_age=0, adaptive=False, 3N) agree step by step."""
    ref = run_reference(random.Random(seed), scenario, n_groups, steps)
    filler, left = run_filler(random.Random(seed), scenario, n_groups, steps, adaptive=False,
                              gen_batch_size=OVERSAMPLE * n_groups, max_age=0)
    return ref == filler and left == 0


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="batch 32, 8 steps, 2 seeds")
    p.add_argument("--batches", default="32,128,512", help="training batch sizes N (groups), comma-separated")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seeds", type=int, default=5)
    args = p.parse_args()
    if args.quick:
        args.batches, args.steps, args.seeds = "32", 8, 2
    args.batches = [int(b) for b in args.batches.split(",")]
    if min(args.batches) < 1 or args.steps < 1 or args.seeds < 1:
        p.error("--batches, --steps and --seeds must be positive")
    return args


def print_scenarios(steps: int) -> dict:
    """Prints each scenario's informative-group probability P; returns its floor on gen/trained, mean of 1/P."""
    floors = {}
    for sc in SCENARIOS:
        keep = [keep_probability(*beta_params(sc, s, steps)) for s in range(steps)]
        shape = "Beta(%g, %g)" % SHAPES[sc] if sc in SHAPES else "hard -> easy"
        span = f"{min(keep):.3f}" + (f" .. {max(keep):.3f}" if max(keep) > min(keep) else "")
        # No policy that trains on fresh informative groups only can generate fewer than 1/P per trained group.
        floors[sc] = statistics.fmean(1 / k for k in keep)
        print(f"  {sc:<7} {shape:<16} P(group informative) = {span:<14} floor gen/trained = mean 1/P = "
              f"{floors[sc]:.3f}")
    return floors


def run_table(args, floors: dict) -> dict:
    """Runs every (batch size, scenario, policy) over the seeds, prints the table; returns the medians."""
    print(f"{'scenario':<9}{'N':>5} {'policy':<12}{'gen/trained':>12}{'x ref':>8}{'batches/step':>14}"
          f"{'max batches':>13}{'discarded/step':>16}{'stale %':>9}")
    results = {}
    for n_groups in args.batches:
        for sc in SCENARIOS:
            for policy, run in POLICIES.items():
                runs = [summarize(run(random.Random(seed), sc, n_groups, args.steps)) for seed in range(args.seeds)]
                results[sc, n_groups, policy] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            ref = results[sc, n_groups, "reference"]["gen_per_trained"]
            for policy in POLICIES:
                r = results[sc, n_groups, policy]
                print(f"{sc:<9}{n_groups:>5} {policy:<12}{r['gen_per_trained']:>12.3f}"
                      f"{r['gen_per_trained'] / ref:>8.3f}{r['gen_batches']:>14.2f}{r['max_gen_batches']:>13.0f}"
                      f"{r['discarded']:>16.1f}{r['stale_pct']:>9.1f}")
            print(f"{sc:<9}{n_groups:>5} {'floor (1/P)':<12}{floors[sc]:>12.3f}{floors[sc] / ref:>8.3f}")
    return results


def main():
    args = parse_args()
    print(f"dynamic sampling waste: group size {G}, batches N={args.batches} groups, {args.steps} steps, "
          f"seeds 0..{args.seeds - 1}; every number is the median over seeds")
    print("gen/trained = responses generated per trained response; batches/step = generation batches per step; "
          "stale % = trained groups generated in an earlier step")
    floors = print_scenarios(args.steps)
    results = run_table(args, floors)
    check_n = max(args.batches)
    same = all(check_reference_matches_filler(sc, check_n, args.steps, seed=0) for sc in SCENARIOS)
    print(f"check: BatchFiller(max_age=0, adaptive=False, gen_batch_size=3N) reproduces the reference run step by "
          f"step (N={check_n}, seed 0, every scenario): {same}")
    ref = {k: results[k[0], k[1], "reference"]["gen_per_trained"] for k in results}
    ratio = {k: results[k]["gen_per_trained"] / ref[k] for k in results}
    fields = [f"batch={check_n}"]
    for policy in ("ours", "carry_only"):
        fields += [f"{policy}_vs_ref_{sc}={ratio[sc, check_n, policy]:.3f}" for sc in SCENARIOS]
        fields.append(f"{policy}_vs_ref_worst={max(ratio[k] for k in ratio if k[2] == policy):.3f}")
    fields += [f"floor_vs_ref_{sc}={floors[sc] / ref[sc, check_n, 'reference']:.3f}" for sc in SCENARIOS]
    fields.append(f"reference_check={'pass' if same else 'FAIL'}")
    print("RESULT " + " ".join(fields), flush=True)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
