"""Evaluation metrics against hand-computed numbers and brute-force references."""
import itertools
import math
from fractions import Fraction

import pytest
import torch

from nemo_dapo.core.metrics import (avg_at_k, eval_summary, group_by_problem, length_stats, maj_at_k,
                                    masked_sum_count, pass_at_k,
                                    pass_at_k_unbiased)


def brute_force_pass_at_k(row, k):
    """Share of all k-subsets of the samples that contain a correct one."""
    subsets = list(itertools.combinations(row, k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_avg_at_k_hand_computed():
    assert avg_at_k([[1, 0, 1, 1], [0, 0, 0, 0]]) == 3 / 8
    assert avg_at_k(torch.tensor([[True, False], [True, True]])) == 3 / 4
    assert avg_at_k([[1], [0, 1, 1]]) == 3 / 4  # ragged: every sample weighs the same
    assert math.isnan(avg_at_k([]))


def test_pass_at_k_hand_computed():
    assert pass_at_k_unbiased(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k_unbiased(5, 2, 2) == pytest.approx(1 - 3 / 10)
    assert pass_at_k_unbiased(5, 0, 3) == 0.0
    assert pass_at_k_unbiased(5, 3, 3) == 1.0  # fewer than k wrong samples: every draw holds a correct one


def test_pass_at_k_matches_all_k_subsets():
    for n in range(1, 8):
        for c in range(n + 1):
            row = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                assert pass_at_k_unbiased(n, c, k) == pytest.approx(brute_force_pass_at_k(row, k), abs=1e-12)


def test_pass_at_k_stable_for_large_n():
    for n, c, k in [(200, 3, 32), (200, 150, 32), (1000, 1, 1), (500, 10, 100)]:
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
        assert pass_at_k_unbiased(n, c, k) == pytest.approx(float(exact), rel=1e-12, abs=1e-15)
    assert 0.0 <= pass_at_k_unbiased(100_000, 1, 5) == pytest.approx(5 / 100_000, rel=1e-9)


def test_pass_at_k_over_problems_and_pass_at_1_is_avg():
    acc = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    assert pass_at_k(acc, 2) == pytest.approx((0.5 + (1 - 1 / 6) + 0.0) / 3)
    assert pass_at_k(acc, 1) == pytest.approx(avg_at_k(acc))


def test_maj_at_k_hand_computed():
    samples = [
        [("5", True), ("7", False), ("5", True)],  # majority correct
        [("3", False), ("3", False), ("9", True)],  # majority wrong although one sample is right
        [("1", False), ("2", True)],  # tie: first seen wins -> wrong
        [("[INVALID]", False), ("[INVALID]", False), ("4", True)],
    ]
    assert maj_at_k(samples) == pytest.approx(1 / 4)
    assert maj_at_k(samples, invalid_pred="[INVALID]") == pytest.approx(2 / 4)
    assert maj_at_k([[("a", True), ("b", False), ("b", False)]], k=1) == 1.0  # only the first k samples vote


def test_maj_at_k_matches_counting_reference():
    preds = [["x", "y", "y", "z", "x", "y"], ["p", "q", "q", "p"], ["r"]]
    truth = ["y", "p", "s"]
    samples = [[(p, p == t) for p in row] for row, t in zip(preds, truth)]
    expected = []
    for row, t in zip(preds, truth):
        best = max(row.count(p) for p in row)
        winner = next(p for p in row if row.count(p) == best)
        expected.append(float(winner == t))
    assert maj_at_k(samples) == pytest.approx(sum(expected) / len(expected))


def test_group_by_problem_and_eval_summary():
    keys = ["b", "a", "b", "a", "b", "a"]
    preds = ["1", "2", "1", "3", "4", "2"]
    accs = [True, True, True, False, False, True]
    assert group_by_problem(keys, accs) == [[True, True, False], [True, False, True]]
    assert group_by_problem(keys, preds, accs)[1] == [("2", True), ("3", False), ("2", True)]
    out = eval_summary(keys, preds, accs, k=3)
    assert out == pytest.approx({"avg@3": 4 / 6, "pass@3": 1.0, "maj@3": 1.0})


def test_bad_metric_inputs():
    with pytest.raises(ValueError, match="0/1"):
        avg_at_k([[0.5, 1]])
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k([[1, 0]], 3)
    with pytest.raises(ValueError, match="at least k"):
        maj_at_k([[("a", True)]], k=2)
    with pytest.raises(ValueError, match=r"\[P, n\]"):
        avg_at_k(torch.ones(3))


def test_length_stats():
    lengths = torch.tensor([10, 20, 30, 40])
    out = length_stats(lengths, torch.tensor([False, False, True, True]))
    assert out == {"length_mean": 25.0, "length_max": 40.0, "length_min": 10.0, "clip_ratio": 0.5}
    assert length_stats(lengths, l_max=30)["clip_ratio"] == 0.5
    assert "clip_ratio" not in length_stats(lengths)
    assert all(math.isnan(v) for v in length_stats(torch.tensor([], dtype=torch.long), l_max=4).values())


def test_masked_sum_count_matches_a_loop():
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 5, generator=gen) * 3
    ent = torch.rand(3, 5, generator=gen)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
    cells = [(b, t) for b in range(3) for t in range(5) if mask[b, t]]
    def mean(x, m):
        total, count = masked_sum_count(x, m)
        return (total / count).item()

    assert mean(ent, mask) == pytest.approx(sum(ent[b, t].item() for b, t in cells) / len(cells))
    # Padding content must not leak in, even when it is NaN or +inf.
    logp[mask == 0], ent[mask == 0] = float("inf"), float("nan")
    assert math.isfinite(mean(logp, mask)) and math.isfinite(mean(ent, mask))
    total, count = masked_sum_count(ent, mask)
    assert count.item() == len(cells) and total.dtype == torch.float64
    assert math.isnan(mean(ent, torch.zeros_like(mask)))
    with pytest.raises(ValueError, match="same"):
        masked_sum_count(ent, mask[:, :4])


def test_combine_metrics_one_rule_and_unknown_keys_refused():
    from nemo_dapo.core.metrics import combine_metrics

    per_mb = [{"loss": torch.tensor(0.5), "ratio_min": 0.9, "ratio_max": 1.1},
              {"loss": 0.25, "ratio_min": torch.tensor(float("inf")), "ratio_max": 1.3}]
    out = combine_metrics(per_mb)
    assert out == {"loss": 0.75, "ratio_min": 0.9, "ratio_max": 1.3}
    with pytest.raises(KeyError, match="'grad_norm' has no reduction.*METRIC_REDUCTION"):
        combine_metrics([{"grad_norm": 1.0}])
    assert combine_metrics([]) == {}


class _TwoRanks:
    """A reducer whose other rank holds ``other`` for every value: sum adds it, max takes the larger."""

    rank, world_size = 0, 2

    def __init__(self, other):
        self.other = other

    def sum(self, x):
        return x + self.other

    def max(self, x):
        return torch.maximum(x, torch.as_tensor(self.other, dtype=x.dtype) * torch.sign(x))


def test_reduce_over_ranks_reduces_only_the_loss_metrics():
    from nemo_dapo.core.metrics import reduce_over_ranks

    out = reduce_over_ranks({"actor/loss": 1.0, "clip_frac_high": 0.25, "grad_norm": 3.0, "note": "x"},
                            _TwoRanks(2.0))
    assert out == {"actor/loss": 3.0, "clip_frac_high": 2.25, "grad_norm": 3.0}


def test_length_stats_empty_is_nan_on_every_path():
    from nemo_dapo.core.loop_eval import EvalResult

    empty = EvalResult(acc=torch.zeros(0, 4), lengths=torch.zeros(0, 4, dtype=torch.long),
                       truncated=torch.zeros(0, 4, dtype=torch.bool), preds=[])
    s = empty.summary()
    assert math.isnan(s["val/length_mean"]) and math.isnan(s["val/clip_ratio"])
    full = EvalResult(acc=torch.ones(1, 2), lengths=torch.tensor([[3, 5]]),
                      truncated=torch.tensor([[False, True]]), preds=[["a", "b"]])
    assert full.summary()["val/length_mean"] == 4.0 and full.summary()["val/clip_ratio"] == 0.5
