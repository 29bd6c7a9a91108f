"""Device checks of the local backend (nemo_dapo.local) with the policy's model on CUDA.

Run on a GPU machine (skipped elsewhere by tests/conftest.py):

    python -m pytest tests/gpu/test_local_cuda.py -q -s

``LocalPolicy`` and ``LocalSampler`` take no device argument: they run on whatever device the module and the
batch tensors are on. What is checked:
  * ``LocalPolicy`` with the model and the batch on CUDA: log-probs equal the full-logits reference and the same
    policy on the CPU; gradients equal the CPU ones; one update runs and changes the weights;
  * ``LocalSampler`` on a CUDA model and CUDA prompts (decoding, K/V cache and seeded draws on the device): it runs,
    and its log-probs of the sampled tokens equal the trainer's (``LocalPolicy`` on CUDA) at temperature 1;
  * the combination that works without device support in the sampler: sampling on a CPU copy, training on CUDA,
    refit through ``update_weights``; its CPU sampling speed at 64 prompts x 16 new tokens (lines ``RESULT``).
"""
import copy
import time

import pytest
import torch

from nemo_dapo.core.advantages import group_advantages
from nemo_dapo.core.loss import make_loss_fn
from nemo_dapo.core.types import RolloutBatch
from nemo_dapo.models.decoder import build_model
from nemo_dapo.local.policy import LocalPolicy
from tests.support.reference import reference_logprobs
from nemo_dapo.local.sampler import LocalSampler

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")
VOCAB, PAD, BOS, EOS = 96, 0, 1, 2
BATCH, NEW_TOKENS, PROMPT_LEN, GROUP = 64, 16, 8, 8
LOSS_FN = make_loss_fn(eps_low=0.2, eps_high=0.28)


def sync():
    torch.cuda.synchronize()


def tiny_model():
    """The local backend's default tiny Llama (fp32), seeded."""
    return build_model(None, vocab_size=VOCAB, pad_id=PAD, bos_id=BOS, eos_id=EOS, seed=0)


def prompts(seed=0):
    """[BATCH, PROMPT_LEN] left-padded prompts (BOS + 1..7 tokens), GROUP consecutive rows per prompt."""
    g = torch.Generator().manual_seed(seed)
    n = BATCH // GROUP
    lengths = torch.randint(2, PROMPT_LEN + 1, (n,), generator=g).repeat_interleave(GROUP)
    body = torch.randint(3, VOCAB, (n, PROMPT_LEN), generator=g).repeat_interleave(GROUP, 0)
    mask = (torch.arange(PROMPT_LEN)[None] >= (PROMPT_LEN - lengths)[:, None]).long()
    ids = torch.where(mask.bool(), body, torch.full_like(body, PAD))
    first = PROMPT_LEN - lengths
    ids[torch.arange(BATCH), first] = BOS
    return ids, mask, torch.arange(BATCH) // GROUP


def to(batch, device):
    out = copy.copy(batch)
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "group_ids", "truncated",
                 "engine_logp", "old_logp", "rewards", "advantages"):
        v = getattr(batch, name)
        if v is not None:
            setattr(out, name, v.to(device))
    return out


def random_batch(seed=1):
    """Prompts plus random responses of random lengths (0..NEW_TOKENS), advantages per group."""
    ids, mask, groups = prompts(seed)
    g = torch.Generator().manual_seed(seed)
    rlen = torch.randint(0, NEW_TOKENS + 1, (BATCH,), generator=g)
    rmask = (torch.arange(NEW_TOKENS)[None] < rlen[:, None]).float()
    resp = torch.randint(3, VOCAB, (BATCH, NEW_TOKENS), generator=g) * rmask.long()
    return RolloutBatch(prompt_ids=ids, prompt_mask=mask, response_ids=resp, response_mask=rmask, group_ids=groups,
                        truncated=rlen == NEW_TOKENS, advantages=torch.randn(BATCH, generator=g), pad_id=PAD)


