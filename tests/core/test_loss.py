import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_dapo.core.loss import (AGG_MODES, METRIC_REDUCTION, DAPOLossFn, dapo_policy_loss, logp_mismatch,
                                 loss_normalizer, make_loss_fn, rejection_keep, truncated_is_weights)
from nemo_dapo.core.settings import LossSettings, build_loss
from nemo_dapo.core.types import LossFn, LossInput, RolloutBatch

CLIP = dict(eps_low=0.2, eps_high=0.28)


def run(logp, old_logp, adv, mask, agg="token-mean", **kw):
    """Loss over one micro-batch that is the whole step (normaliser from the mask itself)."""
    n = loss_normalizer(mask, agg)
    args = dict(CLIP, agg=agg, max_new_tokens=mask.shape[1])
    args.update(kw)
    if agg == "token-mean":
        return dapo_policy_loss(logp, old_logp, adv, mask, num_tokens=n, **args)
    return dapo_policy_loss(logp, old_logp, adv, mask, num_tokens=None, num_seqs=n, **args)


def grad_of(logp_values, old, adv, mask, **kw):
    logp = logp_values.clone().requires_grad_()
    loss, metrics = run(logp, old, adv, mask, **kw)
    loss.backward()
    return loss, logp.grad, metrics


# ---- hand-computed examples -----------------------------------------------------------------------------------------

def test_paper_clip_example_upper_bound():
    # Paper section 3.1: with eps = 0.2, pi_old = 0.01 can grow only to 0.012, pi_old = 0.9 to 1.08 (never binding).
    old = torch.tensor([[0.01, 0.01, 0.9, 0.9]]).log()
    new = torch.tensor([[0.0115, 0.0125, 0.95, 0.999]]).log()
    ones, adv = torch.ones(1, 4), torch.tensor([1.0])

    loss, grad, m = grad_of(new, old, adv, ones, eps_low=0.2, eps_high=0.2)
    ratios = torch.tensor([1.15, 1.25, 0.95 / 0.9, 0.999 / 0.9])
    # d/dlogp of -A r / N is -A r / N; the clipped token (0.0125 > 0.012) gets none.
    torch.testing.assert_close(grad[0], -torch.tensor([1.15, 0.0, ratios[2], ratios[3]]) / 4)
    torch.testing.assert_close(loss, -(1.15 + 1.2 + ratios[2] + ratios[3]) / 4)
    assert m["clip_frac_high"].item() == pytest.approx(0.25) and m["clip_frac_low"].item() == 0.0

    # Clip-Higher: eps_high = 0.28 moves the bound to 0.0128, so the rare token keeps its gradient.
    _, grad, m = grad_of(new, old, adv, ones, eps_low=0.2, eps_high=0.28)
    torch.testing.assert_close(grad[0], -ratios / 4)
    assert m["clip_frac_high"].item() == 0.0


def test_low_side_clip_for_negative_advantage():
    old = torch.tensor([[0.5, 0.5, 0.5]]).log()
    new = torch.tensor([[0.35, 0.45, 0.3]]).log()  # ratios 0.7 (clipped), 0.9 (free), 0.6 (clipped)
    loss, grad, m = grad_of(new, old, torch.tensor([-1.0]), torch.ones(1, 3))
    torch.testing.assert_close(grad[0], torch.tensor([0.0, 0.9, 0.0]) / 3)
    torch.testing.assert_close(loss, torch.tensor((0.8 + 0.9 + 0.8) / 3))
    assert m["clip_frac_low"].item() == pytest.approx(2 / 3) and m["clip_frac_high"].item() == 0.0
    # a positive advantage is never clipped on the low side: the unclipped term is the larger loss there
    _, grad, m = grad_of(new, old, torch.tensor([1.0]), torch.ones(1, 3))
    torch.testing.assert_close(grad[0], -torch.tensor([0.7, 0.9, 0.6]) / 3)
    assert m["clip_frac_low"].item() == 0.0


