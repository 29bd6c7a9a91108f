"""megatron/step.py in one process: the micro-batcher and its filler (the schedule itself runs in the multi-process
tests: tests/megatron/test_policy.py on a bare GPTModel, tests/aligner/test_actor_loss.py on the NeMo actor)."""
import pytest
import torch

from nemo_dapo.core.types import RolloutBatch
from nemo_dapo.megatron.layout import pack_rollout
from nemo_dapo.megatron.step import microbatches, normalizer_share, row_lengths

PAD = 0


def _batch(p_len, r_len, p_width=5, r_width=6):
    g = torch.Generator().manual_seed(0)
    b = len(p_len)
    prompt_mask = (torch.arange(p_width)[None] >= (p_width - torch.tensor(p_len))[:, None]).long()
    response_mask = (torch.arange(r_width)[None] < torch.tensor(r_len)[:, None]).float()
    return RolloutBatch(prompt_ids=torch.randint(10, 99, (b, p_width), generator=g) * prompt_mask,
                        prompt_mask=prompt_mask,
                        response_ids=(torch.randint(10, 99, (b, r_width), generator=g) * response_mask).long(),
                        response_mask=response_mask, group_ids=torch.arange(b), truncated=torch.zeros(b).bool(),
                        old_logp=torch.randn(b, r_width, generator=g) * response_mask,
                        advantages=torch.randn(b, generator=g))


def test_rows_are_grouped_longest_first_and_cut_to_their_own_length():
    packed = pack_rollout(_batch([2, 5, 1, 3], [1, 6, 2, 4]), PAD)  # real lengths 3, 11, 3, 7
    assert row_lengths(packed).tolist() == [3, 11, 3, 7]
    groups, micro = microbatches(packed, multiple=4, pad_id=PAD, max_rows=2)
    assert groups == [[1, 3], [0, 2]]
    assert [mb["response_tokens"].shape for mb in micro] == [(2, 12), (2, 4)]  # 11 -> 12, 3 -> 4
    for g, mb in zip(groups, micro):
        assert mb["mask"].shape[1] == mb["response_tokens"].shape[1] - 1
        w = min(mb["response_tokens"].shape[1], packed["response_tokens"].shape[1])
        assert torch.equal(mb["response_tokens"][:, :w], packed["response_tokens"][g, :w])
        assert mb["mask"].sum() == packed["mask"][g].sum()  # no response token lost, none added
        assert torch.equal(mb["advantages"], packed["advantages"][g])


def test_a_token_budget_packs_short_rows_together():
    packed = pack_rollout(_batch([2, 5, 1, 3], [1, 6, 2, 4]), PAD)
    groups, _ = microbatches(packed, multiple=4, pad_id=PAD, max_tokens=16)
    assert groups == [[1], [3, 0], [2]]  # 12 alone; 2 x 8; 3 x 8 would exceed 16


def test_an_empty_rank_runs_one_fully_masked_filler_micro_batch():
    packed = {k: v[:0] for k, v in pack_rollout(_batch([2], [3]), PAD).items()}
    groups, micro = microbatches(packed, multiple=8, pad_id=PAD, max_rows=4)
    assert groups == [] and len(micro) == 1
    filler = micro[0]
    assert set(filler) == set(packed) and filler["response_tokens"].shape == (1, 8)
    assert filler["mask"].sum() == 0 and filler["is_end"].tolist() == [1.0]


def test_the_planner_refuses_a_plan_without_any_bound():
    packed = pack_rollout(_batch([2], [3]), PAD)
    with pytest.raises(ValueError, match="max_tokens"):
        microbatches(packed, multiple=1, pad_id=PAD)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_normalizer_share_is_the_rank_total_over_its_micro_batches(agg):
    """The step's global normaliser is the sum of every rank's share, so a rank's share must be the total over its
    micro-batches (filler included, which adds nothing), whatever the split: valid tokens for token-mean, rows with
    a valid token for the sequence means. Expected values counted from the packed mask directly."""
    from nemo_dapo.core.loss import make_loss_fn

    loss_fn = make_loss_fn(eps_low=0.2, eps_high=0.28, agg=agg, max_new_tokens=6)
    packed = pack_rollout(_batch([2, 5, 1, 3], [1, 6, 0, 4]), PAD)  # row 2 has no response token
    want = packed["mask"].sum() if agg == "token-mean" else (packed["mask"].sum(1) > 0).sum()
    for max_rows in (1, 2, 4):
        _, micro = microbatches(packed, multiple=4, pad_id=PAD, max_rows=max_rows)
        assert float(normalizer_share(loss_fn, micro)) == float(want), max_rows
    empty = {k: v[:0] for k, v in packed.items()}
    assert float(normalizer_share(loss_fn, microbatches(empty, multiple=4, pad_id=PAD, max_rows=2)[1])) == 0.0
