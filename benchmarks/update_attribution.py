"""What moved a behaviour of the policy, update by update: Adam's momentum or the update's own gradient.

Runs ``nemo-dapo train`` once (in this process, single rank, the ``local`` policy) and keeps, after every optimizer
step, the weights, Adam's moments and the mini-batch's rows. Then it follows one behaviour of the procedural
arithmetic task through the run: the probe is the mean log-probability with which the policy restates a problem's
first operator, over held-out problems whose first operator is ``--op`` (given the prompt and the first number:
``9-8+7`` -> ``9`` then ``-``). Each update's change of the probe is split, to first order, into the part that
Adam's momentum carried from earlier updates (beta1 m_{t-1}) and the part from the update's own gradient
((1 - beta1) g_t), both through Adam's denominator (and AdamW's weight decay, a third part):

    dtheta_t = -lr wd theta - lr (beta1 m_{t-1} + (1 - beta1) g_t) / bc1 / (sqrt(v_t / bc2) + eps)
    d probe ~ grad probe . dtheta_t     (split_residual: the largest |first order - the parts' sum|, a check)

Printed per weight version (the updates that trained on one batch): the probe (log-probability and probability),
its change, the two parts, and how many of that version's trained responses to ``--op`` problems restated it as
another operator ("swapped"). Why: on ``tiny_cpu_vllm`` several overlapped runs that fall far behind had learned to
restate subtraction as addition (``9-8+7`` -> ``9+8=17``; ``docs/async.md``, "The runs that fall behind"); this shows
how a run got there.
``--final``: no run; the probe on the final models of a ``benchmarks/partial_rollouts.py`` folder.

    OMP_NUM_THREADS=1 python benchmarks/update_attribution.py --out runs/attr/overlap_seed3 -- \\
        --config-name tiny_cpu_vllm model.path=/tmp/base_vllm/base_model seed=3 ...

Everything after ``--`` is passed to ``nemo-dapo train`` (``run_dir`` is ``OUT/run``). A finished run in OUT is
reused (the analysis alone runs again). ``--quick``: a 2-step ``tiny_cpu`` run from a short warm-up (the smoke test).
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

OPS = "+-*"


def record_updates(out: str, train_args: list) -> None:
    """Run ``nemo-dapo train`` with every optimizer step recorded under ``out/updates`` (one file per step)."""
    from nemo_dapo import cli
    from nemo_dapo.core.loop import DAPOLoop

    updates = os.path.join(out, "updates")
    if os.path.isdir(updates) and os.listdir(updates):
        # a resumed run would continue from its last checkpoint, after updates this folder may not hold
        raise SystemExit(f"{out} holds the updates of a run that did not finish: remove the folder and run again")
    os.makedirs(updates, exist_ok=True)
    inner = DAPOLoop._train_minibatch
    count = [0]

    def recording(loop, batch, share):
        result = inner(loop, batch, share)
        if "lr" not in result:  # a mini-batch without valid tokens: no optimizer step was taken
            return result
        policy = loop.policy
        if loop.reducer.world_size != 1 or not hasattr(policy, "optimizer"):
            raise SystemExit("update_attribution records a single-rank run of the local policy only")
        names = {id(p): n for n, p in policy.model.named_parameters()}
        group = policy.optimizer.param_groups[0]
        mb = batch.select(share)
        torch.save({"version": loop._version, "skipped": bool(result.get("skipped", 0.0)),
                    "lr": result["lr"], "betas": tuple(group["betas"]), "eps": group["eps"],
                    "weight_decay": group["weight_decay"],
                    "weights": {k: v.detach().clone() for k, v in policy.model.state_dict().items()},
                    "adam": {names[id(p)]: {k: v.clone() for k, v in policy.optimizer.state[p].items()}
                             for p in group["params"] if p in policy.optimizer.state},
                    "rows": {k: getattr(mb, k) for k in ("prompt_ids", "prompt_mask", "response_ids",
                                                         "response_mask", "advantages")}},
                   os.path.join(updates, f"{count[0]:05d}.pt"))
        count[0] += 1
        return result

    DAPOLoop._train_minibatch = recording
    try:
        code = cli.main(["train", *train_args, f"run_dir={os.path.join(out, 'run')}"])
    finally:
        DAPOLoop._train_minibatch = inner
    if code != 0:
        raise SystemExit(f"nemo-dapo train exited {code}")


class Probe:
    """Mean log P(the first operator restated as in the problem | prompt + first number) over ``n`` held-out
    problems whose first operator is ``op``, and its gradient."""

    def __init__(self, run_dir: str, op: str, n: int):
        from nemo_dapo.data.task import tokenize_problem
        from nemo_dapo.data.tokenizer import load_tokenizer, token_ids
        from nemo_dapo.local.config import load_config
        from nemo_dapo.local.run_data import HELDOUT_SEED, make_task
        from nemo_dapo.models.decoder import load_model

        cfg = load_config(os.path.join(run_dir, "config.yaml"))
        if cfg.data.task != "arithmetic":
            raise SystemExit("the operator probe needs the procedural task (data.task=arithmetic)")
        warmed = os.path.join(run_dir, "base_model")  # the run's own warm-up, else the model it started from
        self.model = load_model(warmed if os.path.isdir(warmed) else cfg.model.path)
        self.tokenizer = tok = load_tokenizer(os.path.join(run_dir, "final_model"))
        task, problems = make_task(cfg), []
        for i, problem in enumerate(task.iter_problems("heldout", HELDOUT_SEED)):
            if len(problems) == n or i > 1000 * n:
                break
            if tokenize_problem(problem)[1] == op and problem not in problems:
                problems.append(problem)
        if not problems:
            raise SystemExit(f"no held-out problem starts with the operator {op!r}")
        rows = [task.row(p, i) for i, p in enumerate(problems)]
        bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
        # the prompt as training encodes it (BOS + the templated text), then the response's first number
        prompts = token_ids(tok, [row["prompt"][0]["content"] for row in rows])
        firsts = token_ids(tok, [str(tokenize_problem(p)[0]) for p in problems])
        self.inputs = [torch.tensor([bos + a + b]) for a, b in zip(prompts, firsts)]
        (self.op_id,) = token_ids(tok, [op])[0]

    def logprobs(self) -> torch.Tensor:
        """[n] log P(the operator) under the model's current weights."""
        return torch.stack([torch.log_softmax(self.model(ids).logits[0, -1].float(), -1)[self.op_id]
                            for ids in self.inputs])

    def __call__(self, weights: dict, grad: bool = False):
        self.model.load_state_dict(weights)
        self.model.eval()
        self.model.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(grad):
            value = self.logprobs().mean()
        if not grad:
            return float(value)
        value.backward()
        return float(value), {n: p.grad.detach().clone() for n, p in self.model.named_parameters()}


