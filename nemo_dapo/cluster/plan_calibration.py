"""The planner run on published runs: benchmarks/calibration/ holds one recipe per published measurement (the
source's configuration in this config's keys, each translation stated in the recipe) and ``published.yaml`` the
measured step and phase times with their source (repository, tag / commit, file). ``calibration_rows`` plans each
with the planner's ONE set of assumptions (no per-row tuning: a recipe may set only what its source publishes, and
says so where it guesses); ``error_band`` is the range of the relative errors, printed beside every estimate.
Imports nothing of NeMo, Megatron or torch.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

CALIBRATION_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "calibration"
PUBLISHED = "published.yaml"
PHASES = ("generation", "old_logprob", "reference_logprob", "training", "generation_wait")
LAYOUTS = ("colocated", "disaggregated_partial")  # the layouts a published run may be compared with (plan_async.py)


def published_runs(directory: Path = CALIBRATION_DIR) -> dict:
    """{recipe stem: {label, source, step_s, phases}} of ``published.yaml``."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(directory / PUBLISHED), resolve=True)


def calibration_rows(directory: Path = CALIBRATION_DIR) -> list:
    """One row per published run: the planner's step and phases beside the published ones, errors as ours / theirs
    - 1 (positive: the planner is slower than the run)."""
    from omegaconf import OmegaConf

    from nemo_dapo.cluster.config_load import load_config
    from nemo_dapo.cluster.plan import make_plan

    rows = []
    for name, pub in published_runs(directory).items():
        recipe = directory / f"{pub.get('recipe', name)}.yaml"
        cfg = OmegaConf.to_container(load_config(recipe, pub.get("overrides") or []), resolve=True)
        ours = _ours(make_plan(cfg), pub.get("layout", "colocated"))
        errors = {"step": ours["step"] / pub["step_s"] - 1,
                  **{p: ours[p] / v - 1 for p, v in (pub.get("phases") or {}).items()}}
        rows.append({"name": name, "label": pub["label"], "source": pub["source"], "published": pub,
                     "layout": pub.get("layout", "colocated"), "ours": ours, "errors": errors,
                     "misses": pub.get("misses") or {}})
    return rows


def _ours(plan: dict, layout: str) -> dict:
    """The planner's step and phases for ``layout``: the colocated step's phases, or a disaggregated layout's
    train-side phases and the trainer's wait for generation (step - train side - refit)."""
    if layout not in LAYOUTS:
        raise ValueError(f"published.yaml: layout={layout!r} must be one of {LAYOUTS}")
    if layout == "colocated":
        t = plan["time"]
        return {"step": t["total"], **{p: t[p] for p in PHASES if p in t}}
    row = plan["layouts"][layout]
    if "refused" in row:
        raise ValueError(f"published.yaml: the {layout} layout is refused: {row['refused']}")
    parts = row["parts"]
    return {"step": row["step"], **row["train"],
            "generation_wait": row["step"] - parts["train side"] - parts["network refit"]}


@lru_cache(maxsize=1)
def error_band():
    """{low, high} over the rows' step errors, {phase_low, phase_high} over every published phase; None when the
    calibration recipes are not there (an installed package without benchmarks/)."""
    if not (CALIBRATION_DIR / PUBLISHED).is_file():
        return None
    every = calibration_rows()
    rows = [r for r in every if r["layout"] == "colocated"]
    steps = [r["errors"]["step"] for r in rows]
    phases = [e for r in rows for k, e in r["errors"].items() if k != "step"] or steps
    layouts = {}
    for layout in LAYOUTS:
        errors = [r["errors"]["step"] for r in every if r["layout"] == layout]
        if errors:
            layouts[layout] = {"low": min(errors), "high": max(errors), "rows": len(errors)}
    return {"low": min(steps), "high": max(steps), "phase_low": min(phases), "phase_high": max(phases),
            "rows": len(rows), "names": ", ".join(r["label"] for r in rows), "layouts": layouts}


def format_table(rows: list) -> str:
    """The calibration table: published vs ours per row and phase."""
    lines = [f"{'run':<52}{'phase':<18}{'published s':>12}{'ours s':>9}{'error':>8}"]
    for r in rows:
        pub = {"step": r["published"]["step_s"], **(r["published"].get("phases") or {})}
        for k, v in pub.items():
            miss = "  (known miss, published.yaml)" if k in r["misses"] else ""
            lines.append(f"{r['label'] if k == 'step' else '':<52}{k:<18}{v:12.1f}{r['ours'][k]:9.1f}"
                         f"{r['errors'][k]:+8.1%}{miss}")
        lines.append(f"{'':<52}{'source: ' + r['source']}")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m nemo_dapo.cluster.plan_calibration
    print(format_table(calibration_rows()))
