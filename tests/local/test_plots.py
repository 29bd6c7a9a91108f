"""nemo-dapo plot (local/plots.py): one PNG per panel that has data; the staleness panel only for a run with
partial rollouts, with the engine's idle time beside the step times."""
import json

import pytest

from nemo_dapo.local.plots import PANELS, plot_run


def write_run(run_dir, partial: bool, steps=4):
    run_dir.mkdir()
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step in range(1, steps + 1):
            rec = {"kind": "train", "step": step, "train/reward": 0.1 * step, "timing/step_s": 2.0,
                   "timing/engine_idle_s": 0.5, "timing/engine_idle_frac": 0.25}
            if partial:
                rec.update({"partial/trained_lag_mean": 0.4, "partial/trained_lag_max": 1.0,
                            "partial/discarded_token_frac": 0.02})
            f.write(json.dumps(rec) + "\n")
    return str(run_dir)


def test_a_partial_rollout_run_gets_a_staleness_panel_and_a_synchronous_one_does_not(tmp_path):
    names = lambda paths: sorted(p.rsplit("/", 1)[-1] for p in paths)  # noqa: E731
    assert names(plot_run(write_run(tmp_path / "async", partial=True))) == [
        "staleness.png", "time.png", "training.png"]
    assert names(plot_run(write_run(tmp_path / "sync", partial=False))) == ["time.png", "training.png"]
    assert (tmp_path / "async" / "plots" / "staleness.png").stat().st_size > 1000


def test_the_time_and_staleness_panels_name_what_an_overlap_step_logs():
    from tests.core.test_partial_rollouts import overlap_loop

    loop = overlap_loop()
    metrics = {}
    for _ in range(3):  # the later steps train resumed work (stale tokens) beside fresh: every metric is there
        metrics.update(loop.step())
    missing = [key for panel in ("time", "staleness") for key, _ in PANELS[panel] if key not in metrics]
    assert missing == []


def test_a_run_without_metrics_is_refused_with_the_fix(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="train first"):
        plot_run(str(tmp_path / "empty"))