def test_token_level_vs_sequence_level_worked_example():
    # seq 0: 1 token, A = +1; seq 1: 3 tokens, A = -1; ratio 1 everywhere, so token losses are -1 and +1, +1, +1.
    mask = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 0]])
    logp = torch.full((2, 4), -1.0)
    adv = torch.tensor([1.0, -1.0])
    want = {  # (loss, grad of seq 0's token, grad of each of seq 1's tokens)
        "token-mean": ((-1 + 3) / 4, -1 / 4, 1 / 4),
        "seq-mean-token-mean": ((-1 + 1) / 2, -1 / 2, 1 / 6),
        "seq-mean-token-sum": ((-1 + 3) / 2, -1 / 2, 1 / 2),
        "seq-mean-token-sum-norm": ((-1 + 3) / (2 * 4), -1 / 8, 1 / 8),
    }
    for agg, (w_loss, w_g0, w_g1) in want.items():
        loss, grad, _ = grad_of(logp, logp, adv, mask, agg=agg)
        assert loss.item() == pytest.approx(w_loss), agg
        torch.testing.assert_close(grad, torch.tensor([[w_g0, 0, 0, 0], [w_g1, w_g1, w_g1, 0]]), msg=agg)
    # token-level: the long bad sequence gets 3x the total push of the short good one; sequence-mean: 1x
    _, grad, _ = grad_of(logp, logp, adv, mask, agg="token-mean")
    assert grad[1].sum() / -grad[0].sum() == pytest.approx(3.0)
    _, grad, _ = grad_of(logp, logp, adv, mask, agg="seq-mean-token-mean")
    assert grad[1].sum() / -grad[0].sum() == pytest.approx(1.0)


def test_dual_clip_caps_negative_advantage_loss():
    old = torch.zeros(1, 4)
    new = torch.tensor([[math.log(5.0), math.log(2.0), math.log(0.5), math.log(4.0)]])
    adv = torch.tensor([[-1.0, -1.0, -1.0, 1.0]])
    loss, grad, m = grad_of(new, old, adv, torch.ones(1, 4), clip_c=3.0)
    # max(-rA, -clip(r)A) per token: 5 -> capped at c|A| = 3 | 2 | 0.8 (low clip) | -1.28 (high clip)
    torch.testing.assert_close(loss, torch.tensor((3.0 + 2.0 + 0.8 - 1.28) / 4))
    torch.testing.assert_close(grad[0], torch.tensor([0.0, 2.0 / 4, 0.0, 0.0]))
    assert m["dual_clip_frac"].item() == 0.25 and m["clip_frac_low"].item() == 0.25
    assert m["clip_frac_high"].item() == 0.25
    loss, grad, m = grad_of(new, old, adv, torch.ones(1, 4))  # without dual clip the 5x token is unbounded
    torch.testing.assert_close(loss, torch.tensor((5.0 + 2.0 + 0.8 - 1.28) / 4))
    assert grad[0, 0].item() == pytest.approx(5.0 / 4) and m["dual_clip_frac"].item() == 0.0


def test_metrics_hand_values():
    old = torch.zeros(1, 3)
    new = torch.tensor([[math.log(2.0), 0.0, math.log(0.5)]])
    _, _, m = grad_of(new, old, torch.tensor([0.0]), torch.tensor([[1.0, 1.0, 0.0]]))
    assert m["ratio_min"].item() == pytest.approx(1.0) and m["ratio_max"].item() == pytest.approx(2.0)
    assert m["ratio_mean"].item() == pytest.approx(1.5)
    assert m["approx_kl"].item() == pytest.approx((2 - 1 - math.log(2)) / 2)  # k3 of the valid tokens
    assert m["num_tokens"].item() == 2
    assert set(m) <= set(METRIC_REDUCTION)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_metrics_are_weighted_like_the_loss_in_every_aggregation(agg):
    # ratios 2 | 1, 1: a mean over tokens is 4/3, a mean over sequences of their token means 1.5
    new = torch.tensor([[math.log(2.0), 0.0, 0.0], [0.0, 0.0, 0.0]])
    _, _, m = grad_of(new, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), torch.tensor([[1.0, 0, 0], [1, 1, 0]]),
                      agg=agg)
    assert m["ratio_mean"].item() == pytest.approx(4 / 3 if agg == "token-mean" else 1.5)


def test_log_ratio_is_clamped_and_computed_in_fp32():
    old = torch.full((1, 2), -60.0, dtype=torch.bfloat16)
    logp = torch.zeros(1, 2, dtype=torch.bfloat16, requires_grad=True)
    loss, m = dapo_policy_loss(logp, old, torch.tensor([-1.0]), torch.ones(1, 2), **CLIP, num_tokens=2)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(math.exp(20.0), rel=1e-3)  # exp(60) clamped to exp(20), no inf
    loss.backward()
    assert torch.isfinite(logp.grad).all()


