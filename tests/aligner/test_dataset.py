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


@pytest.mark.parametrize("kw, match", [({"max_prompt_len": 0}, "max_prompt_len must be >= 1"),
                                       ({"prompt_template": "Q: {question}"}, r"must contain '\{prompt\}'")])
def test_settings_that_would_silently_drop_every_prompt_or_the_prompt_text_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        DAPOPromptDataset([Row("1+1=", "2")], TOK, **{"max_prompt_len": 10, **kw})


def test_a_prompt_of_exactly_max_prompt_len_tokens_is_kept():
    ds = DAPOPromptDataset([Row("abcd", "1"), Row("abcde", "2")], TOK, max_prompt_len=4)
    assert len(ds) == 1 and ds.num_dropped == 1 and ds[0]["length"] == 4


def test_an_empty_prompt_and_a_data_set_left_empty_are_errors():
    with pytest.raises(ValueError, match="row 1: the prompt tokenises to nothing"):
        DAPOPromptDataset([Row("a", "1"), Row("", "2")], TOK, max_prompt_len=4)
    with pytest.raises(ValueError, match=r"empty \(2 prompts were longer than max_prompt_len=3\)"):
        DAPOPromptDataset([Row("abcd", "1"), Row("abcde", "2")], TOK, max_prompt_len=3)


def test_collate_refuses_a_group_id_count_that_does_not_match_the_items():
    ds = DAPOPromptDataset([Row("ab", "1")], TOK, max_prompt_len=8)
    with pytest.raises(ValueError, match="2 items but 3 group_ids"):
        collate([ds[0], ds[0]], pad_id=0, group_ids=[1, 2, 3])


def test_an_explicit_pad_id_is_the_prompt_sets():
    ds = DAPOPromptDataset([Row("ab", "1")], TOK, max_prompt_len=8, pad_id=0)
    assert ds.pad_id == 0 and ds.prompt_set().pad_id == 0


def test_a_chat_template_flag_needs_a_template_not_just_the_method():
    class NoTemplate(_ChatTokenizer):
        class _HF(_ChatTokenizer._HF):
            chat_template = None  # HF tokenizers have apply_chat_template even when they ship no template

        tokenizer = _HF()

    with pytest.raises(ValueError, match="has no chat template"):
        DAPOPromptDataset([Row("2+3=", "5", "c")], NoTemplate(), max_prompt_len=200, chat_template=True)


def test_deduplication_also_spans_files(tmp_path):
    from nemo_dapo.aligner.dataset import build_prompt_dataset

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    first, second = _aime_like(a, problems=3, copies=1), _aime_like(b, problems=3, copies=1)  # the same 3 problems
    cfg = _data_cfg(first)
    cfg.data_prefix.validation = [first, second]
    assert len(build_prompt_dataset(cfg, "validation", TOK)) == 3
    cfg.validation_deduplicate = False
    assert len(build_prompt_dataset(cfg, "validation", TOK)) == 6


def test_each_split_reads_its_own_format_and_deduplicate_keys(tmp_path):
    import json

    from nemo_dapo.aligner.dataset import build_prompt_dataset

    verl = _aime_like(tmp_path, problems=2, copies=3)
    plain = tmp_path / "aime2025.jsonl"  # the AIME-2025 schema, which the validation split's reader does not take
    plain.write_text("".join(json.dumps({"problem": f"plain problem {i}", "answer": str(i)}) + "\n" for i in range(4)))
    cfg = _data_cfg(verl, deduplicate=False, train_format="aime2025")
    cfg.data_prefix.train = [str(plain)]
    train = build_prompt_dataset(cfg, "train", TOK)
    assert [train[i]["answer"] for i in range(len(train))] == ["0", "1", "2", "3"]
    cfg = _data_cfg(verl, deduplicate=False)  # train: verl, copies kept; validation: aime2024, de-duplicated
    assert len(build_prompt_dataset(cfg, "train", TOK)) == 6 and len(build_prompt_dataset(cfg, "validation", TOK)) == 2
