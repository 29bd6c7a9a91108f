"""The sequence budget is checked when the config is loaded, with the keys to change in the message."""
import pytest
from omegaconf import OmegaConf

from nemo_dapo.aligner.generation import check_generation_lengths


def _cfg(seq, gen, max_in=None):
    return OmegaConf.create({"encoder_seq_length": seq, "dapo": {"length_params": {"max_length": gen},
                                                                 "trt_llm": {"max_input_len": max_in}}})


def test_budget_that_fits_passes():
    check_generation_lengths(_cfg(22528, 20480, 2048))
    check_generation_lengths(_cfg(4096, 1024))  # max_input_len null: what is left


@pytest.mark.parametrize("seq,gen,max_in", [(20480, 20480, 2048), (4096, 4096, None), (100, 60, 41)])
def test_budget_that_does_not_fit_names_the_keys(seq, gen, max_in):
    with pytest.raises(ValueError) as e:
        check_generation_lengths(_cfg(seq, gen, max_in))
    msg = str(e.value)
    for key in ("model.dapo.trt_llm.max_input_len", "model.dapo.length_params.max_length", "model.encoder_seq_length"):
        assert key in msg


def test_missing_generation_cap_is_reported():
    with pytest.raises(ValueError, match="length_params.max_length"):
        check_generation_lengths(OmegaConf.create({"encoder_seq_length": 64, "dapo": {}}))


def test_missing_prompt_budget_key_names_the_key_and_the_yaml():
    cfg = OmegaConf.create({"encoder_seq_length": 64, "dapo": {"length_params": {"max_length": 8}, "trt_llm": {}}})
    with pytest.raises(ValueError, match=r"model\.dapo\.trt_llm\.max_input_len is missing.*gpt_dapo_actor\.yaml"):
        check_generation_lengths(cfg)
