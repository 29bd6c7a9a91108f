"""engines/base.read_checkpoint: what the vLLM and TensorRT-LLM adapters read of a Hugging Face directory."""
import json

import pytest
import torch
from safetensors.torch import save_file

from nemo_dapo.engines.base import HF_EMBED, HF_HEAD, EngineError, read_checkpoint


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
