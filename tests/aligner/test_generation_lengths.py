"""The sequence budget is checked when the config is loaded, with the keys to change in the message."""
import pytest
from omegaconf import OmegaConf

from nemo_dapo.aligner.generation import check_generation_lengths


def _cfg(seq, gen, max_in=None):
    trt = {} if max_in is None else {"max_input_len": max_in}
    return OmegaConf.create({"encoder_seq_length": seq, "dapo": {"length_params": {"max_length": gen},
                                                                 "trt_llm": trt}})


def test_budget_that_fits_passes():
    check_generation_lengths(_cfg(22528, 20480, 2048))
    check_generation_lengths(_cfg(4096, 1024))  # max_input_len defaults to what is left


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
