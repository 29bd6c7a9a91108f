import pytest
import torch

from nemo_dapo.models.decoder import build_model, final_hidden, load_model, num_parameters, save_model
from tests.local.tiny_models import TINY, VOCAB, left_padded, tiny_model


@pytest.mark.parametrize("arch, cls", [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM")])
def test_build_from_config(arch, cls):
    model = tiny_model(arch)
    assert type(model).__name__ == cls and model.training
    assert model.config.vocab_size == VOCAB and model.config.eos_token_id == 2
    assert num_parameters(model) == sum(p.numel() for p in model.parameters()) > 0


def test_build_is_seeded_and_leaves_the_global_rng_alone():
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    a, b, c = tiny_model(seed=3), tiny_model(seed=3), tiny_model(seed=4)
    after = torch.rand(1)
    assert torch.equal(before, after)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_save_and_load_round_trip(arch, tmp_path):
    model = tiny_model(arch)
    save_model(model, tmp_path / "m")
    loaded = load_model(tmp_path / "m")
    ids, mask = left_padded([3, 5])
    with torch.no_grad():
        torch.testing.assert_close(final_hidden(loaded, ids, mask), final_hidden(model, ids, mask), atol=0, rtol=0)


def test_load_from_a_directory_without_a_model(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_unknown_arch():
    with pytest.raises(ValueError, match="llama"):
        build_model(dict(TINY, arch="gpt2"), vocab_size=VOCAB)