def test_loss_normalizer_counts():
    mask = torch.tensor([[1.0, 1, 0], [0, 0, 0], [1, 1, 1]])
    assert loss_normalizer(mask, "token-mean").item() == 5
    for agg in AGG_MODES[1:]:
        assert loss_normalizer(mask, agg).item() == 2  # the empty row is not a sequence of the mean
    with pytest.raises(ValueError, match="not one of"):
        loss_normalizer(mask, "mean")


# ---- split invariance -----------------------------------------------------------------------------------------------

def random_batch(seed, b=8, t=6):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    lengths[0] = 0  # always one fully masked row
    mask = (torch.arange(t) < lengths[:, None]).float()
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    logp = old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3  # ratios on both sides of the clips
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    return logp, old, adv, mask


def split_loss(logp_values, old, adv, mask, agg, parts):
    """Sum of micro-batch losses, each with the GLOBAL normaliser and trimmed to its own width."""
    logp = logp_values.clone().requires_grad_()
    norm = sum(loss_normalizer(mask[rows], agg) for rows in parts)
    total, metrics = 0.0, []
    for rows in parts:
        width = int(mask[rows].sum(-1).max().item()) if len(rows) else 0
        cols = slice(0, width)
        loss, m = dapo_policy_loss(logp[rows][:, cols], old[rows][:, cols], adv[rows], mask[rows][:, cols], **CLIP,
                                   clip_c=3.0, agg=agg, num_tokens=norm, num_seqs=norm, max_new_tokens=mask.shape[1])
        total = total + loss
        metrics.append(m)
    total.backward()
    return total, logp.grad, metrics


def reduce_metrics(metrics):
    out = {}
    for key, how in METRIC_REDUCTION.items():
        vals = [m[key] for m in metrics if key in m]
        if vals:
            out[key] = {"sum": sum, "min": min, "max": max}[how](vals)
    return out


@pytest.mark.parametrize("agg", AGG_MODES)
def test_micro_batches_and_ranks_match_the_full_batch(agg):
    logp, old, adv, mask = random_batch(0)
    full_loss, full_grad, full_m = split_loss(logp, old, adv, mask, agg, [torch.arange(8)])
    assert full_grad.abs().sum() > 0
    four_micro = [torch.tensor([0, 1]), torch.tensor([2, 3]), torch.tensor([4, 5]), torch.tensor([6, 7])]
    two_ranks_two_micro = [torch.tensor([0, 5]), torch.tensor([2]), torch.tensor([7, 1, 3]), torch.tensor([4, 6])]
    for parts in (four_micro, two_ranks_two_micro):
        loss, grad, m = split_loss(logp, old, adv, mask, agg, parts)
        torch.testing.assert_close(loss, full_loss)
        torch.testing.assert_close(grad, full_grad)
        for key, value in reduce_metrics(full_m).items():
            torch.testing.assert_close(reduce_metrics(m)[key], value, msg=key)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), agg=st.sampled_from(AGG_MODES),
       assignment=st.lists(st.integers(0, 3), min_size=8, max_size=8))
def test_random_splits_match_the_full_batch(seed, agg, assignment):
    logp, old, adv, mask = random_batch(seed)
    parts = [torch.tensor([i for i, a in enumerate(assignment) if a == k], dtype=torch.long) for k in range(4)]
    full_loss, full_grad, _ = split_loss(logp, old, adv, mask, agg, [torch.arange(8)])
    loss, grad, _ = split_loss(logp, old, adv, mask, agg, parts)  # includes empty parts
    torch.testing.assert_close(loss, full_loss)
    torch.testing.assert_close(grad, full_grad)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_all_masked_micro_batch_adds_exactly_zero(agg):
    logp = torch.full((2, 3), float("nan")).requires_grad_()  # garbage on padding must not leak
    old = torch.full((2, 3), 1e9)
    loss, m = dapo_policy_loss(logp, old, torch.tensor([1.0, -1.0]), torch.zeros(2, 3), **CLIP, clip_c=3.0,
                               agg=agg, num_tokens=7, num_seqs=3, max_new_tokens=3)
    assert loss.item() == 0.0 and not torch.signbit(loss)
    loss.backward()
    assert torch.isfinite(logp.grad).all() and logp.grad.abs().sum() == 0
    assert m["num_tokens"].item() == 0 and m["ratio_min"].item() == math.inf
    # the whole step masked: the global normaliser is 0, the loss is still exactly 0
    loss, _ = dapo_policy_loss(logp, old, torch.zeros(2), torch.zeros(2, 3), **CLIP, agg=agg, num_tokens=0,
                               num_seqs=0, max_new_tokens=3)
    assert loss.item() == 0.0


