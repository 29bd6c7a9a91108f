"""Device checks of nemo_dapo.core on CUDA: the fused log-prob/entropy and the DAPO loss's split invariance.

Run on a GPU machine (skipped elsewhere by tests/conftest.py), from the repository root:

    python -m pytest tests/gpu/test_core_cuda.py -q -s

What is checked:
  * fused chunked log-prob + entropy (``core.logprobs``), fp32 and bf16, with and without the entropy gradient:
    values and gradients at least as close to an fp64 truth as the full-logits reference is (the CPU tests' rule);
  * ``_add_weight_grad``'s CUDA path (a bf16 GEMM with fp32 output, or its fp32 fallback): which one ran, and that
    the chunk's contribution is not rounded to bf16;
  * peak CUDA memory and time of fused vs reference at vocab 151,936, 4096 tokens, hidden 2048 (lines ``RESULT``);
  * ``core.loss`` on bf16 inputs: loss and gradient of 1 vs 4 micro-batches vs 2 simulated ranks are the same,
    and an all-masked micro-batch adds exactly 0.
"""
import gc
import time

import pytest
import torch

from nemo_dapo.core import logprobs as lp_mod
from nemo_dapo.core.logprobs import (fused_logprobs_entropy, linear_logprobs_entropy, logits_logprobs_entropy,
                                     reference_logprobs_entropy)
from nemo_dapo.core.loss import AGG_MODES, dapo_policy_loss, make_loss_fn
from nemo_dapo.core.types import RolloutBatch
from tests.core.test_loss import reduce_metrics, split_loss  # the CPU tests' obvious reference, reused on CUDA

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")
MEM_TOKENS, MEM_HIDDEN, MEM_VOCAB, MEM_CHUNK = 4096, 2048, 151936, 1024
GIB = 2 ** 30
CLIP = dict(eps_low=0.2, eps_high=0.28)


def sync():
    torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------------------------
# fused log-prob / entropy
# ---------------------------------------------------------------------------------------------------------------

def make_inputs(n, h, v, dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * scale).to(DEVICE, dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h ** 0.5).to(DEVICE, dtype).requires_grad_()
    target = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    a, b = (torch.randn(n, generator=g, dtype=torch.float64).to(DEVICE) for _ in range(2))
    return hidden, weight, target, a, b


def values_and_grads(fn, hidden, weight, target, a, b, use_entropy=True, **kw):
    logp, ent = fn(hidden, weight, target, **kw)
    loss = (logp.double() * a).sum() + ((ent.double() * b).sum() if use_entropy else 0.0)
    gh, gw = torch.autograd.grad(loss, (hidden, weight))
    return [logp.detach(), ent.detach(), gh, gw]


def assert_as_close_to_truth(got, ref, truth, rel_tol, slack, label):
    """Every output of the fused path is within 2x the reference's error (plus ``slack`` x scale) of the fp64 truth,
    and within ``rel_tol`` x scale absolutely."""
    for name, x, r, t in zip(("logp", "entropy", "grad_hidden", "grad_weight"), got, ref, truth):
        scale = t.abs().max().item()
        err, ref_err = (x.double() - t).abs().max().item(), (r.double() - t).abs().max().item()
        print(f"RESULT fused_vs_truth case={label} out={name} err={err:.3g} ref_err={ref_err:.3g} scale={scale:.3g}")
        assert err <= 2 * ref_err + slack * scale, f"{label} {name}: fused error {err:.3g} vs reference {ref_err:.3g}"
        assert err <= rel_tol * scale, f"{label} {name}: error {err:.3g} for values of size {scale:.3g}"