def grads_of(policy, batch, n):
    policy.optimizer.zero_grad(set_to_none=True)
    _, finite = policy.accumulate_gradients(batch, n, LOSS_FN)
    assert finite
    return {k: p.grad.detach().cpu().clone() for k, p in policy.model.named_parameters() if p.grad is not None}


def test_policy_on_cuda_matches_reference_and_cpu():
    cpu_model = tiny_model()
    gpu_model = copy.deepcopy(cpu_model).to(DEVICE)
    cpu_pol = LocalPolicy(cpu_model, lr=1e-3, micro_batch_size=16)
    gpu_pol = LocalPolicy(gpu_model, lr=1e-3, micro_batch_size=16)
    batch = random_batch()
    gpu_batch = to(batch, DEVICE)
    got_lp, got_ent = gpu_pol.logprobs(gpu_batch)
    want_lp, want_ent = reference_logprobs(gpu_model.eval(), gpu_batch)
    cpu_lp, cpu_ent = cpu_pol.logprobs(batch)
    print(f"RESULT local_policy_cuda logprobs_device={got_lp.device} "
          f"max_err_vs_reference={(got_lp - want_lp.cpu()).abs().max().item():.3g} "
          f"max_err_vs_cpu={(got_lp - cpu_lp).abs().max().item():.3g}")
    torch.testing.assert_close(got_lp.cpu(), want_lp.cpu(), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got_ent.cpu(), want_ent.cpu(), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got_lp.cpu(), cpu_lp, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got_ent.cpu(), cpu_ent, atol=1e-4, rtol=1e-5)
    # gradients of the DAPO loss: CUDA == CPU
    batch.old_logp = cpu_lp + 0.1 * torch.randn(cpu_lp.shape, generator=torch.Generator().manual_seed(3))
    batch.old_logp = batch.old_logp * batch.response_mask
    gpu_batch = to(batch, DEVICE)
    n = float(LOSS_FN.normalizer(batch))
    g_cpu, g_gpu = grads_of(cpu_pol, batch, n), grads_of(gpu_pol, gpu_batch, n)
    scale = max(g.abs().max().item() for g in g_cpu.values())
    err = max((g_gpu[k] - g_cpu[k]).abs().max().item() for k in g_cpu) / scale
    print(f"RESULT local_policy_cuda grad_rel_err_vs_cpu={err:.3g} params={len(g_cpu)}")
    assert sorted(g_gpu) == sorted(g_cpu) and err < 1e-4
    before = {k: p.detach().clone() for k, p in gpu_model.named_parameters()}
    metrics = gpu_pol.train_step(gpu_batch, norm=n, loss_fn=LOSS_FN)
    assert metrics["skipped"] == 0.0 and torch.isfinite(torch.tensor(metrics["grad_norm"]))
    assert any(not torch.equal(before[k], p) for k, p in gpu_model.named_parameters())


def test_sampler_on_a_cuda_model():
    model = tiny_model().to(DEVICE)
    sampler = LocalSampler(model, eos_id=EOS, pad_id=PAD)
    ids, mask, groups = prompts()
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    sync()
    t0 = time.perf_counter()
    gen = sampler.generate(ids, mask, max_new_tokens=NEW_TOKENS, temperature=1.0, seed=0)
    sync()
    seconds = time.perf_counter() - t0
    tokens = int(gen.response_mask.sum())
    print(f"RESULT local_sampler_cuda supported=True batch={BATCH} new_tokens={NEW_TOKENS} "
          f"tokens_per_s={tokens / seconds:.0f}")
    assert gen.response_ids.shape[0] == BATCH and tokens > 0 and bool((gen.logprobs <= 0).all())
    assert gen.response_ids.device.type == "cuda" and gen.logprobs.device.type == "cuda"
    again = sampler.generate(ids, mask, max_new_tokens=NEW_TOKENS, temperature=1.0, seed=0)
    assert torch.equal(again.response_ids, gen.response_ids)  # the seed fixes the (CUDA generator's) draws
    batch = RolloutBatch(prompt_ids=ids, prompt_mask=mask, response_ids=gen.response_ids,
                         response_mask=gen.response_mask, group_ids=groups.to(DEVICE), truncated=gen.truncated,
                         engine_logp=gen.logprobs, pad_id=PAD)
    want, _ = LocalPolicy(model, lr=1e-3, micro_batch_size=16).logprobs(batch)  # on the CPU, as the loop keeps them
    gap = ((want - gen.logprobs.cpu()) * gen.response_mask.cpu()).abs().max().item()
    print(f"RESULT local_sampler_cuda_vs_trainer_logp max_gap={gap:.3g}")
    assert gap < 1e-4