# ---- truncated importance sampling ----------------------------------------------------------------------------------

def test_truncated_is_weights_and_mismatch():
    old = torch.tensor([[0.5, 0.2, 0.3, 0.1]]).log()
    engine = torch.tensor([[0.25, 0.2, 0.05, 0.7]]).log()
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w = truncated_is_weights(old, engine, mask, cap=3.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 1.0, 3.0, 0.0]]))  # 6.0 truncated to the cap
    # |exp(engine - trainer) - 1|: 0.5, 0, 5/6 over the valid tokens
    assert logp_mismatch(engine, old, mask).item() == pytest.approx((0.5 + 0 + 5 / 6) / 3)
    with pytest.raises(ValueError, match="cap"):
        truncated_is_weights(old, engine, mask, cap=0.0)


def test_sequence_level_is_weights_match_a_row_by_row_reference():
    """tis_level "sequence": each valid token of a row carries min(prod over the row's valid tokens of
    pi_old / pi_engine, cap); padding gets 0 and is never read; a one-token row has its token-level weight."""
    gen = torch.Generator().manual_seed(7)
    old = -torch.rand(10, 6, generator=gen) * 3
    engine = old + torch.randn(10, 6, generator=gen) * 0.4
    mask = (torch.rand(10, 6, generator=gen) > 0.3).float()
    mask[3], mask[5] = 0.0, torch.tensor([0.0, 0, 1, 0, 0, 0])
    engine = torch.where(mask.bool(), engine, torch.full_like(engine, -99.0))
    for cap in (0.7, 2.0, 50.0):
        w = truncated_is_weights(old, engine, mask, cap, level="sequence")
        for r in range(10):
            ratio = math.prod(math.exp(float(old[r, t] - engine[r, t])) for t in range(6) if mask[r, t] > 0)
            for t in range(6):
                want = min(ratio, cap) if mask[r, t] > 0 else 0.0
                assert float(w[r, t]) == pytest.approx(want, rel=1e-5), (cap, r, t)
    token = truncated_is_weights(old, engine, mask, 2.0)
    torch.testing.assert_close(truncated_is_weights(old, engine, mask, 2.0, "sequence")[5], token[5])
    assert not torch.allclose(truncated_is_weights(old, engine, mask, 2.0, "sequence"), token)
    with pytest.raises(ValueError, match="level"):
        truncated_is_weights(old, engine, mask, 2.0, level="prefix")


def test_sequence_level_weights_give_the_target_policy_gradient_exactly():
    """The score-function identity the sequence level rests on: with responses drawn from a behaviour policy mu and
    a reward at the end, sum_y mu(y) w(y) R(y) grad log pi(y) = grad E_pi[R] when w(y) = pi(y) / mu(y) (the cap
    above every ratio). Every 2-token response over a 3-token vocabulary is enumerated, pi's second token depends on
    its first, and the loss's gradient (ratio 1: logp = old_logp) is compared with autograd of E_pi[R]. Token-level
    weights give another vector: they correct each token's own probability, not which responses the batch holds."""
    gen = torch.Generator().manual_seed(3)
    theta1 = torch.randn(3, generator=gen, requires_grad=True)  # pi's first-token logits
    theta2 = torch.randn(3, 3, generator=gen, requires_grad=True)  # pi's second-token logits, row = first token
    mu1, mu2 = torch.randn(3, generator=gen).softmax(-1), torch.randn(3, 3, generator=gen).softmax(-1)
    reward = torch.randn(3, 3, generator=gen)
    ys = [(a, b) for a in range(3) for b in range(3)]
    p1, p2 = theta1.log_softmax(-1), theta2.log_softmax(-1)
    exact = torch.autograd.grad(sum(float(reward[a, b]) * (p1[a] + p2[a, b]).exp() for a, b in ys),
                                (theta1, theta2), retain_graph=True)
    logp = torch.stack([torch.stack([p1[a], p2[a, b]]) for a, b in ys])  # [9, 2]
    engine = torch.tensor([[mu1[a].log(), mu2[a, b].log()] for a, b in ys])
    mu = engine.sum(-1).exp()  # each response's behaviour probability: the expectation, enumerated
    mask = torch.ones(9, 2)
    grads = {}
    for level in ("sequence", "token"):
        w = truncated_is_weights(logp.detach(), engine, mask, 1e6, level)
        loss, _ = dapo_policy_loss(logp, logp.detach(), reward.flatten() * mu, mask, **CLIP, num_tokens=1,
                                   is_weights=w)
        grads[level] = torch.autograd.grad(-loss, (theta1, theta2), retain_graph=True)
    for got, want in zip(grads["sequence"], exact):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not all(torch.allclose(g, e, atol=1e-3) for g, e in zip(grads["token"], exact))


