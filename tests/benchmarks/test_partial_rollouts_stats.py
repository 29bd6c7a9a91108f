"""The paired summary of benchmarks/partial_rollouts.py --reeval against a hand-computed case."""
import math

import pytest

from tests.support.benchmark_module import load_benchmark


def test_paired_change_matches_hand_computation():
    paired_change = load_benchmark("partial_rollouts").paired_change
    acc = {("sync", 1): 0.50, ("sync", 2): 0.70, ("sync", 3): 0.60,
           ("overlap", 1): 0.40, ("overlap", 2): 0.75, ("overlap", 3): 0.50}
    c = paired_change(acc, "sync", "overlap", range(1, 4))
    # changes -0.10, +0.05, -0.10: mean -0.05, sample sd sqrt(0.0075), s.e. sd / sqrt(3) = 0.05
    assert c["mean_change"] == pytest.approx(-0.05)
    assert c["change_se"] == pytest.approx(0.05)
    assert c["lower"] == 2
    assert c["accuracy_sync"] == pytest.approx(0.60) and c["accuracy_overlap"] == pytest.approx(0.55)
    # sync: deviations -0.1, +0.1, 0 -> sd 0.1; overlap: -0.15, +0.2, -0.05 -> sd sqrt(0.0325)
    assert c["seed_sd_sync"] == pytest.approx(0.1)
    assert c["seed_sd_overlap"] == pytest.approx(math.sqrt(0.0325))


def test_paired_change_one_seed_has_no_spread():
    c = load_benchmark("partial_rollouts").paired_change({("a", 7): 0.3, ("b", 7): 0.4}, "a", "b", [7])
    assert c["mean_change"] == pytest.approx(0.1) and c["lower"] == 0
    assert all(math.isnan(c[k]) for k in ("change_se", "seed_sd_a", "seed_sd_b"))


def test_the_paired_ratio_is_the_median_of_per_seed_ratios_not_the_ratio_of_medians():
    paired_ratio = load_benchmark("partial_rollouts").paired_ratio
    # seed 3 ran while the machine was slow for both policies: per seed the overlap takes 0.5, 0.8 and 0.7 of the
    # synchronous time, median 0.7; the medians' ratio (5.0 / 6.0) would read 0.83
    runs = [dict(policy="sync", seed=1, s=4.0), dict(policy="overlap", seed=1, s=2.0),
            dict(policy="sync", seed=2, s=6.0), dict(policy="overlap", seed=2, s=4.8),
            dict(policy="sync", seed=3, s=10.0), dict(policy="overlap", seed=3, s=7.0)]
    assert paired_ratio(runs, "s", "sync", "overlap", range(1, 4)) == pytest.approx(0.7)
    assert paired_ratio(runs, "s", "overlap", "sync", [1]) == pytest.approx(2.0)  # b over a, as named


def test_steps_are_paired_only_between_equal_batches():
    steps_paired = load_benchmark("partial_rollouts").steps_paired
    runs = [dict(policy="sync", batch_samples=128.0), dict(policy="sync", batch_samples=128.0),
            dict(policy="overlap", batch_samples=128.0), dict(policy="overlap", batch_samples=120.0),
            dict(policy="overlap", batch_samples=128.0)]  # one run's steps ended on a smaller partial batch
    assert steps_paired(runs, "sync", "overlap")
    halved = [dict(r, batch_samples=64.0) if r["policy"] == "overlap" else r for r in runs]
    assert not steps_paired(halved, "sync", "overlap")  # --second-override trainer.train_batch_size=8


def test_a_cached_run_of_another_second_policy_key_is_refused():
    check_cached = load_benchmark("partial_rollouts").check_cached
    ran = {"trainer": {"train_batch_size": 8}, "optim": {"betas": [0.8, 0.999]}}
    check_cached("RUN", ran, ["trainer.train_batch_size=8", "optim.betas=[0.8,0.999]", "++trainer.train_batch_size=8"])
    for override in ("trainer.train_batch_size=16", "optim.betas=[0.9,0.999]", "trainer.no_such_key=1"):
        with pytest.raises(SystemExit, match="use another --out"):
            check_cached("RUN", ran, [override])
