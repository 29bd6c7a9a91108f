import io
import math

import pytest
import torch

from nemo_dapo.core.dynamic_sampling import BatchFiller, BudgetExhausted, Group

MIXED, ALL_RIGHT, ALL_WRONG = [1.0, 0.0, 1.0, 0.0], [1.0] * 4, [0.0] * 4


def group(uid, acc=MIXED, rewards=None, payload=None):
    acc = torch.tensor(acc)
    rewards = acc * 2 - 1 if rewards is None else torch.tensor(rewards)
    return Group(uid=uid, acc=acc, rewards=rewards, payload=payload)


def uids(groups):
    return [g.uid for g in groups]


def test_filter_looks_at_unshaped_accuracy_only():
    f = BatchFiller(2)
    # Overlong shaping makes the shaped rewards of these two groups vary, but nobody got the answer right / wrong.
    f.add([group(0, ALL_WRONG, [-1.0, -1.5, -2.0, -1.0]), group(1, ALL_RIGHT, [1.0, 0.2, 1.0, 0.0]),
           group(2, MIXED, [1.0, -1.0, 1.0, -1.0]), group(3, [1.0, 0.0, 0.0, 0.0])])
    s = f.step_stats()
    assert (s["kept"], s["filtered_all_wrong"], s["filtered_all_correct"]) == (2, 1, 1)
    assert s["generated_groups"] == 4 and s["num_gen_batches"] == 1 and s["pass_rate"] == 0.5
    assert f.ready() and uids(f.take()) == [2, 3]


def test_empty_filler():
    f = BatchFiller(4)
    assert not f.ready()
    s = f.step_stats()
    assert s["kept"] == s["generated_groups"] == s["num_gen_batches"] == 0 and s["pass_rate"] == 0.0
    with pytest.raises(RuntimeError, match="before ready"):
        f.take()
    assert f.next_gen_batch_size() == math.ceil(4 / 0.5 * 1.1)  # from the prior alone
    f.add([])  # an empty generation batch still uses budget
    assert f.step_stats()["num_gen_batches"] == 1 and not f.ready()


def test_disabled_filter_keeps_every_group():
    f = BatchFiller(3, enabled=False)
    assert f.next_gen_batch_size() == 3  # nothing is filtered, so no over-sampling
    f.add([group(0, ALL_WRONG), group(1, ALL_RIGHT), group(2)])
    assert f.ready() and uids(f.take()) == [0, 1, 2]
    assert f.step_stats()["filtered_all_wrong"] == 0


def test_budget_raise_says_what_to_change():
    f = BatchFiller(2, max_gen_batches=2)
    f.add([group(0), group(1, ALL_WRONG)])
    with pytest.raises(BudgetExhausted) as err:
        f.add([group(2, ALL_RIGHT)])
    msg = str(err.value)
    for hint in ("max_gen_batches", "train_partial", "unbounded", "kept 1 of 2"):
        assert hint in msg
    # filling the batch within the budget does not raise
    f = BatchFiller(2, max_gen_batches=2)
    f.add([group(0, ALL_WRONG)])
    f.add([group(1), group(2)])
    assert f.ready()


def test_budget_train_partial():
    f = BatchFiller(3, max_gen_batches=2, on_budget_exhausted="train_partial")
    f.add([group(0), group(1, ALL_WRONG)])
    assert not f.ready()
    f.add([group(2, ALL_RIGHT)])
    assert f.ready() and uids(f.take()) == [0]
    assert f.step_stats()["trained_groups"] == 1
    # nothing kept at all: ready, and take() returns [] (the loop skips this update)
    f.add([group(3, ALL_WRONG)])
    f.add([group(4, ALL_WRONG)])
    assert f.ready() and f.take() == []
    assert f.step_stats()["trained_groups"] == 0 and f.step_stats()["num_gen_batches"] == 2


def test_budget_unbounded_keeps_sampling():
    f = BatchFiller(1, max_gen_batches=1, on_budget_exhausted="unbounded")
    for uid in range(20):
        f.add([group(uid, ALL_WRONG)])
    assert not f.ready()
    f.add([group(99)])
    assert f.ready() and uids(f.take()) == [99]


def test_surplus_is_carried_oldest_first():
    f = BatchFiller(3, max_age=1)
    f.add([group(u) for u in range(5)])
    assert uids(f.take()) == [0, 1, 2]
    s = f.step_stats()
    assert (s["carried"], s["discarded"]) == (2, 0)
    f.add([group(5), group(6)])
    batch = f.take()
    assert uids(batch) == [3, 4, 5] and [g.age for g in batch] == [1, 1, 0]
    assert f.step_stats()["carried_in"] == 2 and f.step_stats()["carried"] == 1