@pytest.mark.parametrize("use_entropy", [True, False], ids=["with_entropy_grad", "logp_only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_matches_fp64_truth(dtype, use_entropy):
    # 777 tokens in chunks of 128: six full chunks and a partial one; temperature 0.8 exercises the scaling
    inputs = make_inputs(777, 256, 50000, dtype, seed=1, scale=3.0)
    kw = dict(use_entropy=use_entropy, temperature=0.8)
    got = values_and_grads(linear_logprobs_entropy, *inputs, chunk_size=128, **kw)
    ref = values_and_grads(reference_logprobs_entropy, *inputs, **kw)
    h64, w64 = (t.detach().double().requires_grad_() for t in inputs[:2])
    truth = values_and_grads(reference_logprobs_entropy, h64, w64, *inputs[2:], **kw)
    assert got[0].dtype == torch.float32 and got[3].dtype == dtype
    rel_tol, slack = (1e-4, 1e-5) if dtype == torch.float32 else (5e-2, 1e-6)
    assert_as_close_to_truth(got, ref, truth, rel_tol, slack, f"{str(dtype)[6:]}_entropy={use_entropy}")


def _mm_out_dtype_supported(a, b) -> bool:
    try:
        torch.mm(a, b, out_dtype=torch.float32)
        return True
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def test_add_weight_grad_cuda_path_accumulates_in_fp32():
    """acc += grad.T @ h_c on CUDA with bf16 h_c: the result must carry fp32 precision, not a bf16-rounded GEMM."""
    g = torch.Generator().manual_seed(2)
    c, v, h = 256, 4096, 512
    acc0 = torch.randn(v, h, generator=g).to(DEVICE)
    grad = (torch.randn(c, v, generator=g) * 1e-2).to(DEVICE)
    h_c = torch.randn(c, h, generator=g).to(DEVICE, torch.bfloat16)
    fast = _mm_out_dtype_supported(grad.t().to(torch.bfloat16), h_c)
    acc = acc0.clone()
    lp_mod._add_weight_grad(acc, grad, h_c)
    # the fast path rounds the incoming gradient to bf16 before the GEMM (tensor cores), the fallback does not
    grad_used = grad.to(torch.bfloat16) if fast else grad
    want = acc0.double() + grad_used.double().t() @ h_c.double()
    contribution = (want - acc0.double()).abs().max().item()
    err = (acc.double() - want).abs().max().item()
    bf16_out = (acc0 + (grad.t().to(torch.bfloat16) @ h_c).float()).double()  # what a bf16-output GEMM would give
    bf16_err = (bf16_out - want).abs().max().item()
    print(f"RESULT add_weight_grad path={'mm_out_dtype_fp32' if fast else 'fp32_addmm_fallback'} "
          f"torch={torch.__version__} max_err={err:.3g} bf16_output_gemm_err={bf16_err:.3g} "
          f"contribution={contribution:.3g}")
    assert acc.dtype == torch.float32
    assert err <= 1e-5 * contribution + 1e-6, f"fp32 accumulation lost precision: {err:.3g}"
    assert err < bf16_err / 10, f"no better than a bf16-output GEMM ({err:.3g} vs {bf16_err:.3g})"


def test_logits_entry_and_masked_helper_on_cuda():
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(300, 5000, generator=g) * 4).to(DEVICE, torch.bfloat16).requires_grad_()
    target = torch.randint(0, 5000, (300,), generator=g).to(DEVICE)
    a = torch.randn(300, generator=g).to(DEVICE)
    logp, ent = logits_logprobs_entropy(logits, target, chunk_size=64, temperature=1.3)
    grad = torch.autograd.grad((logp * a + 0.1 * ent).sum(), logits)[0]
    z = logits.detach().double().requires_grad_()
    all_lp = torch.log_softmax(z / 1.3, -1)
    ref_lp, ref_ent = all_lp.gather(1, target[:, None]).squeeze(1), -(all_lp.exp() * all_lp).sum(-1)
    ref_grad = torch.autograd.grad((ref_lp * a.double() + 0.1 * ref_ent).sum(), z)[0]
    torch.testing.assert_close(logp.double(), ref_lp, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-4, rtol=1e-5)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad.double(), ref_grad, atol=2e-3 * ref_grad.abs().max().item(), rtol=1e-2)
    # [B, T] helper with a padding mask: padding positions get 0 and no gradient
    hidden, weight, targets, _, _ = make_inputs(4 * 33, 64, 1000, torch.bfloat16, seed=4)
    hidden3, targets2 = hidden.view(4, 33, 64), targets.view(4, 33)
    mask = (torch.arange(33, device=DEVICE)[None] < torch.tensor([33, 20, 1, 0], device=DEVICE)[:, None])
    lp_m, ent_m = fused_logprobs_entropy(hidden3, weight, targets2, mask=mask, chunk_size=16)
    ref_m, ref_ent_m = reference_logprobs_entropy(hidden3, weight, targets2)
    torch.testing.assert_close(lp_m, ref_m * mask, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(ent_m, ref_ent_m * mask, atol=2e-2, rtol=1e-2)
    gh = torch.autograd.grad(lp_m.sum(), hidden)[0].view(4, 33, 64)
    assert torch.count_nonzero(gh[~mask]) == 0 and torch.count_nonzero(gh[mask]) > 0


def _peak_and_time(fn, repeats=3):
    """(peak bytes allocated above the level before the call, median seconds) of ``fn`` (one fwd+bwd)."""
    sync()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()  # the gradients stay alive until the peak is read: both variants produce the same ones
    sync()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return peak, sorted(times)[len(times) // 2]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_peak_memory_fused_vs_reference(dtype):
    n, h, v, chunk = MEM_TOKENS, MEM_HIDDEN, MEM_VOCAB, MEM_CHUNK
    hidden, weight, target, a, b = make_inputs(n, h, v, dtype, seed=5)
    a, b = a.float(), b.float()

    def step(fused):
        def run():
            if fused:
                logp, ent = linear_logprobs_entropy(hidden, weight, target, chunk_size=chunk)
            else:
                logp, ent = reference_logprobs_entropy(hidden, weight, target)
            return torch.autograd.grad((logp * a).sum() + (ent * b).sum(), (hidden, weight))
        return run

    fused_peak, fused_s = _peak_and_time(step(True))
    ref_peak, ref_s = _peak_and_time(step(False))
    size = torch.finfo(dtype).bits // 8
    grads = (n * h + v * h) * size
    # docstring: ~3 x chunk x V x 4 bytes, + an fp32 [V, H] accumulator for bf16; here also allowed: one more fp32
    # [V, H] (the temporary of ``acc += mm(..., out_dtype=fp32)``) and the gradients themselves
    documented = 3 * chunk * v * 4 + (v * h * 4 if size < 4 else 0)
    bound = documented + v * h * 4 + grads + 256 * 2 ** 20
    ratio = fused_peak / max(ref_peak, 1)
    print(f"RESULT fused_logprobs_memory dtype={str(dtype)[6:]} tokens={n} hidden={h} vocab={v} chunk={chunk} "
          f"fused_peak_gib={fused_peak / GIB:.3f} reference_peak_gib={ref_peak / GIB:.3f} ratio={ratio:.3f} "
          f"working_ratio={(fused_peak - grads) / max(ref_peak - grads, 1):.3f} grads_gib={grads / GIB:.3f} "
          f"documented_extra_gib={documented / GIB:.3f} fused_ms={fused_s * 1e3:.1f} reference_ms={ref_s * 1e3:.1f} "
          f"time_ratio={fused_s / max(ref_s, 1e-9):.3f}")
    assert fused_peak < ref_peak, "the fused path used more memory than materialising the logits"
    assert fused_peak <= bound, f"fused peak {fused_peak / GIB:.3f} GiB above the bound {bound / GIB:.3f} GiB"


# ---------------------------------------------------------------------------------------------------------------
# DAPO loss: split invariance on CUDA with bf16 inputs
# ---------------------------------------------------------------------------------------------------------------

def random_batch(seed, b=8, t=48):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    lengths[0] = 0  # always one fully masked row
    mask = (torch.arange(t) < lengths[:, None]).float()
    old = -torch.rand(b, t, generator=g) * 3
    logp = old + torch.randn(b, t, generator=g) * 0.3  # ratios on both sides of the clips
    adv = torch.randn(b, generator=g)
    return (logp.to(DEVICE, torch.bfloat16), old.to(DEVICE, torch.bfloat16), adv.to(DEVICE), mask.to(DEVICE))


def rows(*idx):
    return torch.tensor(idx, dtype=torch.long, device=DEVICE)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_loss_split_invariance_bf16(agg):
    logp, old, adv, mask = random_batch(0)
    full_loss, full_grad, full_m = split_loss(logp, old, adv, mask, agg, [torch.arange(8, device=DEVICE)])
    assert full_loss.dtype == torch.float32 and full_grad.dtype == torch.bfloat16
    assert full_grad.device.type == DEVICE.type
    assert full_grad.abs().sum() > 0
    four_micro = [rows(0, 1), rows(2, 3), rows(4, 5), rows(6, 7)]
    # two simulated data-parallel ranks of two micro-batches each; summing their losses/gradients is what DDP's
    # sum (after the schedule scaling of megatron/reduction.py) does
    two_ranks = [rows(0, 5), rows(2), rows(7, 1, 3), rows(4, 6)]
    for label, parts in (("4_micro", four_micro), ("2_ranks", two_ranks)):
        loss, grad, m = split_loss(logp, old, adv, mask, agg, parts)
        print(f"RESULT loss_split agg={agg} split={label} loss_diff={abs(loss.item() - full_loss.item()):.3g} "
              f"grad_max_diff={(grad.float() - full_grad.float()).abs().max().item():.3g}")
        torch.testing.assert_close(loss, full_loss, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grad, full_grad, rtol=1e-5, atol=1e-8)
        for key, value in reduce_metrics(full_m).items():
            torch.testing.assert_close(reduce_metrics(m)[key], value, rtol=1e-5, atol=1e-7, msg=key)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_all_masked_micro_batch_adds_exactly_zero_cuda(agg):
    logp = torch.full((2, 3), float("nan"), device=DEVICE, dtype=torch.bfloat16).requires_grad_()
    old = torch.full((2, 3), 1e9, device=DEVICE, dtype=torch.bfloat16)
    adv, mask = torch.tensor([1.0, -1.0], device=DEVICE), torch.zeros(2, 3, device=DEVICE)
    loss, m = dapo_policy_loss(logp, old, adv, mask, **CLIP, clip_c=3.0, agg=agg, num_tokens=7, num_seqs=3,
                               max_new_tokens=3)
    assert loss.device.type == DEVICE.type and loss.item() == 0.0 and not torch.signbit(loss)
    loss.backward()
    assert torch.isfinite(logp.grad).all() and logp.grad.abs().sum() == 0
    # adding it to a real micro-batch's loss changes nothing, bit for bit
    real_logp, real_old, real_adv, real_mask = random_batch(1, b=2, t=3)
    real_mask[:] = 1.0
    real, _ = dapo_policy_loss(real_logp, real_old, real_adv, real_mask, **CLIP, agg=agg, num_tokens=7, num_seqs=3,
                               max_new_tokens=3)
    assert torch.equal(real + loss.detach(), real)
    assert m["num_tokens"].item() == 0


def cuda_rollout(seed=2, b=8, p=5, r=24):
    g = torch.Generator().manual_seed(seed)
    rlen = torch.randint(0, r + 1, (b,), generator=g)
    rlen[3] = 0
    mask = (torch.arange(r) < rlen[:, None]).float()
    old = -torch.rand(b, r, generator=g) * 2 * mask
    batch = RolloutBatch(prompt_ids=torch.ones(b, p, dtype=torch.long), prompt_mask=torch.ones(b, p, dtype=torch.long),
                         response_ids=torch.ones(b, r, dtype=torch.long), response_mask=mask,
                         group_ids=torch.arange(b) // 4, truncated=rlen == r, old_logp=old,
                         engine_logp=(old + 0.05 * torch.randn(b, r, generator=g)) * mask,
                         advantages=torch.randn(b, generator=g))
    fields = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "group_ids", "truncated", "old_logp",
              "engine_logp", "advantages")
    for name in fields:
        setattr(batch, name, getattr(batch, name).to(DEVICE))
    return batch, (old + 0.2 * torch.randn(b, r, generator=g)).to(DEVICE, torch.bfloat16)


def test_loss_fn_micro_batches_equal_full_batch_cuda():
    """make_loss_fn (overlong filter + TIS, what the policies call) over 4 micro-batches == one call on the batch."""
    batch, logp_values = cuda_rollout()
    fn = make_loss_fn(**CLIP, clip_c=10.0, overlong_filter=True, tis_cap=2.0)
    n = fn.normalizer(batch)
    logp = logp_values.clone().requires_grad_()
    full, _ = fn(logp, None, batch, n)
    full.backward()
    full_grad, logp.grad = logp.grad.clone(), None
    total = 0.0
    for lo in range(0, 8, 2):
        mb = batch.select(slice(lo, lo + 2))
        loss, _ = fn(logp[lo:lo + 2], None, mb, n)
        total = total + loss
    total.backward()
    torch.testing.assert_close(total, full, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(logp.grad, full_grad, rtol=1e-5, atol=1e-8)
    assert full_grad[3].abs().sum() == 0  # the empty row
