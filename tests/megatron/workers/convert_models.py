"""Tiny Hugging Face models of each converted family, with weights large enough that a wrong layout shows.

transformers' default init (std 0.02) makes near-uniform logits that hide layout errors; here every linear weight
is ~N(0, 1/fan_in), norms ~1 + N(0, 0.2^2), biases ~N(0, 0.2^2), embeddings ~N(0, 1): logits of order 1-10.
"""
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, Qwen2Config, Qwen2MoeConfig

VOCAB, PADDED_VOCAB = 250, 256  # padded: a multiple of 64 * tp for tp in (1, 2)
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, attention_dropout=0.0)


def configs() -> dict:
    """{family: HF config}; each exercises something: llama GQA + head_dim != hidden/heads + tied embeddings +
    4 layers (PP renumbering); qwen2 QKV bias + untied; mixtral top-2 of 4 experts (renormalised); qwen2_moe
    top-2 of 4 (not renormalised), QKV bias, a gated shared expert."""
    return {
        "llama": LlamaConfig(**SMALL, num_hidden_layers=4, head_dim=16, rms_norm_eps=1e-6, rope_theta=5e4,
                             tie_word_embeddings=True),
        "qwen2": Qwen2Config(**SMALL, num_hidden_layers=2, rms_norm_eps=1e-5, rope_theta=1e4,
                             tie_word_embeddings=False),
        "mixtral": MixtralConfig(**SMALL, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                                 rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False),
        "qwen2_moe": Qwen2MoeConfig(**SMALL, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                    norm_topk_prob=False, rms_norm_eps=1e-6, rope_theta=1e4,
                                    tie_word_embeddings=False),
    }


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        if name.endswith("norm.weight"):
            p.copy_(1 + 0.2 * noise)
        elif name.endswith("bias"):
            p.copy_(0.2 * noise)
        elif "embed_tokens" in name:
            p.copy_(noise)
        else:
            p.copy_(noise / p.shape[-1] ** 0.5)
    return model


def tiny_model(family: str, seed: int = 0):
    """The randomised HF model of ``family`` in eval mode (eager attention)."""
    cfg = configs()[family]
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", torch_dtype=torch.float32)
    return randomize_(model, seed).eval()


def tokens(batch: int = 2, seq: int = 12, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
