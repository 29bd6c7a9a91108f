"""The two-process sampler gives what one in-process sampler gives on the whole batch (every row has its own stream),
with live weights."""
import pytest
import torch

from nemo_dapo.models.decoder import build_model
from nemo_dapo.local.run_parallel import ParallelSampler
from nemo_dapo.local.sampler import LocalSampler

CFG = dict(arch="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
           num_key_value_heads=2, max_position_embeddings=128)


def _prompts(n=5):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 40, (n, 6), generator=g)
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = 0, 0  # one left-padded row
    return ids, mask


@pytest.mark.slow  # starts a worker process
def test_blocks_match_the_single_process_sampler_and_follow_weight_updates():
    model = build_model(CFG, vocab_size=40, seed=1)
    ref = LocalSampler(model, eos_id=2, pad_id=0)
    par = ParallelSampler(model, eos_id=2, pad_id=0, processes=2)
    try:
        ids, mask = _prompts()
        for _ in range(2):  # second round: after an in-place weight change that the worker must see
            out = par.generate(ids, mask, max_new_tokens=7, seed=11)
            whole = ref.generate(ids, mask, max_new_tokens=7, seed=11)
            assert torch.equal(out.response_ids, whole.response_ids)
            assert torch.equal(out.response_mask, whole.response_mask)
            assert torch.allclose(out.logprobs, whole.logprobs)
            assert torch.equal(out.truncated, whole.truncated)
            # a block sampled alone with its first row's index is the same block of the whole batch
            b = ref.generate(ids[2:], mask[2:], max_new_tokens=7, seed=11, first_row=2)
            w = b.response_ids.shape[1]
            assert torch.equal(whole.response_ids[2:, :w], b.response_ids)
            shifted = ref.generate(ids[2:], mask[2:], max_new_tokens=7, seed=11)  # must be able to fail
            assert not torch.equal(shifted.response_ids, b.response_ids)
            with torch.no_grad():
                model.lm_head.weight.mul_(3.0)  # as an optimizer step would: in place
    finally:
        par.close()
    assert par.processes == 1


def test_zero_processes_is_refused_before_any_worker_starts():
    with pytest.raises(ValueError, match="processes must be >= 1, got 0"):
        ParallelSampler(build_model(CFG, vocab_size=40, seed=1), eos_id=2, pad_id=0, processes=0)
