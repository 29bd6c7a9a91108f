import pytest
import torch

from nemo_dapo.core.overlong import overlong_filter_mask, soft_overlong_penalty


def reference_penalty(length: int, l_max: int, l_cache: int, factor: float) -> float:
    """Paper Eq. 13, written piecewise, scaled by factor."""
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return factor * ((l_max - l_cache) - length) / l_cache
    return -factor


def test_paper_setting_at_interval_edges():
    # L_max = 20480, L_cache = 4096: the penalty starts after 16384 tokens and reaches -1 at the cap.
    lengths = torch.tensor([100, 16384, 16385, 18432, 20479, 20480, 20481, 40000])
    got = soft_overlong_penalty(lengths, l_max=20480, l_cache=4096)
    want = torch.tensor([0.0, 0.0, -1 / 4096, -0.5, -4095 / 4096, -1.0, -1.0, -1.0])
    torch.testing.assert_close(got, want)
    assert got.dtype == torch.float32
    assert not torch.signbit(got[:2]).any(), "no -0.0 at or below L_max - L_cache"


def test_factor_scales_and_clamps():
    lengths = torch.tensor([5, 6, 8, 10, 12, 1000])
    got = soft_overlong_penalty(lengths, l_max=10, l_cache=4, factor=0.5)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.25, -0.5, -0.5, -0.5]))
    assert got.min() >= -0.5


@pytest.mark.parametrize("l_max,l_cache,factor", [(10, 4, 1.0), (7, 7, 2.0), (32, 1, 0.3)])
def test_matches_piecewise_reference(l_max, l_cache, factor):
    lengths = torch.arange(0, 2 * l_max + 2)
    got = soft_overlong_penalty(lengths, l_max=l_max, l_cache=l_cache, factor=factor)
    want = torch.tensor([reference_penalty(int(n), l_max, l_cache, factor) for n in lengths])
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("kw,match", [(dict(l_max=10, l_cache=0), "0 < l_cache <= l_max"),
                                      (dict(l_max=10, l_cache=11), "0 < l_cache <= l_max"),
                                      (dict(l_max=10, l_cache=4, factor=-1.0), "factor >= 0")])
def test_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        soft_overlong_penalty(torch.tensor([1, 2]), **kw)


def test_bad_lengths():
    with pytest.raises(ValueError, match="1-D"):
        soft_overlong_penalty(torch.ones(2, 2, dtype=torch.long), l_max=10, l_cache=4)
    with pytest.raises(ValueError, match="whole token counts"):
        soft_overlong_penalty(torch.tensor([1.5]), l_max=10, l_cache=4)


def test_overlong_filter_mask():
    got = overlong_filter_mask(torch.tensor([True, False, True, False]))
    assert got.dtype == torch.float32
    assert got.tolist() == [0.0, 1.0, 0.0, 1.0]
    assert overlong_filter_mask(torch.tensor([0, 1])).tolist() == [1.0, 0.0]
    assert overlong_filter_mask(torch.zeros(0, dtype=torch.bool)).numel() == 0
    with pytest.raises(ValueError, match="bool or 0/1"):
        overlong_filter_mask(torch.tensor([0.5]))