def first_order_parts(probe_grad: dict, before: dict, after: dict, prev_adam: dict) -> tuple:
    """(first-order change, momentum part, own-gradient part, weight-decay part) of the probe over one AdamW step
    ``before`` (weights) -> ``after`` (a recorded step: weights, Adam's moments after it, lr, betas, eps, decay).

    torch's AdamW: theta <- theta (1 - lr wd) - lr (m_t / bc1) / (sqrt(v_t / bc2) + eps), m_t = b1 m_{t-1} + (1 - b1)
    g_t; the three parts sum to the first-order change (``grad probe . (theta_after - theta_before)``) up to rounding.
    A skipped step (non-finite gradient) moved nothing."""
    if after.get("skipped"):
        return 0.0, 0.0, 0.0, 0.0
    b1, b2 = after["betas"]
    lr, wd = after["lr"], after.get("weight_decay", 0.0)
    total = momentum = own = decay = 0.0
    for name, g in probe_grad.items():
        state = after["adam"][name]
        t = int(state["step"])
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m_prev = prev_adam[name]["exp_avg"] if prev_adam else torch.zeros_like(m)
        step = lr / (1 - b1 ** t) / ((v / (1 - b2 ** t)).sqrt() + after["eps"])
        total += float((g * (after["weights"][name] - before[name])).sum())
        momentum -= float((g * step * b1 * m_prev).sum())
        own -= float((g * step * (m - b1 * m_prev)).sum())
        decay -= float((g * lr * wd * before[name]).sum())
    return total, momentum, own, decay


