"""The shared rules of the algorithm block (core/settings.py) at their boundaries: the value at a bound against one
past it."""
from nemo_dapo.core import settings as S


def test_a_max_gen_batch_size_equal_to_gen_batch_size_is_allowed():
    ds = "dynamic_sampling."
    assert S.problems({ds + "gen_batch_size": 8, ds + "max_gen_batch_size": 8}) == []
    assert [k for k, _ in S.problems({ds + "gen_batch_size": 9, ds + "max_gen_batch_size": 8})] == \
        [ds + "max_gen_batch_size"]


def test_a_prior_pass_rate_of_one_is_refused():
    key = "dynamic_sampling.prior_pass_rate"
    assert [k for k, _ in S.problems({key: 1.0})] == [key]
    assert S.problems({key: 0.999}) == []


def test_a_soft_penalty_starting_exactly_at_the_cap_is_refused():
    v = {"overlong.enabled": True, "overlong.l_max": 20, "overlong.l_cache": 4}
    assert [k for k, _ in S.problems(v, max_new_tokens=16)] == ["overlong.l_max"]  # 20 - 4 = 16: at the cap
    assert S.problems(v, max_new_tokens=17) == []


def test_max_age_zero_the_references_value_is_allowed():
    key = "dynamic_sampling.max_age"
    assert S.problems({key: 0}) == []
    assert [k for k, _ in S.problems({key: -1})] == [key]