def test_is_weights_scale_each_token():
    old = torch.zeros(1, 3)
    logp = torch.zeros(1, 3, requires_grad=True)
    w = torch.tensor([[2.0, 0.5, 1.0]])
    loss, _ = dapo_policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 3), **CLIP, num_tokens=3,
                               is_weights=w)
    loss.backward()
    assert loss.item() == pytest.approx(-(2.0 + 0.5 + 1.0) / 3)
    torch.testing.assert_close(logp.grad, -w / 3)


# ---- DAPOLossFn, the LossFn of a run ---------------------------------------------------------------------------------

def loss_input(truncated, engine=True) -> LossInput:
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 1], [1, 0, 0]])
    return LossInput(old_logp=torch.full((3, 3), -1.0) * mask, advantages=torch.tensor([1.0, -0.5, 2.0]), mask=mask,
                     truncated=torch.tensor(truncated),
                     engine_logp=torch.full((3, 3), -1.5) * mask if engine else None)


def test_loss_fn_overlong_filter_masks_truncated_rows():
    inputs = loss_input([False, True, False])
    fn = make_loss_fn(**CLIP, clip_c=10.0, overlong_filter=True)
    assert fn.normalizer(inputs).item() == 3  # the truncated row's 3 tokens are not counted
    logp = torch.full((3, 3), -0.9, requires_grad=True)
    entropy = torch.tensor([[1.0, 2.0, 9.0], [9.0, 9.0, 9.0], [3.0, 9.0, 9.0]])
    loss, m = fn(logp, entropy, inputs, fn.normalizer(inputs))
    kept = torch.tensor([[1.0, 1, 0], [0, 0, 0], [1, 0, 0]])
    want, _ = dapo_policy_loss(logp, inputs.old_logp, inputs.advantages, kept, **CLIP, clip_c=10.0, num_tokens=3)
    torch.testing.assert_close(loss, want)
    loss.backward()
    assert logp.grad[1].abs().sum() == 0 and logp.grad[0, 0] != 0
    assert m["entropy"].item() == pytest.approx(2.0)  # (1 + 2 + 3) / 3: padding and the truncated row excluded
    assert m["token_prob"].item() == pytest.approx(math.exp(-0.9))
    assert m["overlong_filtered"].item() == 1
    assert m["logp_mismatch"].item() == pytest.approx(abs(math.exp(-0.5) - 1))
    assert m["num_tokens"].item() == 3
    # without the filter the truncated row trains
    fn = make_loss_fn(**CLIP)
    assert fn.normalizer(inputs).item() == 6


def test_loss_fn_all_truncated_micro_batch_adds_zero():
    fn = make_loss_fn(**CLIP, overlong_filter=True)
    logp = torch.zeros(3, 3, requires_grad=True)
    loss, _ = fn(logp, None, loss_input([True, True, True]), 5.0)  # other micro-batches of the step hold 5 tokens
    assert loss.item() == 0.0
    loss.backward()
    assert torch.isfinite(logp.grad).all()


