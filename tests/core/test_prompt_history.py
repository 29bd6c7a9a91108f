"""History-based prompt skipping: the skip rule, the retry bound, the sampler integration and state round-trip."""
import copy

import pytest

from nemo_dapo.core.loop_data import PromptSampler
from nemo_dapo.core.prompt_history import PromptHistory, SkipRule


def test_skip_probability_grows_with_the_streak_and_stops_at_the_retry_bound():
    rule = SkipRule(skip_prob=0.5, max_skips=3)
    assert rule.probability(0, 0) == 0.0  # no uninformative history: never skipped
    assert rule.probability(1, 0) == pytest.approx(0.5)
    assert rule.probability(2, 1) == pytest.approx(0.75)
    assert rule.probability(3, 2) == pytest.approx(0.875)
    assert rule.probability(5, 3) == 0.0  # skipped max_skips times in a row: drawn whatever the streak


def test_empirical_skip_rate_matches_the_rule():
    history = PromptHistory(SkipRule(skip_prob=0.3, max_skips=1), seed=5)
    for i in range(4000):
        history.record(i, [1, 1, 1, 1])  # streak 1 for every prompt
    rate = sum(history.consider(i) for i in range(4000)) / 4000
    assert abs(rate - 0.3) < 0.03
    assert history.skipped == round(rate * 4000)


def test_streak_counts_uninformative_groups_in_a_row_and_resets_on_an_informative_one():
    history = PromptHistory(SkipRule(0.5, 3))
    history.record(7, [0, 0, 0])
    history.record(7, [1, 1, 1])  # all-wrong and all-correct both count
    assert history.streak[7] == 2
    history.record(7, [1, 0, 1])
    assert 7 not in history.streak
    history.record(8, [])  # nothing scored: no evidence
    assert 8 not in history.streak


def test_a_prompt_is_never_skipped_more_than_max_skips_times_in_a_row():
    history = PromptHistory(SkipRule(skip_prob=0.99, max_skips=2), seed=1)
    history.record(0, [1, 1])
    for _ in range(30):
        history.record(0, [1, 1])  # streak 31: p ~ 1
    decisions = [history.consider(0) for _ in range(30)]
    runs, run = [], 0
    for skipped in decisions:
        run = run + 1 if skipped else 0
        runs.append(run)
    assert max(runs) == 2  # the bound is reached (p ~ 1) and never passed
    assert decisions.count(False) >= 30 // 3  # every third consideration at the latest is a draw


def test_sampler_with_history_skips_uninformative_prompts_and_still_visits_every_prompt():
    n = 20
    history = PromptHistory(SkipRule(skip_prob=0.9, max_skips=2), seed=3)
    sampler = PromptSampler(n, seed=0, history=history)
    easy = set(range(0, n, 2))
    for i in easy:
        for _ in range(5):
            history.record(i, [1, 1, 1, 1])
    drawn = []
    for _ in range(12):
        indices, uids = sampler.draw(5)
        assert len(indices) == 5 and uids == list(range(sampler.next_uid - 5, sampler.next_uid))
        drawn.extend(indices)
    share_easy = sum(i in easy for i in drawn) / len(drawn)
    assert share_easy < 0.35  # half of the prompts are easy; skipping makes them rarer
    assert set(drawn) == set(range(n))  # none is skipped forever
    assert sampler.skipped == history.skipped > 0


def test_sampler_state_round_trip_restores_history_and_decisions():
    def make():
        history = PromptHistory(SkipRule(skip_prob=0.6, max_skips=3), seed=11)
        return PromptSampler(30, seed=2, history=history)

    a = make()
    for k in range(30):
        a.history.record(k, [0, 0] if k % 3 else [0, 1])
    a.draw(17)
    state = copy.deepcopy(a.state_dict())
    expected = [a.draw(7)[0] for _ in range(5)]
    b = make()
    b.load_state_dict(state)
    assert b.history.streak == a.history.streak and b.history.skipped == state["history"]["skipped"] > 0
    assert [b.draw(7)[0] for _ in range(5)] == expected
    c = make()  # without the history the draws differ (the check can fail)
    c.load_state_dict({k: v for k, v in state.items() if k != "history"})
    assert [c.draw(7)[0] for _ in range(5)] != expected


