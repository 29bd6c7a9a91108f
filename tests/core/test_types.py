import torch

from nemo_dapo.core.types import Generation


def test_generation_cat_repads_parts_and_keeps_logprobs_only_when_all_have_them():
    a = Generation(torch.tensor([[5, 6]]), torch.tensor([[1.0, 1.0]]), torch.tensor([False]),
                   logprobs=torch.tensor([[-0.5, -0.25]]))
    b = Generation(torch.tensor([[7, 8, 9]]), torch.tensor([[1.0, 1.0, 1.0]]), torch.tensor([True]),
                   logprobs=torch.tensor([[-1.0, -2.0, -3.0]]))
    out = Generation.cat([a, b], pad_id=2)
    assert out.response_ids.tolist() == [[5, 6, 2], [7, 8, 9]]
    assert out.response_mask[0].tolist() == [1, 1, 0] and out.truncated.tolist() == [False, True]
    assert out.logprobs.tolist() == [[-0.5, -0.25, 0.0], [-1.0, -2.0, -3.0]]
    b.logprobs = None
    assert Generation.cat([a, b], pad_id=2).logprobs is None
