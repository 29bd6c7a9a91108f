import pytest
import torch

from nemo_dapo.data.task import ArithmeticTask
from nemo_dapo.data.template import TEMPLATE_PREFIX, TEMPLATE_SUFFIX, apply_template
from nemo_dapo.data.tokenizer import (BOS, EOS, PAD, build_task_tokenizer, encode_prompts, load_tokenizer, token_ids,
                                      save_tokenizer, train_tokenizer)


@pytest.fixture(scope="module")
def tok():
    return build_task_tokenizer(ArithmeticTask(), n_rows=500)


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("text", [
    "Answer: 14",
    "12+7=19\n19-5=14\nAnswer: 14",
    apply_template("12+7-5"),
    apply_template("Find $x$ if $x^2 = 49$ and x > 0."),  # words never seen in training still round-trip
    "  leading spaces,\ttabs and unicode: é ∑ 数学\n",
])
def test_decode_reproduces_the_text_exactly(tok, text):
    assert tok.decode(ids(tok, text)) == text


def test_digits_are_single_tokens(tok):
    pieces = tok.convert_ids_to_tokens(ids(tok, "1234+56=1290"))
    digits = [p for p in pieces if any(c.isdigit() for c in p)]
    assert digits == list("1234561290")


def test_the_template_compresses_into_a_few_tokens(tok):
    assert len(ids(tok, TEMPLATE_PREFIX)) <= 3 and len(ids(tok, TEMPLATE_SUFFIX)) <= 3
    assert len(ids(tok, apply_template("12+7-5"))) <= 6 + 6


def test_special_tokens_and_left_padding(tok):
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == (PAD, BOS, EOS)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.decode([tok.eos_token_id] + ids(tok, "Answer: 3"), skip_special_tokens=True) == "Answer: 3"
    prompt_ids, mask = encode_prompts(tok, ["1+2", "12+7-5"])
    assert prompt_ids.shape == mask.shape and bool(mask[:, -1].all())
    short = ids(tok, "1+2")
    assert prompt_ids[0, -len(short):].tolist() == short
    assert prompt_ids[0, -len(short) - 1].item() == tok.bos_token_id
    assert torch.equal(prompt_ids[0][mask[0] == 0], torch.zeros(int((mask[0] == 0).sum()), dtype=torch.long))


def test_training_is_deterministic(tok):
    again = build_task_tokenizer(ArithmeticTask(), n_rows=500)
    assert again.get_vocab() == tok.get_vocab()


def test_save_and_load_round_trip(tok, tmp_path):
    save_tokenizer(tok, tmp_path / "tok")
    loaded = load_tokenizer(tmp_path / "tok")
    text = apply_template("3+4") + "3+4=7\nAnswer: 7"
    assert ids(loaded, text) == ids(tok, text)
    assert loaded.padding_side == "left" and loaded.eos_token_id == tok.eos_token_id


def test_load_from_a_directory_without_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


def test_too_small_vocab_is_rejected():
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["1+1=2"], vocab_size=100)


def test_encode_prompts_rejects_a_single_string(tok):
    with pytest.raises(TypeError, match="list"):
        encode_prompts(tok, "1+2")


def test_token_ids_in_one_call_equal_one_text_at_a_time(tok):
    texts = ["1+2", "12+7-5", "", "Question: 3*4?\nAnswer: 12", "99-100"]
    assert token_ids(tok, texts) == [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert token_ids(tok, iter(texts[:2])) == token_ids(tok, texts[:2]) and token_ids(tok, []) == []


def test_the_vocabulary_must_leave_room_for_one_merge():
    from nemo_dapo.data.tokenizer import train_tokenizer

    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["1+1=2"] * 4, vocab_size=256 + 3)
    train_tokenizer(["1+1=2"] * 4, vocab_size=256 + 3 + 1)  # the documented minimum, 260, is accepted