@pytest.mark.parametrize("kwargs, match", [(dict(skip_prob=1.0), "skip_prob"), (dict(skip_prob=-0.1), "skip_prob"),
                                           (dict(max_skips=0), "max_skips"), (dict(max_skips=True), "max_skips"),
                                           (dict(max_skips=10 ** 12), r"max_skips=1000000000000 must be an integer "
                                                                      r"in \[1, 100\]")])
def test_bad_rule_values_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SkipRule(**kwargs)


@pytest.mark.parametrize("override, pattern", [
    ("algorithm.dynamic_sampling.skip_history.skip_prob=1.0",
     r"'algorithm.dynamic_sampling.skip_history.skip_prob' = 1.0 is out of range: it must be in \[0, 1\)"),
    ("algorithm.dynamic_sampling.skip_history.max_skips=0",
     r"'algorithm.dynamic_sampling.skip_history.max_skips' = 0 must be an integer in \[1, 100\]"),
    # 10**12 skips in a row would mean "skip forever", which the retry bound promises never happens
    ("algorithm.dynamic_sampling.skip_history.max_skips=1000000000000",
     r"'algorithm.dynamic_sampling.skip_history.max_skips' = 1000000000000 must be an integer in \[1, 100\]: .*"
     r"at least once every max_skips \+ 1 epochs"),
    ("algorithm.dynamic_sampling.skip_history.enabled=maybe", r"algorithm.dynamic_sampling.skip_history.enabled"),
])
def test_config_rejects_bad_skip_history_values_naming_the_key(override, pattern):
    from nemo_dapo.local.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=pattern):
        load_config("tiny_cpu", [override])


def test_settings_carry_skip_history_into_the_loop_settings_default_off():
    from nemo_dapo.local.config import algorithm_values, load_config
    from nemo_dapo.core.settings import build_loop_parts, from_values, problems

    cfg = load_config("tiny_cpu", ["algorithm.dynamic_sampling.skip_history.enabled=true",
                                   "algorithm.dynamic_sampling.skip_history.max_skips=5"])
    settings = from_values(algorithm_values(cfg))
    loop_settings, _, _ = build_loop_parts(settings, train_batch_size=4, mini_batch_size=8, ppo_epochs=1,
                                           shuffle_minibatches=True, max_new_tokens=40, temperature=1.0, top_p=1.0,
                                           seed=0, streaming=False, on_filler_full="abort", fill_order="finish")
    sh = loop_settings.skip_history
    assert sh.enabled and sh.max_skips == 5 and sh.skip_prob == 0.5
    assert not from_values(algorithm_values(load_config("tiny_cpu"))).skip_history.enabled
    assert problems({"dynamic_sampling.skip_history.max_skips": 2.5})[0][0] == "dynamic_sampling.skip_history.max_skips"


def test_the_retry_bound_is_kept_at_its_largest_allowed_value():
    """max_skips = MAX_SKIPS (the most the settings allow): a prompt whose groups are always uninformative (p ~ 1)
    is still drawn at least once every MAX_SKIPS + 1 considerations, so the promise holds over a run."""
    from nemo_dapo.core.settings import MAX_SKIPS, problems

    assert problems({"dynamic_sampling.skip_history.max_skips": MAX_SKIPS}) == []
    assert problems({"dynamic_sampling.skip_history.max_skips": MAX_SKIPS + 1})
    history = PromptHistory(SkipRule(skip_prob=0.999, max_skips=MAX_SKIPS), seed=4)
    for _ in range(50):
        history.record(0, [1, 1])
    decisions = [history.consider(0) for _ in range(5 * (MAX_SKIPS + 1))]
    gaps = "".join("s" if d else "d" for d in decisions).split("d")
    assert max(len(g) for g in gaps) == MAX_SKIPS and decisions.count(False) >= 4
