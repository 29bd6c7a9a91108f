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


# ---- chat template ------------------------------------------------------------------------------------------------
class _ChatTokenizer(CharTokenizer):
    """A NeMo-style tokenizer wrapping an HF-like one with a chat template (the Qwen2.5 ChatML layout)."""

    class _HF:
        chat_template = "chatml"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            assert not tokenize and add_generation_prompt
            turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
            return turns + "<|im_start|>assistant\n"

    tokenizer = _HF()


def test_chat_template_renders_one_user_turn_and_opens_the_assistant_turn():
    tok = _ChatTokenizer()
    raw = DAPOPromptDataset([Row("2+3=", "5", "c")], tok, max_prompt_len=200)
    chat = DAPOPromptDataset([Row("2+3=", "5", "c")], tok, max_prompt_len=200, chat_template=True)
    assert raw[0]["text"].tolist() == tok.text_to_ids("2+3=")
    assert chat[0]["text"].tolist() == tok.text_to_ids("<|im_start|>user\n2+3=<|im_end|>\n<|im_start|>assistant\n")


def test_chat_template_without_one_in_the_tokenizer_names_the_key():
    with pytest.raises(ValueError, match="model.data.chat_template"):
        DAPOPromptDataset([Row("2+3=", "5", "c")], TOK, max_prompt_len=200, chat_template=True)


# ---- the splits from model.data -----------------------------------------------------------------------------------
def _aime_like(tmp_path, problems=3, copies=4):
    import json

    from nemo_dapo.data.template import apply_template

    path = tmp_path / "aime.jsonl"
    with open(path, "w") as f:
        for c in range(copies):
            for p in range(problems):
                f.write(json.dumps({"data_source": "math_dapo", "ability": "MATH",
                                    "prompt": [{"role": "user", "content": apply_template(f"problem {p}")}],
                                    "reward_model": {"ground_truth": str(p), "style": "rule"},
                                    "extra_info": {"index": c * problems + p}}) + "\n")
    return str(path)


def _data_cfg(path, **over):
    from omegaconf import OmegaConf

    base = OmegaConf.load("conf/gpt_dapo_actor.yaml").model.data
    cfg = OmegaConf.merge(OmegaConf.create({k: base[k] for k in base if k != "max_prompt_tokens"}),
                          {"data_prefix": {"train": [path], "validation": [path]}, "max_prompt_tokens": 4096,
                           "train_format": "verl", "validation_format": "aime2024", "chat_template": False}, over)
    return cfg


def test_validation_is_problems_times_n_samples(tmp_path):
    """avg@n over AIME-2024's problems, not its copies: 3 problems x 4 copies, n_samples=4 -> 12 generations."""
    from omegaconf import OmegaConf

    from nemo_dapo.aligner.dataset import build_prompt_dataset
    from nemo_dapo.core.loop_eval import evaluate
    from nemo_dapo.core.types import Generation

    base = OmegaConf.load("conf/gpt_dapo_actor.yaml")
    assert base.model.data.validation_deduplicate is True and base.trainer.dapo.val.n_samples == 32
    assert base.model.data.chat_template is True  # the reference's choice for Qwen2.5-32B base
    path = _aime_like(tmp_path)
    val = build_prompt_dataset(_data_cfg(path), "validation", TOK)
    assert len(val) == 3
    assert len(build_prompt_dataset(_data_cfg(path, validation_deduplicate=False), "validation", TOK)) == 12

    class CountingGenerator:
        rows = 0

        def generate(self, ids, mask, *, max_new_tokens, temperature, top_p, seed):
            CountingGenerator.rows += ids.shape[0]
            b = ids.shape[0]
            return Generation(response_ids=torch.full((b, 1), 7), response_mask=torch.ones(b, 1),
                              truncated=torch.zeros(b, dtype=torch.bool), logprobs=torch.zeros(b, 1))

    res = evaluate(CountingGenerator(), lambda ids, m, gts: (torch.ones(len(gts)), torch.ones(len(gts)),
                                                               [""] * len(gts)),
                   val.prompt_set(), n_samples=4, max_new_tokens=1, temperature=1.0, top_p=1.0, seed=0,
                   batch_size=8)
    assert CountingGenerator.rows == 12 and tuple(res.acc.shape) == (3, 4)


def test_build_prompt_dataset_applies_the_chat_template_choice(tmp_path):
    from nemo_dapo.aligner.dataset import build_prompt_dataset

    path = _aime_like(tmp_path, problems=2, copies=1)
    tok = _ChatTokenizer()
    raw = build_prompt_dataset(_data_cfg(path), "train", tok)
    chat = build_prompt_dataset(_data_cfg(path, chat_template=True), "train", tok)
    assert len(raw) == len(chat) == 2
    text = "".join(chr(i) for i in chat[0]["text"].tolist())
    assert text.startswith("<|im_start|>user\nSolve the following") and text.endswith("<|im_start|>assistant\n")
    assert "".join(chr(i) for i in raw[0]["text"].tolist()).startswith("Solve the following")
