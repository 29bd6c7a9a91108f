"""Tiny models and batches shared by the local-backend tests (random weights: fast, no training)."""
import torch

from nemo_dapo.core.types import RolloutBatch
from nemo_dapo.models.decoder import build_model

VOCAB, PAD, BOS, EOS = 40, 0, 1, 2
TINY = dict(arch="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)


def tiny_model(arch="llama", seed=0, **kw):
    cfg = dict(TINY, arch=arch, **kw)
    return build_model(cfg, vocab_size=VOCAB, pad_id=PAD, bos_id=BOS, eos_id=EOS, seed=seed)


def left_padded(lengths, seed=0):
    """Random prompts (BOS first, no special tokens after it), LEFT-padded: (ids [B, P], mask [B, P])."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(3, VOCAB, (n,), generator=g)
        ids[i, width - n] = BOS
        mask[i, width - n:] = 1
    return ids, mask


def random_batch(prompt_lengths=(3, 5, 4, 6), response_lengths=(4, 1, 6, 3), seed=0) -> RolloutBatch:
    """A RolloutBatch with random tokens: left-padded prompts, right-padded responses."""
    g = torch.Generator().manual_seed(seed + 1)
    prompt_ids, prompt_mask = left_padded(prompt_lengths, seed)
    B, R = len(response_lengths), max(response_lengths)
    response_ids = torch.full((B, R), PAD, dtype=torch.long)
    response_mask = torch.zeros(B, R)
    for i, n in enumerate(response_lengths):
        response_ids[i, :n] = torch.randint(3, VOCAB, (n,), generator=g)
        response_mask[i, :n] = 1.0
    return RolloutBatch(prompt_ids, prompt_mask, response_ids, response_mask, group_ids=torch.arange(B),
                        truncated=torch.zeros(B, dtype=torch.bool), pad_id=PAD)