def swapped_rows(rows: dict, tokenizer, op: str) -> tuple:
    """(responses to problems starting with ``op``, those whose first line restates it as another operator)."""
    from nemo_dapo.data.task import tokenize_problem
    from nemo_dapo.data.template import extract_problem

    total = swapped = 0
    for i in range(rows["prompt_ids"].shape[0]):
        if not rows["response_mask"][i].any():
            continue
        text = tokenizer.decode(rows["prompt_ids"][i][rows["prompt_mask"][i].bool()], skip_special_tokens=True)
        problem = extract_problem(text.strip())
        if problem is None or tokenize_problem(problem)[1] != op:
            continue
        total += 1
        response = tokenizer.decode(rows["response_ids"][i][rows["response_mask"][i].bool()],
                                    skip_special_tokens=True)
        restated = next((c for c in response.split("\n")[0] if c in OPS), None)
        swapped += restated is not None and restated != op
    return total, swapped


def analyse(out: str, op: str, n: int) -> None:
    files = sorted(glob.glob(os.path.join(out, "updates", "*.pt")))
    if not files:
        raise SystemExit(f"{out}/updates holds no recorded update")
    probe = Probe(os.path.join(out, "run"), op, n)
    weights = {k: v.clone() for k, v in probe.model.state_dict().items()}  # the run's start
    value, grad = probe(weights, grad=True)  # at each step's start: the previous step's end
    start, prev_adam, by_version, residual = value, None, {}, 0.0
    for f in files:
        step = torch.load(f, weights_only=False)
        total, momentum, own, decay = first_order_parts(grad, weights, step, prev_adam)
        residual = max(residual, abs(total - momentum - own - decay))
        v = by_version.setdefault(step["version"], dict(before=value, change=0.0, first=0.0, momentum=0.0, own=0.0,
                                                        decay=0.0, rows=0, swapped=0))
        for key, x in (("first", total), ("momentum", momentum), ("own", own), ("decay", decay)):
            v[key] += x
        rows, swapped = swapped_rows(step["rows"], probe.tokenizer, op)
        v["rows"] += rows
        v["swapped"] += swapped
        weights = step["weights"]
        prev_adam = prev_adam if step.get("skipped") else step["adam"]
        after, grad = probe(weights, grad=True)
        v["change"] += after - value
        value = after
    print(f"probe: mean log P(restating the first operator {op!r} | prompt + first number) over "
          f"{len(probe.inputs)} held-out problems (P: its exp)")
    print("version  log P before  P before  change  1st order  momentum  own gradient  decay  responses  swapped")
    for ver, v in sorted(by_version.items()):
        print(f"{ver:7d}  {v['before']:12.3f}  {math.exp(v['before']):8.3f}  {v['change']:+6.3f}  {v['first']:+9.3f}"
              f"  {v['momentum']:+8.3f}  {v['own']:+12.3f}  {v['decay']:+5.3f}  {v['rows']:9d}  {v['swapped']:7d}")
    end = value
    fall = [v for v in by_version.values() if v["change"] < 0]
    swapped_at = [ver for ver, v in sorted(by_version.items()) if v["swapped"]]
    print(f"RESULT updates={len(files)} probe_start={start:.4f} probe_end={end:.4f} "
          f"falling_change={sum(v['change'] for v in fall):.4f} "
          f"falling_momentum={sum(v['momentum'] for v in fall):.4f} falling_own={sum(v['own'] for v in fall):.4f} "
          f"falling_decay={sum(v['decay'] for v in fall):.4f} split_residual={residual:.2e} "
          f"first_swapped_version={swapped_at[0] if swapped_at else 'none'}")


def largest_stale_mismatch(run_dir: str) -> float:
    """The largest ``partial/logp_mismatch_stale`` over a run's trained steps (nan if it logged none)."""
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        values = [json.loads(line).get("partial/logp_mismatch_stale") for line in f]
    return max((x for x in values if x is not None and not math.isnan(x)), default=math.nan)


def reevaluated(run_dir: str) -> float:
    """The run's cached ``partial_rollouts.py --reeval`` accuracy: the largest re-evaluation (problems, then samples)
    of this run's final model; nan if none (a cache of another model does not count, as in partial_rollouts.py)."""
    sizes = []
    for path in glob.glob(os.path.join(run_dir, "reeval_*_*.json")):
        n, k = os.path.basename(path)[len("reeval_"):-len(".json")].split("_")
        if n.isdigit() and k.isdigit():
            sizes.append((int(n), int(k), path))
    final = os.path.realpath(os.path.join(run_dir, "final_model"))
    for n, k, path in sorted(sizes, reverse=True):
        with open(path, encoding="utf-8") as f:
            res = json.load(f)
        if os.path.realpath(res.get("model") or "") == final:
            return res.get(f"avg@{k}", math.nan)
    return math.nan