def sample_batch(sampler, seed):
    ids, mask, groups = prompts(seed)
    t0 = time.perf_counter()
    gen = sampler.generate(ids, mask, max_new_tokens=NEW_TOKENS, temperature=1.0, seed=seed)
    seconds = time.perf_counter() - t0
    batch = RolloutBatch(prompt_ids=ids, prompt_mask=mask, response_ids=gen.response_ids,
                         response_mask=gen.response_mask, group_ids=groups, truncated=gen.truncated,
                         engine_logp=gen.logprobs, pad_id=PAD)
    return batch, int(gen.response_mask.sum()), seconds


def test_cpu_sampling_with_cuda_training_and_refit():
    policy_model = tiny_model().to(DEVICE)
    policy = LocalPolicy(policy_model, lr=1e-2, micro_batch_size=32)
    sampler = LocalSampler(copy.deepcopy(policy_model).cpu(), eos_id=EOS, pad_id=PAD)
    sampler.update_weights(policy)  # CUDA -> CPU refit
    tokens = seconds = 0.0
    batches = []
    for seed in range(3):
        batch, n_tok, secs = sample_batch(sampler, seed)
        tokens, seconds = tokens + n_tok, seconds + secs
        batches.append(batch)
    print(f"RESULT local_sampler_cpu batch={BATCH} new_tokens={NEW_TOKENS} batches=3 "
          f"tokens_per_s={tokens / seconds:.0f} torch_threads={torch.get_num_threads()}")
    batch = batches[-1]
    assert batch.response_ids.shape == (BATCH, NEW_TOKENS) and tokens > 0
    # the trainer (CUDA) and the sampler (CPU) agree on the sampled tokens' log-probs at temperature 1
    old_lp, _ = policy.logprobs(to(batch, DEVICE))
    gap = ((old_lp.cpu() - batch.engine_logp) * batch.response_mask).abs().max().item()
    print(f"RESULT local_engine_vs_trainer_logp max_gap={gap:.3g}")
    assert gap < 1e-4
    # one DAPO update on CUDA; reward: share of even tokens (anything the model can move)
    batch.old_logp = old_lp.cpu() * batch.response_mask
    even = ((batch.response_ids % 2 == 0).float() * batch.response_mask).sum(-1)
    batch.rewards = even / batch.response_mask.sum(-1).clamp(min=1)
    batch.advantages = group_advantages(batch.rewards, batch.group_ids)
    gpu_batch = to(batch, DEVICE)
    sync()
    t0 = time.perf_counter()
    metrics = policy.train_step(gpu_batch, norm=float(LOSS_FN.normalizer(gpu_batch)), loss_fn=LOSS_FN)
    sync()
    print(f"RESULT local_train_step_cuda seconds={time.perf_counter() - t0:.3f} loss={metrics['loss']:.4g} "
          f"grad_norm={metrics['grad_norm']:.4g} skipped={metrics['skipped']}")
    assert metrics["skipped"] == 0.0 and metrics["grad_norm"] > 0
    sampler.update_weights(policy)
    for (name, p), q in zip(policy_model.state_dict().items(), sampler.model.state_dict().values()):
        assert q.device.type == "cpu" and torch.equal(p.cpu(), q), name
    new_lp, _ = policy.logprobs(gpu_batch)
    assert ((new_lp.cpu() - batch.old_logp) * batch.response_mask).abs().max() > 0  # the update moved the policy