def test_groups_added_with_an_age_go_first():
    f = BatchFiller(2)
    f.add([group(0), Group(uid=1, acc=torch.tensor(MIXED), rewards=torch.tensor(MIXED), age=1), group(2)])
    assert uids(f.take()) == [1, 0]


def test_surplus_past_max_age_is_discarded():
    f = BatchFiller(1, max_age=1)
    f.add([group(0), group(1), group(2)])
    assert uids(f.take()) == [0]
    assert f.ready(), "two carried groups already fill the next batch"
    assert uids(f.take()) == [1]
    s = f.step_stats()
    assert (s["carried"], s["discarded"], s["num_gen_batches"]) == (0, 1, 0)
    assert not f.ready()
    # max_age=0 reproduces the reference: surplus is dropped at once
    f = BatchFiller(1, max_age=0)
    f.add([group(0), group(1)])
    f.take()
    assert f.step_stats()["discarded"] == 1 and not f.ready()


def test_step_stats_before_and_after_take():
    f = BatchFiller(1)
    f.add([group(0, ALL_WRONG), group(1), group(2)])
    live = f.step_stats()
    assert live["kept"] == 2 and live["carried"] == 0
    f.take()
    taken = f.step_stats()
    assert taken["kept"] == 2 and taken["carried"] == 1 and taken["trained_groups"] == 1
    f.add([group(3, ALL_WRONG)])  # the next step has begun
    assert f.step_stats()["kept"] == 0 and f.step_stats()["filtered_all_wrong"] == 1


def test_adaptive_proposal_follows_the_observed_pass_rate():
    f = BatchFiller(100)
    f.add([group(u, MIXED if u % 4 == 0 else ALL_WRONG) for u in range(200)])  # 50 of 200 pass
    estimate = (50 + 0.5 * 8) / (200 + 8)
    assert f.pass_rate_estimate() == pytest.approx(estimate)
    assert f.next_gen_batch_size() == math.ceil(50 / estimate * 1.1)
    assert BatchFiller(100, max_gen_batch_size=120).next_gen_batch_size() == 120  # clamped
    assert BatchFiller(100, adaptive=False, gen_batch_size=300).next_gen_batch_size() == 300
    # asked with the batch full (the overlap draws the next step's prompts early): the whole batch less the surplus
    # that take() carries over, at this step's estimate
    f = BatchFiller(100, max_gen_batch_size=1000)
    f.add([group(u, MIXED if u < 102 else ALL_WRONG) for u in range(200)])  # full, 2 surplus
    estimate = (102 + 0.5 * 8) / (200 + 8)
    assert f.next_step_gen_batch_size() == math.ceil(98 / estimate * 1.1)
    assert f.next_gen_batch_size() == math.ceil(1 / estimate * 1.1)  # this step needs no more: one group at least
    assert BatchFiller(100, adaptive=False, gen_batch_size=300).next_step_gen_batch_size() == 300
    # each finished step's counts fade by pass_rate_memory per later step
    f = BatchFiller(2)
    f.add([group(0), group(1), group(2, ALL_WRONG), group(3, ALL_WRONG)])
    f.take()
    assert f.pass_rate_estimate() == pytest.approx((2 + 4) / (4 + 8))
    f.add([group(4), group(5)])
    f.take()
    assert f.pass_rate_estimate() == pytest.approx((0.7 * 2 + 2 + 4) / (0.7 * 4 + 2 + 8))


def scored_groups(n, start_uid, concentration, gen, group_size=16):
    """n groups whose per-prompt pass rate is Beta(a, b) distributed, sampled with the given generator."""
    a, b = concentration
    # torch's Beta sampler takes no generator: seed the global RNG inside fork_rng, so the draws are reproducible
    # and the global RNG state of other tests is left untouched.
    with torch.random.fork_rng():
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        p = torch.distributions.Beta(a, b).sample((n,))
    acc = (torch.rand(n, group_size, generator=gen) < p[:, None]).float()
    return [Group(uid=start_uid + i, acc=acc[i], rewards=acc[i] * 2 - 1) for i in range(n)]


def simulate(concentration, adaptive, steps=12, num_groups=32, seed=1):
    """(generated / trained groups, kept / generated groups, discarded groups) over ``steps`` rollout steps."""
    gen = torch.Generator().manual_seed(seed)
    if adaptive:
        f = BatchFiller(num_groups, on_budget_exhausted="unbounded")
    else:  # the reference: fixed 3x generation batch, surplus discarded
        f = BatchFiller(num_groups, on_budget_exhausted="unbounded", adaptive=False,
                        gen_batch_size=3 * num_groups, max_age=0)
    generated = trained = kept = discarded = uid = 0
    for _ in range(steps):
        while not f.ready():
            n = f.next_gen_batch_size()
            f.add(scored_groups(n, uid, concentration, gen))
            uid += n
        trained += len(f.take())
        s = f.step_stats()
        generated, kept, discarded = generated + s["generated_groups"], kept + s["kept"], discarded + s["discarded"]
    return generated / trained, kept / generated, discarded


