"""PNG curves of a run directory's ``metrics.jsonl`` (``nemo-dapo plot RUN_DIR``).

One figure per panel group, each a grid of small plots against the rollout step: the quantities the paper's
section 4.3 says to watch (reward, accuracy, entropy, response length) plus the dynamic-sampling and clipping
statistics. Missing metrics are skipped, so the same code plots DAPO and baseline runs.
"""
from __future__ import annotations

import os
from typing import Optional

from nemo_dapo.local.run_log import read_metrics

PANELS = {
    "training": (
        ("train/reward", "shaped reward (mean over generated)"),
        ("train/acc", "train accuracy (generated)"),
        ("val/accuracy", "held-out accuracy"),
        ("actor/entropy", "policy entropy (nats/token)"),
        ("response/length_mean", "mean response length (tokens)"),
        ("response/clip_ratio", "truncated fraction"),
    ),
    "dynamics": (
        ("filter/pass_rate", "dynamic sampling pass rate"),
        ("filter/num_gen_batches", "generation batches per step"),
        ("actor/clip_frac_high", "clip fraction, high side"),
        ("actor/clip_frac_low", "clip fraction, low side"),
        ("actor/approx_kl", "approx KL(old || new)"),
        ("actor/grad_norm", "grad norm"),
    ),
    "time": (
        ("timing/step_s", "step time (s)"),
        ("timing/gen_s", "generation time (s)"),
        ("timing/update_s", "update time (s)"),
        ("timing/refit_s", "refit time (s): weights to the engine"),
        ("perf/gen_tokens_per_s", "generated tokens / s"),
        ("timing/engine_idle_s", "engine idle (s): no request in flight"),
        ("timing/engine_idle_frac", "engine idle / step time"),
    ),
    "staleness": (  # partial rollouts / overlap (rollout.on_filler_full=suspend)
        ("partial/trained_lag_mean", "trained tokens' lag (versions), mean"),
        ("partial/trained_lag_max", "trained tokens' lag (versions), max"),
        ("partial/trained_stale_token_frac", "trained tokens drawn by older weights"),
        ("partial/discarded_token_frac", "generated tokens discarded (cumulative)"),
        ("partial/suspended_groups", "groups suspended at step end"),
        ("partial/stale_groups", "groups dropped past max_staleness (cumulative)"),
        ("partial/logp_mismatch_fresh", "|pi_engine / pi_trainer - 1|, current weights' tokens"),
        ("partial/logp_mismatch_stale", "|pi_engine / pi_trainer - 1|, older weights' tokens"),
    ),
}


def _series(records: list, key: str) -> tuple:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)):
            xs.append(r["step"])
            ys.append(v)
    return xs, ys


def plot_run(run_dir: str, out_dir: Optional[str] = None) -> list:
    """Write ``<out_dir>/<panel>.png`` for each panel group that has data; returns the written paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    out_dir = out_dir or os.path.join(run_dir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    records = [r for r in read_metrics(run_dir) if r.get("kind") in ("train", "val", "eval", "final")]
    if not records:
        raise ValueError(f"{run_dir!r} has no metrics records yet; train first (`nemo-dapo train`)")
    written = []
    for panel, items in PANELS.items():
        present = [(k, title) for k, title in items if _series(records, k)[0]]
        if not present:
            continue
        cols = 3
        rows = (len(present) + cols - 1) // cols
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
        for ax, (key, title) in zip(axes.flat, present):
            xs, ys = _series(records, key)
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, linewidth=1.2)
            if key == "val/accuracy":  # base and final evaluations (more samples) as separate markers
                ex, ey = _series(records, "eval/accuracy")
                if ex:
                    ax.plot(ex, ey, "s", color="C3", markersize=6, label="base / final eval")
                    ax.legend(fontsize=7)
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("rollout step", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(present):]:
            ax.axis("off")
        fig.suptitle(f"{os.path.basename(os.path.abspath(run_dir))}: {panel}", fontsize=10)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{panel}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


# Columns of the comparison table: (header, summary.json key).
_TABLE = (
    ("held-out acc. base", "base_accuracy"),
    ("held-out acc. final", "final_accuracy"),
    ("gain (points)", "gain_points"),
    ("rollout steps", "rollout_steps"),
    ("optimizer updates", "optimizer_steps"),
    ("responses generated", "consumed_samples"),
    ("RL seconds", "rl_seconds"),
)


def _summary(run_dir: str) -> dict:
    import json

    path = os.path.join(run_dir, "summary.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no summary.json in {run_dir!r}: the run has not finished")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _label(summary: dict, run_dir: str) -> str:
    name = summary.get("config") or os.path.basename(os.path.abspath(run_dir))
    return name + (f" (seed {summary['seed']})" if "seed" in summary else "")


def _cell(v) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if isinstance(v, float) and abs(v) < 1 else f"{v}"


def comparison_table(run_dirs: list) -> str:
    """A markdown table with one row per run, like the paper's Table 1 (plus the cost of each run)."""
    summaries = [_summary(d) for d in run_dirs]
    lines = ["| run | " + " | ".join(h for h, _ in _TABLE) + " |", "|---|" + "---|" * len(_TABLE)]
    for s, d in zip(summaries, run_dirs):
        lines.append(f"| {_label(s, d)} | " + " | ".join(_cell(s.get(k)) for _, k in _TABLE) + " |")
    return "\n".join(lines)


# Extra comparison panels: held-out accuracy against the two budgets that matter when runs differ per step.
_BUDGET_AXES = (("counters/consumed_samples", "responses generated"), ("rl_seconds", "RL seconds (cumulative)"))


def _budget_series(records: list, x_key: str) -> tuple:
    """(x, held-out accuracy) at each validation, x = a counter or the cumulative step time."""
    xs, ys, elapsed = [], [], 0.0
    for r in records:
        if r.get("kind") != "train":
            continue
        elapsed += r.get("timing/step_s", 0.0) or 0.0
        if isinstance(r.get("val/accuracy"), (int, float)):
            xs.append(elapsed if x_key == "rl_seconds" else r.get(x_key))
            ys.append(r["val/accuracy"])
    return xs, ys


def compare_runs(run_dirs: list, out_dir: Optional[str] = None) -> tuple:
    """(markdown table, [png path]): the comparison table (also saved as compare.md) and overlaid curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = out_dir or os.path.join(run_dirs[0], "compare")
    os.makedirs(out_dir, exist_ok=True)
    table = comparison_table(run_dirs)
    with open(os.path.join(out_dir, "compare.md"), "w", encoding="utf-8") as f:
        f.write(table + "\n")
    panels = list(PANELS["training"])
    fig, axes = plt.subplots(2, 4, figsize=(16.8, 6.0), squeeze=False)
    for run_dir in run_dirs:
        records = read_metrics(run_dir)
        label = _label(_summary(run_dir), run_dir)
        for ax, (key, _) in zip(axes.flat, panels):
            xs, ys = _series(records, key)
            if xs:
                ax.plot(xs, ys, linewidth=1.2, label=label)
        for ax, (x_key, _) in zip(list(axes.flat)[len(panels):], _BUDGET_AXES):
            xs, ys = _budget_series(records, x_key)
            if xs:
                ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.2, label=label)
    titles = [(title, "rollout step") for _, title in panels]
    titles += [("held-out accuracy", xlabel) for _, xlabel in _BUDGET_AXES]
    for ax, (title, xlabel) in zip(axes.flat, titles):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, "compare.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return table, [path]
