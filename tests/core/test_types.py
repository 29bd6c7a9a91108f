import torch

from nemo_dapo.core.types import Generation, RolloutBatch


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


def rollout(prompt, response, pad_id=0):
    """One row of a batch whose prompt and response are as wide as they are (no padding)."""
    return RolloutBatch(prompt_ids=torch.tensor([prompt]), prompt_mask=torch.ones(1, len(prompt), dtype=torch.long),
                        response_ids=torch.tensor([response]), response_mask=torch.ones(1, len(response)),
                        group_ids=torch.tensor([0]), truncated=torch.tensor([False]), pad_id=pad_id)


def test_rollout_batch_cat_pads_prompts_left_and_responses_right_and_trim_undoes_extra_columns():
    out = RolloutBatch.cat([rollout([7, 8], [3, 4, 5], pad_id=9), rollout([6, 7, 8], [3], pad_id=9)])
    assert out.prompt_ids.tolist() == [[9, 7, 8], [6, 7, 8]] and out.prompt_mask.tolist() == [[0, 1, 1], [1, 1, 1]]
    assert out.response_ids.tolist() == [[3, 4, 5], [3, 9, 9]] and out.response_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    row = out.select([1]).trim()  # its own widths again
    assert row.prompt_ids.tolist() == [[6, 7, 8]] and row.response_ids.tolist() == [[3]]
    row = out.select([0]).trim()
    assert row.prompt_ids.tolist() == [[7, 8]] and row.response_ids.tolist() == [[3, 4, 5]]