# Beta shapes of the per-prompt pass rate -> share of groups kept: ~0.85, ~0.6, ~0.23 (the reference then needs two
# 3x generation batches per step). The last case is compared with a looser bound: 1 / pass rate is a floor for
# every policy, and at ~0.23 it is already 0.7 of the reference's 6x. The ratio is the mean over 5 seeds: one seed's
# moves by +-0.08 in the last case (0.68-0.85 over seeds 1-10; torch 2.4's Beta draws give seed 1 0.84 where 2.13's
# give 0.68), the means 0.40 / 0.61 / 0.79 under both.
@pytest.mark.parametrize("concentration,bound", [((1.0, 3.0), 0.5), ((0.3, 1.5), 0.7), ((0.1, 2.0), 0.85)])
def test_adaptive_oversampling_generates_less_than_fixed_3x(concentration, bound):
    ratios = []
    for seed in range(1, 6):
        ours, pass_rate, discarded = simulate(concentration, adaptive=True, seed=seed)
        reference, _, reference_discarded = simulate(concentration, adaptive=False, seed=seed)
        assert reference >= 3.0 and reference_discarded > 0
        # carrying the surplus over leaves filtering as the only waste
        assert discarded == 0 and ours <= 1.05 / pass_rate, (seed, ours, pass_rate)
        ratios.append(ours / reference)
    assert sum(ratios) / len(ratios) <= bound, ratios


def test_state_dict_round_trip_through_torch_save():
    f = BatchFiller(2, max_age=2)
    f.add([group(u, payload={"x": torch.full((2,), float(u))}) for u in range(5)] + [group(9, ALL_WRONG)])
    f.take()
    for add_after_take in (False, True):  # between steps, and in the middle of the next step
        if add_after_take:
            f.add([group(10, ALL_RIGHT)])
        buf = io.BytesIO()
        torch.save(f.state_dict(), buf)
        buf.seek(0)
        g = BatchFiller(2, max_age=2)
        g.load_state_dict(torch.load(buf, weights_only=True))
        assert g.step_stats() == f.step_stats()
    assert g.next_gen_batch_size() == f.next_gen_batch_size()
    assert g.pass_rate_estimate() == f.pass_rate_estimate()
    for filler in (f, g):
        filler.add([group(20)])
    a, b = f.take(), g.take()
    assert uids(a) == uids(b) == [2, 3] and [x.age for x in b] == [1, 1]
    torch.testing.assert_close(b[0].payload["x"], torch.full((2,), 2.0))
    assert f.state_dict()["groups"][0]["uid"] == g.state_dict()["groups"][0]["uid"] == 4
    with pytest.raises(ValueError, match="version"):
        g.load_state_dict({"version": 0})


def test_bad_groups_are_rejected():
    f = BatchFiller(2)
    f.add([group(1)])
    with pytest.raises(ValueError, match="uid 1 appears twice"):
        f.add([group(1)])
    with pytest.raises(ValueError, match="uid 2 appears twice"):
        f.add([group(2), group(2)])
    with pytest.raises(ValueError, match="0/1"):
        f.add([group(3, [0.5, 1.0])])
    with pytest.raises(ValueError, match="rewards"):
        f.add([Group(uid=4, acc=torch.ones(3), rewards=torch.ones(2))])
    with pytest.raises(TypeError, match="uid"):
        f.add([Group(uid="p-17", acc=torch.ones(2), rewards=torch.ones(2))])
    assert f.step_stats()["num_gen_batches"] == 1, "a rejected batch must not count"


@pytest.mark.parametrize("kw,match", [
    (dict(num_groups=0), "num_groups"),
    (dict(max_gen_batches=0), "max_gen_batches"),
    (dict(on_budget_exhausted="crash"), "on_budget_exhausted"),
    (dict(max_age=-1), "max_age"),
    (dict(gen_batch_size=0), "gen_batch_size"),
    (dict(max_gen_batch_size=0), "max_gen_batch_size"),
    (dict(prior_pass_rate=0.0), "prior_pass_rate"),
    (dict(safety=0.5), "safety"),
])
def test_bad_arguments(kw, match):
    args = dict(num_groups=4)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        BatchFiller(**args)