def final_models(out: str, op: str, n: int, spike: float, baseline: str) -> None:
    """The probe on the final model of every run in a ``benchmarks/partial_rollouts.py`` folder (the mean
    probability of restating the first operator as another one), beside the run's largest stale-token log-prob
    mismatch and its cached re-evaluated accuracy; with two policies, the mean change against ``baseline`` (paired by
    seed) over the pairs where a run's largest mismatch passed ``spike``, and over the others."""
    from nemo_dapo.models.decoder import load_model

    finals = glob.glob(os.path.join(out, "*_seed*", "final_model"))
    if not finals:
        raise SystemExit(f"{out} holds no POLICY_seedN/final_model")
    probe, runs = None, {}
    for final in finals:
        run_dir = os.path.dirname(final)
        policy, seed = os.path.basename(run_dir).rsplit("_seed", 1)
        probe = probe or Probe(run_dir, op, n)
        probe.model = load_model(final).eval()
        with torch.no_grad():
            swap = float(1 - probe.logprobs().exp().mean())
        runs[policy, int(seed)] = dict(swap=swap, mismatch=largest_stale_mismatch(run_dir), acc=reevaluated(run_dir))
    fields = []
    for policy in sorted({p for p, _ in runs}):
        mine = [(seed, r) for (p, seed), r in sorted(runs.items()) if p == policy]
        for seed, r in mine:
            print(f"{policy:8s} seed {seed}: swapped {r['swap']:.3f}, largest stale mismatch {r['mismatch']:.3f} "
                  f"(re-evaluated accuracy {r['acc']:.4f})")
        fields += [f"runs_{policy}={len(mine)}",
                   f"swapped_over_0.05_{policy}={sum(r['swap'] > 0.05 for _, r in mine)}",
                   f"swapped_over_0.5_{policy}={sum(r['swap'] > 0.5 for _, r in mine)}",
                   f"stale_mismatch_over_{spike:g}_{policy}={sum(r['mismatch'] > spike for _, r in mine)}"]
    policies = sorted({p for p, _ in runs})
    if len(policies) == 2:
        a = baseline if baseline in policies else policies[0]
        b = policies[1] if a == policies[0] else policies[0]
        seeds = sorted(s for p, s in runs if p == a and (b, s) in runs)
        for name, keep in (("spiked", True), ("other", False)):
            pairs = [runs[b, s]["acc"] - runs[a, s]["acc"] for s in seeds
                     if any(runs[p, s]["mismatch"] > spike for p in (a, b)) == keep]  # nan: never
            mean = sum(pairs) / len(pairs) if pairs else math.nan
            fields += [f"pairs_{name}={len(pairs)}", f"change_{b}_minus_{a}_{name}={mean:+.4f}"]
    print("RESULT " + " ".join(fields))


def main() -> int:
    argv = sys.argv[1:]
    train_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for the run (OUT/run) and its recorded updates")
    p.add_argument("--op", default="-", choices=list(OPS), help="the problems' first operator to follow")
    p.add_argument("--problems", type=int, default=64, help="held-out problems in the probe")
    p.add_argument("--quick", action="store_true", help="a 2-step tiny_cpu run from a short warm-up")
    p.add_argument("--final", action="store_true", help="no run: the probe on the final models of the runs in OUT "
                   "(a benchmarks/partial_rollouts.py --out folder)")
    p.add_argument("--spike", type=float, default=5.0, help="--final: a run whose partial/logp_mismatch_stale "
                   "passed this counts as spiked")
    p.add_argument("--baseline", default="sync", help="--final: the policy the other is compared with")
    args = p.parse_args(argv)
    if args.final:
        final_models(args.out, args.op, args.problems, args.spike, args.baseline)
        return 0
    if args.quick:
        train_args = ["warmup.max_steps=20", "warmup.min_steps=1", "trainer.max_steps=2", "trainer.val_every=0",
                      "data.heldout_size=16", *train_args]
    if not os.path.exists(os.path.join(args.out, "run", "summary.json")):
        record_updates(args.out, train_args)
    analyse(args.out, args.op, args.problems)
    return 0


if __name__ == "__main__":
    sys.exit(main())
