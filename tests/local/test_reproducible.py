"""The same short job gives the same numbers: twice in a row, and with 1 or 2 sampler processes.

What may still differ across machines is the floating-point round-off of the CPU kernels (see docs/cli.md,
"Reproducibility"); within one machine and thread count nothing in the job depends on timing or scheduling.
"""
import json
import os

import pytest

from tests.local.test_run import steady_records, tiny_cfg

# Keys (at any depth of summary.json) that measure time, not the run.
TIMING = ("seconds", "wall_s", "_s")


def _untimed(value):
    if isinstance(value, dict):
        return {k: _untimed(v) for k, v in value.items() if not k.endswith(TIMING)}
    if isinstance(value, list):
        return [_untimed(v) for v in value]
    return value


def _numbers(run_dir):
    """summary.json and every metrics record, less timings and the run directory's own path."""
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = _untimed(json.load(f))
    summary.pop("config", None)  # names run_dir (and rollout.processes); the numbers below are what must agree
    return summary, steady_records(run_dir)


def _train(run_dir, *extra):
    from nemo_dapo.local.run import train

    train(tiny_cfg(str(run_dir), "trainer.max_steps=3", *extra))
    return _numbers(run_dir)


@pytest.mark.slow  # three toy runs, one of them with a sampler worker process
def test_same_job_twice_and_across_sampler_processes_gives_the_same_summary(tmp_path):
    one = _train(tmp_path / "a", "rollout.processes=1")
    again = _train(tmp_path / "b", "rollout.processes=1")
    two = _train(tmp_path / "c", "rollout.processes=2")
    assert one == again
    # Two processes sample the same tokens (every row has its own stream); only the sampler's log-probs carry the
    # round-off of a half-size batch, which the trainer-vs-sampler mismatch metric shows at ~1e-8.
    assert one[0] == two[0]
    for r1, r2 in zip(one[1], two[1], strict=True):
        assert r1.keys() == r2.keys()
        for k in r1:
            if k == "actor/logp_mismatch":
                assert r1[k] == pytest.approx(r2[k], abs=1e-6)
            else:
                assert r1[k] == r2[k], (r1["step"], k)
    # the comparison can fail: another seed gives other numbers
    other = _train(tmp_path / "d", "rollout.processes=1", "seed=7")
    assert other != one