def test_loss_fn_tis_and_seq_mode():
    inputs = loss_input([False, False, False])
    logp = torch.full((3, 3), -1.0, requires_grad=True)
    fn = make_loss_fn(**CLIP, tis_cap=2.0)
    assert fn.tis_cap == 2.0 and make_loss_fn(**CLIP).tis_cap is None
    loss, m = fn(logp, None, inputs, fn.normalizer(inputs))
    w = math.exp(0.5)  # pi_old / pi_engine = exp(-1 + 1.5), under the cap
    assert loss.item() == pytest.approx(-w * (2 * 1.0 - 3 * 0.5 + 2.0) / 6)
    assert m["is_weight_mean"].item() == pytest.approx(w)
    assert m["is_capped"].item() == 0
    fn = make_loss_fn(**CLIP, tis_cap=2.0, tis_level="sequence")  # one weight a row: exp(0.5 x its tokens)
    loss, m = fn(logp, None, inputs, fn.normalizer(inputs))
    w_rows = [min(math.exp(0.5 * n), 2.0) for n in (2, 3, 1)]  # rows 0 and 1 reach the cap
    assert loss.item() == pytest.approx(-(w_rows[0] * 2 * 1.0 - w_rows[1] * 3 * 0.5 + w_rows[2] * 2.0) / 6)
    assert m["is_weight_mean"].item() == pytest.approx((2 * w_rows[0] + 3 * w_rows[1] + w_rows[2]) / 6)
    assert m["is_capped"].item() == pytest.approx(5 / 6)  # the tokens of rows 0 and 1
    fn = make_loss_fn(**CLIP, agg="seq-mean-token-mean")
    assert fn.normalizer(inputs).item() == 3  # the seq-* normaliser counts sequences ...
    loss, m = fn(logp, None, inputs, 3.0)
    assert loss.item() == pytest.approx(-(1.0 - 0.5 + 2.0) / 3)
    assert m["num_tokens"].item() == 6  # ... while the num_tokens metric still counts tokens


def test_rejection_keep_matches_a_row_by_row_reference():
    """The vectorised rejection against a plain loop: a row stays when the mean |old - engine| log-prob difference
    over its valid tokens is at most the threshold; a row without a valid token stays."""
    gen = torch.Generator().manual_seed(5)
    old = -torch.rand(12, 7, generator=gen) * 3
    engine = old + torch.randn(12, 7, generator=gen) * 0.1
    mask = (torch.rand(12, 7, generator=gen) > 0.3).float()
    mask[4] = 0.0
    engine = torch.where(mask.bool(), engine, torch.full_like(engine, -99.0))  # padding is never read
    for threshold in (0.02, 0.05, 0.08, 0.2):
        want = []
        for r in range(12):
            diffs = [abs(float(old[r, t]) - float(engine[r, t])) for t in range(7) if mask[r, t] > 0]
            want.append(not diffs or sum(diffs) / len(diffs) <= threshold)
        assert rejection_keep(old, engine, mask, threshold).tolist() == want
    assert 0 < sum(rejection_keep(old, engine, mask, 0.08).tolist()) < 12  # the thresholds split the rows
    at_threshold = rejection_keep(torch.zeros(1, 2), torch.full((1, 2), -0.5), torch.ones(1, 2), 0.5)
    assert at_threshold.tolist() == [True]  # "at most"
    with pytest.raises(ValueError, match="threshold"):
        rejection_keep(old, engine, mask, 0.0)


def test_loss_fn_rejection_leaves_whole_rows_out_of_the_loss_and_its_normaliser():
    """With reject_logp_diff, a response the sampler scored far from the trainer's old log-probs adds no token to
    the loss, its gradient or the token count: the loss is the one of the batch without that row."""
    inputs = loss_input([False, False, False])
    far = inputs.engine_logp.clone()
    far[1] = -3.0 * inputs.mask[1]  # row 1: |old - engine| = 2 a token; rows 0 and 2: 0.5
    inputs = dataclasses.replace(inputs, engine_logp=far)
    fn = make_loss_fn(**CLIP, tis_cap=2.0, reject_logp_diff=1.0)
    assert fn.normalizer(inputs).item() == 3  # row 1's 3 tokens are not counted
    logp = torch.full((3, 3), -0.9, requires_grad=True)
    loss, m = fn(logp, None, inputs, fn.normalizer(inputs))
    loss.backward()
    without = dataclasses.replace(inputs, mask=inputs.mask * torch.tensor([[1.0], [0.0], [1.0]]))
    plain = make_loss_fn(**CLIP, tis_cap=2.0)
    logp2 = torch.full((3, 3), -0.9, requires_grad=True)
    want, _ = plain(logp2, None, without, plain.normalizer(without))
    want.backward()
    assert loss.item() == pytest.approx(want.item()) and torch.equal(logp.grad, logp2.grad)
    assert logp.grad[1].abs().sum() == 0 and logp.grad[0].abs().sum() > 0
    assert m["rejected"].item() == 1 and METRIC_REDUCTION["rejected"] == "sum"
    keep_all = make_loss_fn(**CLIP, tis_cap=2.0, reject_logp_diff=2.5)
    assert keep_all.normalizer(inputs).item() == 6 and keep_all(logp, None, inputs, 6.0)[1]["rejected"].item() == 0
    with pytest.raises(ValueError, match="reject_logp_diff needs the sampler's log-probs"):
        fn.normalizer(loss_input([False] * 3, engine=False))
    with pytest.raises(ValueError, match="reject_logp_diff"):
        make_loss_fn(**CLIP, tis_cap=2.0, reject_logp_diff=-1.0)


