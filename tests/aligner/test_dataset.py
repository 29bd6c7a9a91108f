"""DAPOPromptDataset and collate: answers and per-draw group ids travel with the prompts."""
import pytest
import torch

from nemo_dapo.aligner.dataset import DAPOPromptDataset, collate
from tests.aligner._fakes import CharTokenizer, Row

TOK = CharTokenizer()


def _ds(**kw):
    rows = [Row("1+1=", "2", "a"), Row("a long prompt that is dropped", "7", "b"), Row("2+3=", "5", "c")]
    return DAPOPromptDataset(rows, TOK, max_prompt_len=kw.pop("max_prompt_len", 10), **kw)


def test_items_carry_answer_and_ids_and_long_prompts_are_dropped():
    ds = _ds(prompt_template="Q:{prompt}", add_bos=True)
    assert len(ds) == 2 and ds.num_dropped == 1
    item = ds[1]
    assert item["answer"] == "5" and item["problem_id"] == "c" and item["index"] == 2
    assert item["text"].tolist() == [TOK.bos_id] + TOK.text_to_ids("Q:2+3=") and item["length"] == 7


def test_drop_long_false_names_the_fix():
    with pytest.raises(ValueError, match="max_prompt_len=10"):
        _ds(drop_long=False)


def test_collate_pads_both_ways_and_keeps_group_ids():
    ds = DAPOPromptDataset([Row("ab", "1"), Row("abcd", "2")], TOK, max_prompt_len=8)
    batch = collate([ds[0], ds[1], ds[0]], pad_id=TOK.eos_id, group_ids=[7, 8, 9])
    assert batch["text"].tolist()[0] == [97, 98, 2, 2] and batch["length"].tolist() == [2, 4, 2]
    assert batch["prompt_ids"].tolist()[0] == [2, 2, 97, 98] and batch["prompt_mask"].tolist()[0] == [0, 0, 1, 1]
    # the same prompt drawn twice keeps two group ids: repeated prompts never merge into one group
    assert batch["group_ids"].tolist() == [7, 8, 9] and batch["answers"] == ["1", "2", "1"]
    # left and right padding hold the same tokens
    for b in range(3):
        assert batch["text"][b][:batch["length"][b]].tolist() == \
            batch["prompt_ids"][b][batch["prompt_mask"][b].bool()].tolist()


def test_collate_requires_explicit_group_ids():
    ds = DAPOPromptDataset([Row("ab", "1")], TOK, max_prompt_len=8)
    with pytest.raises(ValueError, match="group ids"):
        collate([ds[0]], pad_id=0)
    assert collate([dict(ds[0], group_id=4)], pad_id=0)["group_ids"].tolist() == [4]


def test_prompt_set_matches_items():
    ds = _ds()
    ps = ds.prompt_set()
    assert len(ps) == len(ds) and ps.ground_truths == ["2", "5"] and ps.pad_id == TOK.eos_id
    ids, mask = ps.collate([0, 1])
    assert torch.equal(ids[1][mask[1].bool()], ds[1]["text"])
