"""Layout conversion between the core RolloutBatch (left-padded prompts, right-padded responses) and NeMo-Aligner's
packed rows (prompt + response from position 0, per-token values on the shifted log-prob grid)."""
import pytest
import torch

from nemo_dapo.megatron.layout import (
    blank_rows, loss_input, pack_rollout, pack_tokens, prompt_lengths_of, to_shifted, unpack_response)
from nemo_dapo.core.types import RolloutBatch

PAD = 0


def _batch(p_len, r_len, p_width=5, r_width=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = len(p_len)
    prompt_mask = (torch.arange(p_width)[None] >= (p_width - torch.tensor(p_len))[:, None]).long()
    prompt_ids = torch.randint(10, 99, (b, p_width), generator=g) * prompt_mask
    response_mask = (torch.arange(r_width)[None] < torch.tensor(r_len)[:, None]).float()
    response_ids = (torch.randint(10, 99, (b, r_width), generator=g) * response_mask).long()
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                        response_mask=response_mask, group_ids=torch.arange(b), truncated=torch.tensor(
                            [n == r_width for n in r_len]), old_logp=torch.randn(b, r_width, generator=g) *
                        response_mask, advantages=torch.randn(b, generator=g))


def _slow_pack(batch):
    """Row by row: real prompt tokens, then all response slots, then padding."""
    rows, p = [], []
    for b in range(len(batch)):
        prompt = batch.prompt_ids[b][batch.prompt_mask[b].bool()].tolist()
        rows.append(prompt + batch.response_ids[b].tolist())
        p.append(len(prompt))
    width = max(p) + batch.response_ids.shape[1]
    return torch.tensor([r + [PAD] * (width - len(r)) for r in rows]), torch.tensor(p)


def test_pack_tokens_matches_row_by_row_reference():
    batch = _batch([2, 5, 1, 3], [4, 0, 2, 1])
    tokens, p = pack_tokens(batch, PAD)
    ref_tokens, ref_p = _slow_pack(batch)
    assert torch.equal(p, ref_p) and torch.equal(tokens, ref_tokens)


def test_shifted_values_sit_where_the_logprob_of_each_response_token_is():
    batch = _batch([2, 5, 1, 3], [4, 1, 2, 3])
    packed = pack_rollout(batch, PAD)
    tokens, p = packed["response_tokens"], packed["prompt_lengths"]
    # shifted index t predicts token t + 1: the masked positions' next tokens are exactly the response tokens
    for b in range(len(batch)):
        next_tokens = tokens[b, 1:][packed["mask"][b].bool()]
        assert next_tokens.tolist() == batch.response_ids[b][batch.response_mask[b].bool()].tolist()
    assert torch.equal(unpack_response(packed["prev_logprobs"], p, 4), batch.old_logp)
    assert torch.equal(packed["is_end"], (~batch.truncated).float())
    assert torch.equal(packed["response_lengths"], p + batch.lengths)


def test_to_shifted_and_unpack_are_inverse():
    p = torch.tensor([1, 4, 2])
    vals = torch.randn(3, 5)
    assert torch.equal(unpack_response(to_shifted(vals, p, 4 + 5), p, 5), vals)


def test_loss_input_is_the_packed_batch_on_its_shifted_grid():
    batch = _batch([2, 3], [4, 2])
    batch.engine_logp = batch.old_logp + 0.5 * batch.response_mask
    packed = pack_rollout(batch, PAD)
    inputs = loss_input(packed)
    assert torch.equal(inputs.mask, packed["mask"]) and torch.equal(inputs.old_logp, packed["prev_logprobs"])
    assert torch.equal(inputs.engine_logp, packed["engine_logprobs"]) and torch.equal(inputs.truncated, batch.truncated)
    p = prompt_lengths_of(batch)  # the response tokens come back out of the shifted grid unchanged
    assert torch.equal(unpack_response(inputs.old_logp, p, 4), batch.old_logp)
    assert inputs.mask.sum() == batch.response_mask.sum()  # prompt and padding positions are masked out
    no_old = {k: v for k, v in packed.items() if k != "prev_logprobs"}
    with pytest.raises(ValueError, match="prev_logprobs"):
        loss_input(no_old)


def test_blank_rows_are_fully_masked_rows_of_the_packed_layout():
    packed = pack_rollout(_batch([2, 3, 1], [4, 2, 1]), PAD)
    blank = blank_rows(packed.keys(), 2, PAD, 6)
    assert set(blank) == set(packed)
    for k, v in blank.items():  # the real batch's dtypes and widths: the two concatenate
        assert v.dtype == packed[k].dtype and v.dim() == packed[k].dim(), k
        torch.cat([packed[k][:, :v.shape[1]] if v.dim() == 2 else packed[k], v])
    assert blank["response_tokens"].shape == (2, 6) and (blank["response_tokens"] == PAD).all()
    assert blank["mask"].shape == (2, 5) and blank["mask"].sum() == 0 and (blank["is_end"] == 1).all()
    assert blank["advantages"].sum() == 0 and loss_input(blank).truncated.sum() == 0
    empty = blank_rows(("response_tokens", "mask"), 0, PAD, 2)
    assert empty["response_tokens"].shape == (0, 2) and empty["mask"].shape == (0, 1)
    with pytest.raises(KeyError, match="not a field"):
        blank_rows(("rewards",), 1, PAD, 2)


def test_empty_prompt_is_rejected():
    batch = _batch([2, 3], [1, 1])
    batch.prompt_mask[1] = 0
    with pytest.raises(ValueError, match="at least one real token"):
        prompt_lengths_of(batch)
