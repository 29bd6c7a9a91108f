"""Tiny Qwen3 / Qwen3-MoE configs (plain dicts: config.json contents), shared by the transformers-5 reference worker
and the megatron-core workers. Each exercises something: QK-norm; GQA (4 query heads, 2 groups); head_dim 16 !=
hidden / heads = 8; rope base 1e6; 4 dense layers (PP renumbering); MoE: 4 experts, top-2, norm_topk_prob true
(renormalised top-k), every layer sparse. The vocabulary covers the tiny test tokenizer (tests/support/nemo_cpu.py,
~300 tokens) so NeMo can run the same model.
"""
VOCAB, PADDED_VOCAB = 320, 384  # padded: a multiple of 128 (NeMo's make_vocab_size_divisible_by) and of 64 * 2
BATCH, SEQ, TOKEN_SEED = 2, 12, 5

_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1e6, attention_bias=False,
               attention_dropout=0.0, hidden_act="silu", tie_word_embeddings=False, initializer_range=0.02)

CONFIGS = {
    "qwen3": dict(_COMMON, model_type="qwen3", architectures=["Qwen3ForCausalLM"], num_hidden_layers=4,
                  intermediate_size=48),
    "qwen3_moe": dict(_COMMON, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_hidden_layers=2,
                      intermediate_size=48, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.0,
                      output_router_logits=False),
}


def tokens():
    import torch

    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(TOKEN_SEED))