def test_loss_input_of_a_rollout_batch_gives_the_same_loss_and_gradient():
    """LossInput.of (the core layout) and the adapter for a RolloutBatch micro-batch feed the loss the same rows."""
    inputs = loss_input([False, True, False])
    batch = RolloutBatch(prompt_ids=torch.ones(3, 2, dtype=torch.long), prompt_mask=torch.ones(3, 2, dtype=torch.long),
                         response_ids=torch.ones(3, 3, dtype=torch.long), response_mask=inputs.mask,
                         group_ids=torch.tensor([0, 0, 1]), truncated=inputs.truncated, old_logp=inputs.old_logp,
                         engine_logp=inputs.engine_logp, advantages=inputs.advantages)
    assert len(LossInput.of(batch)) == 3
    fn = make_loss_fn(**CLIP, clip_c=10.0, overlong_filter=True, tis_cap=2.0)
    out = []
    for x in (inputs, LossInput.of(batch), batch):
        logp = torch.full((3, 3), -0.7, requires_grad=True)
        loss, _ = fn(logp, None, x, fn.normalizer(x))
        loss.backward()
        out.append((loss.detach(), logp.grad))
    for loss, grad in out[1:]:
        assert torch.equal(loss, out[0][0]) and torch.equal(grad, out[0][1])
    batch.old_logp = None
    with pytest.raises(ValueError, match="RolloutBatch.old_logp"):
        LossInput.of(batch)


def test_the_loss_is_a_loss_fn_holding_its_settings_as_built():
    """The seam for a new loss option: the builder hands the loss the settings object unchanged, so an option is
    a field of LossSettings that the loss reads (a toy field here; GSPO's sequence-level ratio would be one)."""
    @dataclasses.dataclass(frozen=True)
    class WithToyOption(LossSettings):
        toy_option: bool = False

    settings = WithToyOption(eps_low=0.2, eps_high=0.28, clip_c=None, agg="seq-mean-token-sum-norm",
                             overlong_filter=False, tis_cap=None, tis_level="token", reject_logp_diff=None,
                             toy_option=True)
    fn = build_loss(settings, max_new_tokens=8)
    assert isinstance(fn, LossFn) and isinstance(fn, DAPOLossFn)
    assert fn.settings is settings and fn.settings.toy_option and fn.max_new_tokens == 8
    with pytest.raises(TypeError, match="LossSettings"):
        DAPOLossFn(dict(eps_low=0.2), max_new_tokens=8)


def test_loss_fn_errors():
    with pytest.raises(ValueError, match="engine_logp"):
        make_loss_fn(**CLIP, tis_cap=2.0)(torch.zeros(3, 3), None, loss_input([False] * 3, engine=False), 6.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        make_loss_fn(**CLIP, agg="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="tis_cap"):
        make_loss_fn(**CLIP, tis_cap=-1.0)


@pytest.mark.parametrize("kw,match", [
    (dict(agg="sum"), "not one of"),
    (dict(clip_c=1.0), "clip_c"),
    (dict(eps_low=1.0), "eps_low"),
    (dict(eps_high=-0.1), "eps_high"),
    (dict(num_tokens=None), "num_tokens"),
    (dict(agg="seq-mean-token-mean"), "num_seqs"),
    (dict(agg="seq-mean-token-sum-norm", num_seqs=2), "max_new_tokens"),
    (dict(advantages=torch.zeros(3)), "advantages"),
    (dict(mask=torch.ones(2, 4)), "mask"),
    (dict(is_weights=torch.ones(2)), "is_weights"),
])
def test_bad_arguments_name_the_input(kw, match):
    args = dict(logp=torch.zeros(2, 3), old_logp=torch.zeros(2, 3), advantages=torch.zeros(2),
                mask=torch.ones(2, 3), num_tokens=6, **CLIP)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        dapo_policy_loss(**args)
