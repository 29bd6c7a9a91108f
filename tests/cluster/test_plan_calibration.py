"""`nemo-dapo plan` against published step times (benchmarks/calibration/): every row and every published phase
within +/-20 %, with one set of assumptions for all rows, and the band that `plan` prints is the table's."""
import argparse

import pytest
from omegaconf import OmegaConf

from nemo_dapo.cluster import plan as P
from nemo_dapo.cluster.config_validate import load_config
from nemo_dapo.cluster import plan_calibration as C

TOLERANCE = 0.20


@pytest.fixture(scope="module")
def rows():
    return C.calibration_rows()


def test_every_published_run_has_a_recipe_and_a_source():
    published = C.published_runs()
    assert len(published) == 3
    for name, pub in published.items():
        assert (C.CALIBRATION_DIR / f"{name}.yaml").is_file(), name
        assert pub["step_s"] > 0 and pub["source"] and pub["label"]
        for phase in pub.get("phases") or {}:
            assert phase in C.PHASES, phase


@pytest.mark.parametrize("name", sorted(C.published_runs()))
def test_step_and_each_phase_within_20_percent(rows, name):
    row = next(r for r in rows if r["name"] == name)
    for key, err in row["errors"].items():
        assert abs(err) <= TOLERANCE, f"{name} {key}: ours {row['ours'][key]:.1f} s, error {err:+.1%}"
    assert set(row["errors"]) == {"step", *(row["published"].get("phases") or {})}


def test_one_set_of_assumptions_for_every_row():
    """A calibration recipe may set only what its run publishes (the mean response length); every rate, utilisation
    and overhead is the planner's default."""
    for name in C.published_runs():
        raw = OmegaConf.to_container(OmegaConf.load(C.CALIBRATION_DIR / f"{name}.yaml"))
        assert set(raw["plan"].get("assume") or {}) <= {"mean_response_tokens"}, name


def test_the_table_can_fail():
    """The check is not vacuous: charging Qwen3-32B's update 8N (recompute, which the recipe has off) and no KL
    reference pass moves the row; a slower decode overhead moves the tail-bound verl generation out of the band."""
    base = {r["name"]: r for r in C.calibration_rows()}
    q = "nemo-rl-v0.5-qwen3-32b-4n8g"
    cfg = OmegaConf.to_container(load_config(C.CALIBRATION_DIR / f"{q}.yaml",
                                               ["model.activations_checkpoint_granularity=full"]), resolve=True)
    assert P.make_plan(cfg)["time"]["training"] == pytest.approx(base[q]["ours"]["training"] * 8 / 6, rel=0.02)
    v = "verl-fully-async-qwen2.5-math-7b-128xh20"
    cfg = OmegaConf.to_container(load_config(C.CALIBRATION_DIR / f"{v}.yaml",
                                               ["plan.assume.decode_step_overhead_ms=10"]), resolve=True)
    assert P.make_plan(cfg)["time"]["generation"] / 177.85 - 1 > TOLERANCE


def test_plan_prints_the_band_of_the_table(rows, capsys):
    band = C.error_band()
    steps = [r["errors"]["step"] for r in rows]
    assert (band["low"], band["high"]) == (min(steps), max(steps))
    ap = argparse.ArgumentParser()
    P.add_cli(ap.add_subparsers())
    args = ap.parse_args(["plan", "qwen2.5-32b_h100"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    total = next(line for line in out.splitlines() if line.startswith("  total ("))
    assert total.endswith(f"{band['low']:+.0%} / {band['high']:+.0%} on published runs")
    for key in P.ASSUMPTIONS:  # every assumption printed with its reason
        assert f"  {key}=" in out and P.ASSUMPTIONS[key][1][:30] in out.replace("\n      ", " ")


def test_format_table_names_each_source(rows):
    table = C.format_table(rows)
    assert table.count("source: ") == 3 and "6c70893" in table and "b178a3cd5" in table
