"""Tiny random Hugging Face checkpoints and their transformers log-probs, run under the vLLM venv's interpreter
(transformers 5.x: the main venv's 4.47 has no Qwen3). Imports torch, transformers and safetensors only.

    python tests/support/hf_tiny.py make OUT_DIR FAMILY[,FAMILY...] SEED [SEED ...]   -> OUT_DIR/{FAMILY}-{SEED}/
    python tests/support/hf_tiny.py logprobs JOBS_JSON OUT_JSON

``make``: for each seed a checkpoint (config.json + model.safetensors) of :data:`CONFIGS`'s FAMILY, its tensors drawn
again under their checkpoint names (linear weights ~N(0, 1/fan_in), norms ~1 + N(0, 0.2^2), biases ~N(0, 0.2^2),
untied embeddings ~N(0, 1): logits of order 1-10, so a misplaced tensor shows; transformers' std 0.02 would hide it).
Sizes: head_dim 32 (the smallest vLLM's CPU attention takes), 4 query heads in 2 key/value groups (TP=2 splits whole
groups), vocabulary 250 (megatron pads it to 256).

``logprobs``: JOBS_JSON is ``[{"model": DIR, "rows": [[prompt ids, response ids], ...]}, ...]``; OUT_JSON gets, per
job, each row's fp32 log-probs of its response tokens (log_softmax of the eager-attention logits).
"""
import json
import os
import sys

import torch

COMMON = dict(vocab_size=250, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              num_hidden_layers=2, attention_dropout=0.0)
CONFIGS = {
    # head_dim = hidden / heads (Qwen2 and Mixtral derive it)
    "qwen2": dict(COMMON, model_type="qwen2", hidden_size=128, intermediate_size=96, rms_norm_eps=1e-5,
                  rope_theta=1e4, tie_word_embeddings=False),
    "mixtral": dict(COMMON, model_type="mixtral", hidden_size=128, intermediate_size=64, num_local_experts=4,
                    num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False),
    # head_dim 32 != hidden / heads = 16; tied embeddings, as the small Qwen3 models have
    "qwen3": dict(COMMON, model_type="qwen3", hidden_size=64, head_dim=32, intermediate_size=96, rms_norm_eps=1e-6,
                  rope_theta=1e6, tie_word_embeddings=True),
    # moe_intermediate_size: a multiple of 32, the alignment vLLM 0.32's CPU MoE kernel pads to; its layerwise
    # weight reload fails on a padded expert (copies the unpadded tensor into the padded kernel storage)
    "qwen3_moe": dict(COMMON, model_type="qwen3_moe", hidden_size=64, head_dim=32, intermediate_size=96,
                      moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6, rope_theta=1e6,
                      tie_word_embeddings=False),
}


def randomized(state: dict, seed: int, tied: bool) -> dict:
    """``state``'s tensors drawn again (module doc); a tied embedding, being the output layer too, gets
    N(0, 1/hidden) like a linear weight (N(0, 1) would make logits of order 50: every sampled log-prob ~0)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(state):
        t = state[name]
        noise = torch.randn(t.shape, generator=g, dtype=torch.float32)
        if name.endswith("norm.weight"):
            out[name] = 1 + 0.2 * noise
        elif name.endswith("bias"):
            out[name] = 0.2 * noise
        elif "embed_tokens" in name and not tied:
            out[name] = noise
        else:
            out[name] = noise / t.shape[-1] ** 0.5
    return out


def make(out_dir: str, family: str, seeds) -> list:
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(CONFIGS[family])
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    made = []
    for seed in seeds:
        path = os.path.join(out_dir, f"{family}-{seed}")
        model.save_pretrained(path)  # the checkpoint layout (per-expert names), whatever the in-memory one
        file = os.path.join(path, "model.safetensors")
        state = randomized(load_file(file), int(seed), bool(cfg.tie_word_embeddings))
        save_file(state, file, metadata={"format": "pt"})
        made.append(path)
    return made


@torch.no_grad()
def logprobs(jobs_file: str, out_file: str) -> None:
    from transformers import AutoModelForCausalLM

    with open(jobs_file) as f:
        jobs = json.load(f)
    out = []
    for job in jobs:
        model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32,
                                                     attn_implementation="eager").eval()
        rows = []
        for prompt, response in job["rows"]:
            ids = torch.tensor([list(prompt) + list(response)])
            lp = model(ids).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
            rows.append(lp.gather(1, torch.tensor(response)[:, None])[:, 0].tolist())
        out.append(rows)
    with open(out_file, "w") as f:
        json.dump(out, f)


def main(argv) -> int:
    torch.set_num_threads(1)
    if argv[:1] == ["make"] and len(argv) >= 4:
        print(json.dumps([path for family in argv[2].split(",") for path in make(argv[1], family, argv[3:])]))
    elif argv[:1] == ["logprobs"] and len(argv) == 3:
        logprobs(argv[1], argv[2])
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
