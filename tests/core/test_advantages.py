import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_dapo.core.advantages import group_advantages


def loop_reference(rewards, group_ids, eps=1e-6, scale_by_std=True):
    """The obvious version: one group at a time, torch.std (unbiased), size-1 groups as mean 0 / std 1."""
    out = torch.empty(len(rewards), dtype=torch.float64)
    for gid in set(group_ids.tolist()):
        idx = [i for i, g in enumerate(group_ids.tolist()) if g == gid]
        r = rewards[idx].double()
        if len(idx) == 1:
            mean, std = 0.0, 1.0
        else:
            mean, std = r.mean(), r.std()
        if len(idx) > 1 and bool((r == r[0]).all()):
            out[idx] = 0.0
        else:
            out[idx] = (r - mean) / (std + eps) if scale_by_std else r - mean
    return out


def test_hand_computed_group():
    # rewards 1, -1, -1, 1 -> mean 0, unbiased std sqrt(4/3)
    adv = group_advantages(torch.tensor([1.0, -1.0, -1.0, 1.0]), torch.tensor([5, 5, 5, 5]))
    s = (4 / 3) ** 0.5
    torch.testing.assert_close(adv, torch.tensor([1 / s, -1 / s, -1 / s, 1 / s]))


def test_non_contiguous_ids_group_by_id_not_position():
    rewards = torch.tensor([1.0, 0.0, -1.0, 0.5, 2.0, 0.0])
    ids = torch.tensor([9, 2, 9, 2, 9, 2])
    torch.testing.assert_close(group_advantages(rewards, ids), loop_reference(rewards, ids).float())
    # permuting the batch permutes the advantages
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    torch.testing.assert_close(group_advantages(rewards[perm], ids[perm]), group_advantages(rewards, ids)[perm])


def test_std_zero_group_is_exactly_zero():
    # 0.1 * 3 / 3 != 0.1 in floating point: the residue must not be amplified by 1 / eps
    rewards = torch.tensor([0.1, 0.1, 0.1, -2.0, 1.0, 0.3, 0.3])
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    adv = group_advantages(rewards, ids)
    assert adv[[0, 1, 2, 5, 6]].tolist() == [0.0] * 5
    assert adv[3] < 0 < adv[4]


def test_size_one_group_follows_reference():
    adv = group_advantages(torch.tensor([-1.0, 1.0, 0.0, 1.0]), torch.tensor([0, 1, 1, 2]))
    assert adv[0].item() == pytest.approx(-1.0 / (1 + 1e-6))
    assert adv[3].item() == pytest.approx(1.0 / (1 + 1e-6))
    adv = group_advantages(torch.tensor([-1.0]), torch.tensor([0]), scale_by_std=False)
    assert adv.tolist() == [-1.0]


def test_scale_by_std_false_is_centred_reward():
    rewards = torch.tensor([1.0, -1.0, -1.0, 0.0, 2.0])
    ids = torch.tensor([0, 0, 0, 1, 1])
    torch.testing.assert_close(group_advantages(rewards, ids, scale_by_std=False),
                               torch.tensor([4 / 3, -2 / 3, -2 / 3, -1.0, 1.0]))


def test_empty_and_errors():
    assert group_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long)).numel() == 0
    with pytest.raises(ValueError, match="equal length"):
        group_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        group_advantages(torch.zeros(2), torch.zeros(2))
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(torch.tensor([1.0, float("nan")]), torch.zeros(2, dtype=torch.long))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.sampled_from([-2.0, -1.0, -0.5, 0.0, 0.1, 1.0, 3.0])),
                min_size=1, max_size=30),
       st.booleans())
def test_matches_loop_reference(pairs, scale):
    ids = torch.tensor([p[0] for p in pairs]) * 7 - 3  # negative and non-contiguous ids
    rewards = torch.tensor([p[1] for p in pairs])
    got = group_advantages(rewards, ids, scale_by_std=scale)
    torch.testing.assert_close(got.double(), loop_reference(rewards, ids, scale_by_std=scale), rtol=1e-5, atol=1e-5)


def test_eps_is_added_to_the_group_std():
    # eps = 1 makes the default's 1e-6 visible: [1, -1] has std sqrt(2), so each advantage is 1 / (sqrt(2) + 1)
    adv = group_advantages(torch.tensor([1.0, -1.0]), torch.tensor([0, 0]), eps=1.0)
    expected = 1.0 / (math.sqrt(2.0) + 1.0)
    torch.testing.assert_close(adv, torch.tensor([expected, -expected]))
