"""The report of ``nemo-dapo ablate``: ``OUT/ablation.md`` (table), ``OUT/ablation.png`` (curves), and
``OUT/ablation.json`` (plan + per-run and per-row numbers); ``nemo-dapo plot OUT`` redraws them from the run dirs.

Per run (``OUT/<row>/seed<k>``): held-out accuracy and its gain from ``summary.json``; the mechanism metrics from
``metrics.jsonl`` (means over the run's rollout steps; entropy over the last quarter of them, where a collapse
shows). Per row: mean +/- std (Bessel) over the seeds that finished. Curves: each metric against responses
generated, interpolated per seed onto one grid and averaged over the seeds.
"""
from __future__ import annotations

import json
import os
import statistics
from typing import Optional

from nemo_dapo.exit_codes import EXIT_DIVERGED
from nemo_dapo.local.run_log import read_metrics, write_json, write_text

# name -> (metrics.jsonl key, column header, cell format); entropy is averaged over the last quarter of the steps.
METRICS = {
    "trunc": ("response/clip_ratio", "truncated", "{:.1%}"),
    "clip_high": ("actor/clip_frac_high", "high-side clip", "{:.2%}"),
    "entropy": ("actor/entropy", "entropy (last 1/4)", "{:.2f}"),
    "length": ("response/length_mean", "resp. length", "{:.1f}"),
    "pass_rate": ("filter/pass_rate", "DS pass rate", "{:.2f}"),
    "per_group": (None, "generated / trained group", "{:.1f}"),
    "consumed_samples": (None, "responses", "{:.0f}"),
}
# The metric that shows a row's technique at work (the row's cell is set in bold).
MECHANISM = {"grpo": "entropy", "overlong_filter": "trunc", "clip_higher": "clip_high", "soft_overlong": "trunc",
             "token_level": "length", "dynamic_sampling": "pass_rate", "skip_history": "per_group"}
CURVES = (("val/accuracy", "held-out accuracy (validation)"), ("actor/entropy", "entropy (nats/token)"),
          ("response/length_mean", "mean response length (tokens)"), ("response/clip_ratio", "truncated fraction"),
          ("actor/clip_frac_high", "clip fraction, high side"), ("filter/pass_rate", "dynamic sampling pass rate"))
X_KEY = "counters/consumed_samples"
DS_ON = "algorithm.dynamic_sampling.enabled=true"


def _mean(xs: list) -> Optional[float]:
    return statistics.fmean(xs) if xs else None


def _std(xs: list) -> Optional[float]:
    return statistics.stdev(xs) if len(xs) > 1 else None


