import torch

from nemo_dapo.core.packing import cut_responses, pack_rows, response_positions


def _batch():
    # left-padded prompts (0 = pad) of lengths 3, 1, 2 and right-padded responses of lengths 2, 3, 0
    prompt_ids = torch.tensor([[11, 12, 13], [0, 0, 21], [0, 31, 32]])
    prompt_lengths = torch.tensor([3, 1, 2])
    response_ids = torch.tensor([[14, 15, 0], [22, 23, 24], [0, 0, 0]])
    return prompt_ids, prompt_lengths, response_ids, torch.tensor([2, 3, 0])


def test_pack_rows_matches_row_by_row_and_pads_to_width():
    prompt_ids, p, response_ids, _ = _batch()
    tokens = pack_rows(prompt_ids, p, response_ids, pad_id=-1, width=8)
    for b in range(3):
        row = prompt_ids[b, 3 - int(p[b]):].tolist() + response_ids[b].tolist()
        assert tokens[b].tolist() == row + [-1] * (8 - len(row))
    assert pack_rows(prompt_ids, p, response_ids, pad_id=-1).shape == (3, 6)  # max prompt 3 + R 3
    assert pack_rows(prompt_ids[:0], p[:0], response_ids[:0], pad_id=-1).shape == (0, 4)


def test_cut_responses_inverts_pack_rows_and_positions_agree():
    prompt_ids, p, response_ids, n = _batch()
    rows = pack_rows(prompt_ids, p, response_ids, pad_id=0)
    ids, mask = cut_responses(rows, p, n, pad_id=0)
    assert mask.sum(-1).tolist() == n.tolist()
    assert torch.equal(ids, torch.where(mask, response_ids, 0))
    pos = response_positions(p, 3, -1)  # the shifted index: the output at p_b - 1 + j predicts token j
    assert torch.equal(rows.gather(1, pos + 1), response_ids)
    empty_ids, empty_mask = cut_responses(rows[:0], p[:0], n[:0], pad_id=0)
    assert empty_ids.shape == (0, 1) and empty_mask.shape == (0, 1)
