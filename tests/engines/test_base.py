"""engines/base: what the vLLM and TensorRT-LLM adapters read of a Hugging Face directory (read_checkpoint), and the
checks every engine relies on: a request's fields at their bounds, a weight's dtype and its values."""
import json

import pytest
import torch
from safetensors.torch import save_file

from nemo_dapo.engines.base import (HF_EMBED, HF_HEAD, MAX_SAMPLES_PER_REQUEST, EngineError, EngineWeightError,
                                    Request, check_finite, check_weight, read_checkpoint)


def checkpoint(path, config: dict, names=(HF_EMBED, HF_HEAD)):
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({n: torch.zeros(3, 2) for n in names}, str(path / "model.safetensors"))
    return str(path)


@pytest.mark.parametrize("eos, want", [(2, [2]), ([5, 7], [5, 7]), (None, [])])
def test_eos_ids_are_a_list(tmp_path, eos, want):
    ckpt = read_checkpoint(checkpoint(tmp_path, {"eos_token_id": eos, "vocab_size": 3}), "vllm")
    assert ckpt.eos_ids == want and ckpt.config["vocab_size"] == 3
    assert ckpt.shapes == {HF_EMBED: (3, 2), HF_HEAD: (3, 2)}


@pytest.mark.parametrize("tie, names, tied", [
    (True, (HF_EMBED,), True),  # the head is the embedding: a trainer's lm_head.weight is that tensor
    (True, (HF_EMBED, HF_HEAD), False),  # a head stored of its own is loaded as such
    (False, (HF_EMBED,), False),
])
def test_tied_means_no_head_of_its_own(tmp_path, tie, names, tied):
    assert read_checkpoint(checkpoint(tmp_path, {"tie_word_embeddings": tie}, names), "trtllm").tied is tied


def test_a_directory_that_is_not_a_checkpoint_is_named(tmp_path):
    with pytest.raises(EngineError, match=r"engine 'vllm': no config.json in .* \(never downloads\)"):
        read_checkpoint(str(tmp_path), "vllm")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(EngineError, match=r"engine 'trtllm': no \*.safetensors in"):
        read_checkpoint(str(tmp_path), "trtllm")


@pytest.mark.parametrize("field, ok, refused, match", [
    ("id", "i" * 256, "i" * 257, "at most 256 characters"),
    ("n", MAX_SAMPLES_PER_REQUEST, MAX_SAMPLES_PER_REQUEST + 1, f"n <= {MAX_SAMPLES_PER_REQUEST}"),
    ("seed", 2 ** 63 - 1, 2 ** 63, r"seed must be an int in \[0, 2\*\*63\)"),
    ("top_p", 1.0, 0.0, "0 < top_p <= 1"),
])
def test_request_fields_are_checked_at_their_bounds(field, ok, refused, match):
    fields = {"id": "r", "prompt_ids": [1]}
    assert getattr(Request(**{**fields, field: ok}), field) == ok
    with pytest.raises(ValueError, match=match):
        Request(**{**fields, field: refused})


def test_a_request_with_a_field_this_version_does_not_know_is_refused():
    wire = Request(id="r", prompt_ids=[1]).to_wire()
    assert Request.from_wire(wire) == Request(id="r", prompt_ids=[1])
    with pytest.raises(ValueError, match=r"unknown fields \['beam_width'\]"):
        Request.from_wire({**wire, "beam_width": 4})


def test_a_weight_of_another_kind_of_dtype_is_refused_naming_it():
    target = torch.zeros(2, 3)
    check_weight("w", torch.zeros(2, 3, dtype=torch.float64), target, "toy")  # float into float: cast on load
    with pytest.raises(EngineWeightError, match="weight 'w' has dtype torch.int64, the engine's is torch.float32"):
        check_weight("w", torch.zeros(2, 3, dtype=torch.int64), target, "toy")


@pytest.mark.parametrize("where", [0, 3, 4, 9])
def test_a_nan_anywhere_is_found_also_at_a_chunks_last_element(where):
    t = torch.zeros(10)
    t[where] = float("nan")
    with pytest.raises(EngineWeightError, match="holds NaN or inf"):
        check_finite("w", t, "toy", chunk=4)  # chunks [0, 4), [4, 8), [8, 10): 3 is the first one's last
    check_finite("w", torch.zeros(10), "toy", chunk=4)