def run_numbers(run_dir: str, budget: int, ds_on: bool) -> Optional[dict]:
    """The numbers of one finished run (None: no summary.json yet)."""
    path = os.path.join(run_dir, "summary.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        s = json.load(f)
    train = read_metrics(run_dir, "train")
    out = {k: s.get(k) for k in ("base_accuracy", "final_accuracy", "gain_points", "wall_seconds", "rl_seconds",
                                 "rollout_steps")}
    for name, (key, _, _) in METRICS.items():
        vals = [r[key] for r in train if key and isinstance(r.get(key), (int, float))]
        if name == "entropy":
            vals = vals[len(vals) - max(1, len(vals) // 4):] if vals else vals
        out[name] = _mean(vals)
    if not ds_on:
        out["pass_rate"] = None  # without dynamic sampling every group is kept: the 1.0 logged says nothing
    out["consumed_samples"] = s.get("consumed_samples")  # the last step may end past the budget (dynamic sampling)
    groups = sum(r.get("filter/trained_groups", 0) for r in train)
    out["per_group"] = s["consumed_samples"] / groups if groups else None
    consumed = s.get("consumed_samples") or 0
    out["ended_by"] = ("budget" if consumed >= budget else "max_steps" if s.get("rollout_steps", 0) >= budget
                       else "max_time_s")
    return out


def divergences(run_dir: str) -> list:
    """Every divergence a run had (run_dir/diverged.json, or its summary's record of one continued with
    --resume-diverged); [] for a healthy run."""
    from nemo_dapo.local.run_dir import read_divergence

    found = read_divergence(run_dir)
    try:
        with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
            found = found or json.load(f).get("diverged") or []
    except (OSError, ValueError, AttributeError):
        pass
    return found


def _status(run_dir: str, nums: Optional[dict], failure: dict) -> tuple:
    """(status, what diverged): a run that ever diverged is 'diverged', whatever came after (never a result).
    ``EXIT_DIVERGED`` is also the exit code of a rerun that refuses to continue a diverged run."""
    went = divergences(run_dir)
    if went or failure.get("exit_code") == EXIT_DIVERGED:
        last = went[-1] if went else {}
        return "diverged", f"at rollout step {last.get('step', '?')}: {last.get('reason', 'exit code 7')}"
    return ("finished" if nums else "failed" if failure else "missing"), None


def collect(out: str, meta: dict, failed: dict) -> tuple:
    """([per-run dict], [per-row dict]) for the rows x seeds of ``meta``; only finished runs enter a row's numbers
    (a diverged one never does, even if continued and finished with --resume-diverged)."""
    plan, runs, table = meta["plan"], [], []
    for row in meta["rows"]:
        ds_on = DS_ON in plan["row_table"].get(row, [])
        per, diverged = [], 0
        for seed in range(1, meta["seeds"] + 1):
            label, rel = f"{row}/seed{seed}", os.path.join(row, f"seed{seed}")
            nums = run_numbers(os.path.join(out, rel), plan["budget"], ds_on)
            status, why = _status(os.path.join(out, rel), nums, failed.get(label, {}))
            entry = {"row": row, "seed": seed, "run_dir": rel, "status": status, **failed.get(label, {})}
            if status == "diverged":
                entry["diverged"] = why
                diverged += 1
            elif nums:
                entry.update(nums)
                per.append(nums)
            runs.append(entry)
        agg = {"row": row, "label": meta["labels"].get(row, row), "technique": meta["techniques"].get(row),
               "finished": len(per), "diverged": diverged, "seeds": meta["seeds"],
               "ended_by": sorted({p["ended_by"] for p in per})}
        for k in ("final_accuracy", "gain_points", "wall_seconds", *METRICS):
            vals = [p[k] for p in per if p.get(k) is not None]
            agg[k], agg[k + "_std"] = _mean(vals), _std(vals)
        agg["base_accuracy"] = _mean([p["base_accuracy"] for p in per])
        table.append(agg)
    return runs, table


def _pm(m, s, fmt: str) -> str:
    if m is None:
        return "-"
    return fmt.format(m) + ("" if s is None else " ± " + fmt.format(s).lstrip("+"))


def markdown(meta: dict, table: list, runs: Optional[list] = None) -> str:
    plan = meta["plan"]
    heads = ["row", "setting", "held-out acc.", "gain (points)"] + [h for _, h, _ in METRICS.values()] + [
        "wall s", "seeds", "ended by"]
    lines = [f"Ablation of `{plan['config_name']}`" + (f" with {' '.join(plan['overrides'])}" if plan["overrides"]
                                                       else "")
             + f": {plan['budget']} generated responses per run, mean ± std over seeds. Bold: the metric of the "
             "row's technique.", "",
             "| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for a in table:
        cells = [a["row"], a["label"], _pm(a["final_accuracy"], a["final_accuracy_std"], "{:.3f}"),
                 _pm(a["gain_points"], a["gain_points_std"], "{:+.1f}")]
        for name, (_, _, fmt) in METRICS.items():
            cell = _pm(a[name], a[name + "_std"], fmt)
            cells.append(f"**{cell}**" if MECHANISM.get(a["technique"]) == name and cell != "-" else cell)
        seeds = f"{a['finished']}/{a['seeds']}" + (f" ({a['diverged']} diverged)" if a.get("diverged") else "")
        cells += [_pm(a["wall_seconds"], None, "{:.0f}"), seeds, ", ".join(a["ended_by"]) or "-"]
        lines.append("| " + " | ".join(cells) + " |")
    left_out = [r for r in runs or [] if r["status"] in ("diverged", "failed", "missing")]
    if left_out:
        lines += ["", "Not in the table:"]
    for r in left_out:
        why = {"diverged": f"DIVERGED {r.get('diverged')}",
               "failed": f"failed with exit code {r.get('exit_code')} (log {r.get('log')})"}.get(r["status"],
                                                                                               "not run yet")
        lines.append(f"- {r['row']}/seed{r['seed']}: {why}")
    return "\n".join(lines) + "\n"


def _curve(records: list, key: str) -> tuple:
    xs, ys = [], []
    for r in records:
        number = isinstance(r.get(key), (int, float)) and isinstance(r.get(X_KEY), (int, float))
        if r.get("kind") == "train" and number:
            xs.append(r[X_KEY])
            ys.append(r[key])
    return xs, ys


def seed_mean(curves: list, grid: list) -> tuple:
    """Mean over seeds of (x, y) curves on ``grid``; each seed counts only inside the x range it covers."""
    import numpy as np

    gx, gy = [], []
    for g in grid:
        vals = [float(np.interp(g, xs, ys)) for xs, ys in curves if xs and xs[0] <= g <= xs[-1]]
        if vals:
            gx.append(g)
            gy.append(sum(vals) / len(vals))
    return gx, gy


def plot(out: str, meta: dict) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = {row: [read_metrics(os.path.join(out, row, f"seed{seed}")) for seed in range(1, meta["seeds"] + 1)
                     if os.path.isfile(os.path.join(out, row, f"seed{seed}", "metrics.jsonl"))]
               for row in meta["rows"]}
    # Up to the last response of any run: dynamic sampling ends its last step past the budget.
    x_max = max([meta["plan"]["budget"]] + [c[0][-1] for rs in records.values() for r in rs
                                            for c in [_curve(r, X_KEY)] if c[0]])
    grid = [x_max * i / 60 for i in range(61)]
    fig, axes = plt.subplots(2, 3, figsize=(14.0, 7.0), squeeze=False)
    for i, row in enumerate(meta["rows"]):
        ds_on = DS_ON in meta["plan"]["row_table"].get(row, [])
        for ax, (key, _) in zip(axes.flat, CURVES):
            if key == "filter/pass_rate" and not ds_on:
                continue  # every group is kept without dynamic sampling: the logged 1.0 says nothing
            xs, ys = seed_mean([_curve(r, key) for r in records[row]], grid)
            if xs:
                ax.plot(xs, ys, color=f"C{i % 10}", linewidth=1.3, label=row)
    for ax, (_, title) in zip(axes.flat, CURVES):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("responses generated", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(f"ablation of {meta['plan']['config_name']} (mean over {meta['seeds']} seeds)", fontsize=10)
    fig.tight_layout()
    path = os.path.join(out, "ablation.png")
    tmp = f"{path}.{os.getpid()}.{os.urandom(4).hex()}.tmp"  # a fresh name, then renamed: no write through a link
    try:
        with open(tmp, "xb") as f:
            fig.savefig(f, dpi=110, format="png")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def write_report(out: str, meta: dict, failed: Optional[dict] = None) -> list:
    """Write ablation.md, ablation.png, ablation.json; returns their paths (the table first)."""
    runs, table = collect(out, meta, failed or {})
    md, js = os.path.join(out, "ablation.md"), os.path.join(out, "ablation.json")
    write_text(md, markdown(meta, table, runs))
    png = plot(out, meta)
    write_json(js, {**meta, "runs": runs, "table": table})
    return [md, png, js]


def is_ablation_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "ablation.json"))


def redraw(out: str) -> list:
    """``nemo-dapo plot OUT`` on an ablation directory: the report again, from the run directories as they are."""
    with open(os.path.join(out, "ablation.json"), encoding="utf-8") as f:
        stored = json.load(f)
    failed = {f"{r['row']}/seed{r['seed']}": {"exit_code": r.get("exit_code"), "log": r.get("log")}
              for r in stored.get("runs", []) if r.get("status") in ("failed", "diverged")}
    meta = {k: stored[k] for k in ("plan", "rows", "seeds", "labels", "techniques")}
    return write_report(out, meta, failed)
