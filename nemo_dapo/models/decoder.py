"""Small decoders from ``transformers`` (Llama / Qwen2 family): built from a config dict or loaded from a local
checkpoint directory. Never touches the network (``local_files_only=True``).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from nemo_dapo.core.settings import ConfigError

# The CPU default: 4 layers, hidden 64, 8 heads of 8 dims; ~0.27M parameters with the ~430-token task vocabulary.
# Measured on the arithmetic task (1 thread): batches of 32 for ~575 warm-up updates (~100 s) take it into the
# warm-up band; a 3-layer / 4-head model of the same width learnt the operand look-up of multi-step chains ~2x
# slower per second, and hidden 128 cost ~4x more per update.
TINY_CONFIG = dict(
    arch="llama",
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    max_position_embeddings=256,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)

_ARCHS = ("llama", "qwen2")


def _config_class(arch: str):
    from transformers import LlamaConfig, Qwen2Config

    if arch not in _ARCHS:
        raise ValueError(f"model arch {arch!r} is not supported here; use one of {_ARCHS}")
    return LlamaConfig if arch == "llama" else Qwen2Config


def build_model(config: Optional[dict] = None, *, vocab_size: int, pad_id: int = 0, bos_id: int = 1, eos_id: int = 2,
                seed: int = 0, attn_implementation: str = "sdpa"):
    """A randomly initialised causal LM (fp32, train mode) from ``config`` (keys of the HF config plus ``arch``).

    ``config=None`` uses :data:`TINY_CONFIG`. The special-token ids come from the tokenizer. Initialisation is
    seeded (a private generator state, the global RNG is restored afterwards).
    """
    from transformers import AutoModelForCausalLM

    cfg = dict(TINY_CONFIG if config is None else config)
    arch = cfg.pop("arch", "llama")
    hf_config = _config_class(arch)(vocab_size=vocab_size, pad_token_id=pad_id, bos_token_id=bos_id,
                                    eos_token_id=eos_id, **cfg)
    hf_config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config, torch_dtype=torch.float32)
    return model.train()


def load_model(directory, attn_implementation: str = "sdpa"):
    """Load a causal LM saved with ``save_pretrained`` from a local directory (fp32, train mode)."""
    from transformers import AutoModelForCausalLM

    path = os.fspath(directory)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"no config.json in {path!r}: point at a directory written by save_model() / "
                                "save_pretrained() (models are never downloaded here)")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, torch_dtype=torch.float32,
                                                     attn_implementation=attn_implementation)
    except Exception as e:  # noqa: BLE001 - OSError, safetensors' own error, a shape mismatch: all a bad directory
        raise ConfigError(f"cannot load the model in {path!r} ({type(e).__name__}: {str(e).splitlines()[0][:300]}): "
                          "its weights are missing or damaged, or transformers does not know its architecture. Fix: "
                          "point at a complete save_pretrained directory (a run's base_model/ or final_model/)"
                          ) from None
    return model.train()


def save_model(model, directory) -> str:
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(os.fspath(directory), safe_serialization=True)
    return os.fspath(directory)


def num_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] positions counting real tokens only (left padding gets 0): the convention of sampler and policy."""
    return (mask.long().cumsum(-1) - 1).clamp_min(0)


def final_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Final (normed) hidden states [B, T, H] of a padded batch; the lm_head is NOT applied."""
    out = model.model(input_ids=input_ids, attention_mask=attention_mask.long(),
                      position_ids=position_ids_from_mask(attention_mask), use_cache=False)
    return out.last_hidden_state
