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
PHASES = ("generation", "old_logprob", "training")


def published_runs(directory: Path = CALIBRATION_DIR) -> dict:
    """{recipe stem: {label, source, step_s, phases}} of ``published.yaml``."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(directory / PUBLISHED), resolve=True)


def calibration_rows(directory: Path = CALIBRATION_DIR) -> list:
    """One row per published run: the planner's step and phases beside the published ones, errors as ours / theirs
    - 1 (positive: the planner is slower than the run)."""
    from omegaconf import OmegaConf

    from nemo_dapo.cluster.config_validate import load_config
    from nemo_dapo.cluster.plan import make_plan

    rows = []
    for name, pub in published_runs(directory).items():
        cfg = OmegaConf.to_container(load_config(directory / f"{name}.yaml"), resolve=True)
        t = make_plan(cfg)["time"]
        ours = {"step": t["total"], **{p: t[p] for p in PHASES}}
        errors = {"step": ours["step"] / pub["step_s"] - 1,
                  **{p: ours[p] / v - 1 for p, v in (pub.get("phases") or {}).items()}}
        rows.append({"name": name, "label": pub["label"], "source": pub["source"], "published": pub,
                     "ours": ours, "errors": errors})
    return rows


@lru_cache(maxsize=1)
def error_band():
    """{low, high} over the rows' step errors, {phase_low, phase_high} over every published phase; None when the
    calibration recipes are not there (an installed package without benchmarks/)."""
    if not (CALIBRATION_DIR / PUBLISHED).is_file():
        return None
    rows = calibration_rows()
    steps = [r["errors"]["step"] for r in rows]
    phases = [e for r in rows for k, e in r["errors"].items() if k != "step"] or steps
    return {"low": min(steps), "high": max(steps), "phase_low": min(phases), "phase_high": max(phases),
            "rows": len(rows), "names": ", ".join(r["label"] for r in rows)}


def format_table(rows: list) -> str:
    """The calibration table: published vs ours per row and phase."""
    lines = [f"{'run':<52}{'phase':<13}{'published s':>12}{'ours s':>9}{'error':>8}"]
    for r in rows:
        pub = {"step": r["published"]["step_s"], **(r["published"].get("phases") or {})}
        for k, v in pub.items():
            lines.append(f"{r['label'] if k == 'step' else '':<52}{k:<13}{v:12.1f}{r['ours'][k]:9.1f}"
                         f"{r['errors'][k]:+8.1%}")
        lines.append(f"{'':<52}{'source: ' + r['source']}")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m nemo_dapo.cluster.plan_calibration
    print(format_table(calibration_rows()))
