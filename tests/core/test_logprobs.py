"""Fused chunked log-prob/entropy against the plain full-logits reference: values, gradients, memory, sharding."""
import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nemo_dapo.core.logprobs import (VocabShard, fused_logprobs_entropy, linear_logprobs_entropy,
                                     logits_logprobs_entropy, reference_logprobs_entropy)


def make_inputs(n, h=16, v=50, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * scale).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h ** 0.5).to(dtype).requires_grad_()
    target = torch.randint(0, v, (n,), generator=g)
    # a loss that uses both outputs with per-token weights, so both gradient paths are exercised
    a, b = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)
    return hidden, weight, target, a, b


def values_and_grads(fn, hidden, weight, target, a, b, **kw):
    logp, ent = fn(hidden, weight, target, **kw)
    loss = (logp.double() * a).sum() + (ent.double() * b).sum()
    gh, gw = torch.autograd.grad(loss, (hidden, weight), allow_unused=True)
    return [logp.detach(), ent.detach(), gh, gw]


def assert_all_close(got, want, atol, rtol):
    for name, x, y in zip(("logp", "entropy", "grad_hidden", "grad_weight"), got, want):
        torch.testing.assert_close(x.double(), y.double(), atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("n,chunk", [(37, 8), (37, 37), (37, 100), (1, 4), (16, 5), (3, 1)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fp32_matches_reference(n, chunk, temperature):
    inputs = make_inputs(n)
    got = values_and_grads(linear_logprobs_entropy, *inputs, chunk_size=chunk, temperature=temperature)
    want = values_and_grads(reference_logprobs_entropy, *inputs, temperature=temperature)
    assert_all_close(got, want, atol=2e-5, rtol=1e-5)


def test_fp64_gradcheck_including_entropy_gradient():
    hidden, weight, target, _, _ = make_inputs(5, h=3, v=7, dtype=torch.float64)
    fn = lambda h, w: linear_logprobs_entropy(h, w, target, chunk_size=2, temperature=0.9)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (hidden, weight))


def test_large_logits_stay_exact():
    # logits of magnitude ~100: entropy = lse - E[z] would cancel badly if computed unshifted
    inputs = make_inputs(20, scale=60.0, dtype=torch.float64)
    f32 = [t.detach().float().requires_grad_() if t.is_floating_point() and t.requires_grad else t for t in inputs]
    got = values_and_grads(linear_logprobs_entropy, *f32, chunk_size=7)
    want = values_and_grads(reference_logprobs_entropy, *inputs)
    assert_all_close(got, want, atol=2e-4, rtol=1e-4)


def test_bf16_as_accurate_as_reference():
    """bf16 inputs: both paths round; the fused one must be as close to the fp64 truth as the reference is."""
    hidden, weight, target, a, b = make_inputs(45, h=32, v=96, dtype=torch.bfloat16, seed=3)
    got = values_and_grads(linear_logprobs_entropy, hidden, weight, target, a, b, chunk_size=16)
    ref = values_and_grads(reference_logprobs_entropy, hidden, weight, target, a, b)
    h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    truth = values_and_grads(reference_logprobs_entropy, h64, w64, target, a, b)
    for name, x, r, t in zip(("logp", "entropy", "grad_hidden", "grad_weight"), got, ref, truth):
        assert x.dtype == (torch.float32 if name in ("logp", "entropy") else torch.bfloat16)
        scale = t.abs().max().item()
        err, ref_err = (x.double() - t).abs().max().item(), (r.double() - t).abs().max().item()
        assert err <= 2 * ref_err + 1e-6 * scale, f"{name}: fused error {err:.3g} vs reference error {ref_err:.3g}"
        assert err <= 1e-2 * scale, f"{name}: error {err:.3g} for values of size {scale:.3g}"


@pytest.mark.parametrize("use", ["logp", "entropy"])
def test_one_output_unused(use):
    hidden, weight, target, a, _ = make_inputs(11)
    grads = []
    for fn, kw in ((linear_logprobs_entropy, {"chunk_size": 4}), (reference_logprobs_entropy, {})):
        logp, ent = fn(hidden, weight, target, **kw)
        grads.append(torch.autograd.grad(((logp if use == "logp" else ent) * a.float()).sum(), (hidden, weight)))
    for x, y in zip(*grads):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-5)


def test_empty_input():
    hidden, weight, target, a, b = make_inputs(0)
    logp, ent, gh, gw = values_and_grads(linear_logprobs_entropy, hidden, weight, target, a, b, chunk_size=4)
    assert logp.shape == ent.shape == (0,) and gh.shape == (0, 16)
    assert gw is None or torch.count_nonzero(gw) == 0


def test_batched_helper_with_mask():
    g = torch.Generator().manual_seed(1)
    b_, t_, h_, v_ = 3, 6, 8, 20
    hidden = torch.randn(b_, t_, h_, generator=g, requires_grad=True)
    weight = torch.randn(v_, h_, generator=g, requires_grad=True)
    targets = torch.randint(0, v_, (b_, t_), generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]], dtype=torch.float32)
    coef = torch.randn(b_, t_, generator=g)
    logp, ent = fused_logprobs_entropy(hidden, weight, targets, mask=mask, chunk_size=4)
    ref_logp, ref_ent = reference_logprobs_entropy(hidden, weight, targets)
    assert logp.shape == ent.shape == (b_, t_) and logp.dtype == torch.float32
    torch.testing.assert_close(logp, ref_logp * mask)
    torch.testing.assert_close(ent, ref_ent * mask)
    got = torch.autograd.grad(((logp + 0.1 * ent) * coef).sum(), (hidden, weight))
    want = torch.autograd.grad(((ref_logp + 0.1 * ref_ent) * coef * mask).sum(), (hidden, weight))
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-5)
    assert torch.count_nonzero(got[0][mask == 0]) == 0  # padding gets no gradient


def test_logits_path_matches_reference():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(13, 30, generator=g).requires_grad_()
    target = torch.randint(0, 30, (13,), generator=g)
    a, b = torch.randn(13, generator=g), torch.randn(13, generator=g)
    logp, ent = logits_logprobs_entropy(logits, target, chunk_size=5, temperature=1.3)
    grad = torch.autograd.grad((logp * a + ent * b).sum(), logits)[0]
    logp_all = torch.log_softmax(logits / 1.3, dim=-1)
    ref_logp, ref_ent = logp_all.gather(1, target[:, None]).squeeze(1), -(logp_all.exp() * logp_all).sum(-1)
    ref_grad = torch.autograd.grad((ref_logp * a + ref_ent * b).sum(), logits)[0]
    torch.testing.assert_close(logp, ref_logp)
    torch.testing.assert_close(ent, ref_ent)
    torch.testing.assert_close(grad, ref_grad)


class ThreadGroup:
    """In-process stand-in for a process group: ranks are threads, all-reduce goes through shared slots."""

    def __init__(self, world):
        self.slots, self.barrier = [None] * world, threading.Barrier(world, timeout=30)

    def all_reduce(self, rank, op):
        def reduce(t):
            self.slots[rank] = t.clone()
            self.barrier.wait()
            out = torch.stack(self.slots).amax(0) if op == "max" else torch.stack(self.slots).sum(0)
            self.barrier.wait()  # everyone has read the slots before the next call overwrites them
            t.copy_(out)
        return reduce


def run_sharded(world, hidden, weight, target, a, b, chunk, valid_vocab=None):
    group, results, errors = ThreadGroup(world), [None] * world, []
    v_local = weight.shape[0] // world

    def rank_main(r):
        try:
            shard = VocabShard(start=r * v_local, vocab_size=weight.shape[0],
                               all_reduce_max=group.all_reduce(r, "max"), all_reduce_sum=group.all_reduce(r, "sum"),
                               reduce_grad_hidden=group.all_reduce(r, "sum"), valid_vocab=valid_vocab)
            w = weight.detach()[r * v_local:(r + 1) * v_local].clone().requires_grad_()
            h = hidden.detach().clone().requires_grad_()
            results[r] = values_and_grads(linear_logprobs_entropy, h, w, target, a, b, chunk_size=chunk, shard=shard)
        except Exception as e:  # surfaced below; a silent thread would hang the other one at the barrier
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("world,scale", [(2, 1.0), (3, 1.0), (2, 150.0)])
def test_vocab_shards_combine_to_reference(world, scale):
    # scale 150: logits of a few hundred, where exp() under- or overflows unless all shards shift by one common max
    h64, w64, target, a, b = make_inputs(19, v=48, scale=scale, dtype=torch.float64)
    want = values_and_grads(reference_logprobs_entropy, h64, w64, target, a, b)
    hidden, weight = (t.detach().float() for t in (h64, w64))
    results = run_sharded(world, hidden, weight, target, a, b, chunk=6)
    v_local = 48 // world
    for r, (logp, ent, gh, gw) in enumerate(results):
        assert_all_close([logp, ent, gh, gw], [want[0], want[1], want[2], want[3][r * v_local:(r + 1) * v_local]],
                         atol=2e-5 * scale, rtol=1e-4)


# vocabulary padding (valid_vocab): the engine's softmax runs over the real vocabulary only

def padded_reference(h, w, t, a, b, valid, temperature=1.0):
    """The reference on the real rows, its weight gradient zero-padded back to the padded vocabulary."""
    logp, ent, gh, gw = values_and_grads(lambda h_, w_, t_: reference_logprobs_entropy(
        h_, w_, t_, temperature=temperature, valid_vocab=valid), h, w, t, a, b)
    return [logp, ent, gh, torch.cat([gw[:valid], torch.zeros_like(gw[valid:])])]


@pytest.mark.parametrize("valid", [50, 41, 1])
def test_padding_rows_left_out_of_the_softmax(valid):
    h, w, _, a, b = make_inputs(23, v=50, dtype=torch.float64)
    t = torch.randint(0, valid, (23,), generator=torch.Generator().manual_seed(3))
    want = padded_reference(h, w, t, a, b, valid, temperature=0.8)
    got = values_and_grads(linear_logprobs_entropy, h, w, t, a, b, chunk_size=6, temperature=0.8,
                           shard=VocabShard(valid_vocab=valid))
    assert_all_close(got, want, atol=1e-10, rtol=1e-10)
    if valid < 50:  # the padding rows really change the numbers when they are counted
        counted = values_and_grads(linear_logprobs_entropy, h, w, t, a, b, chunk_size=6, temperature=0.8)
        assert (counted[0] - want[0]).abs().max() > 1e-3
    logits = (h @ w.t()).detach().requires_grad_()
    lp, en = logits_logprobs_entropy(logits, t, chunk_size=5, temperature=0.8, shard=VocabShard(valid_vocab=valid))
    torch.testing.assert_close(lp, want[0])
    torch.testing.assert_close(en, want[1])
    g = torch.autograd.grad((lp * a + en * b).sum(), logits)[0]
    assert g[:, valid:].abs().sum() == 0


def test_padding_gradcheck_and_bad_targets():
    hidden, weight, target, _, _ = make_inputs(5, h=3, v=7, dtype=torch.float64)
    target = target.clamp(max=4)
    fn = lambda h, w: linear_logprobs_entropy(h, w, target, chunk_size=2, temperature=0.9,  # noqa: E731
                                              shard=VocabShard(valid_vocab=5))
    assert torch.autograd.gradcheck(fn, (hidden, weight))
    with pytest.raises(ValueError, match=r"target ids must lie in \[0, 5\)"):
        linear_logprobs_entropy(hidden, weight, torch.full((5,), 6), shard=VocabShard(valid_vocab=5))
    with pytest.raises(ValueError, match="valid_vocab must lie in"):
        linear_logprobs_entropy(hidden, weight, target, shard=VocabShard(valid_vocab=8))


@pytest.mark.parametrize("world,valid", [(2, 40), (2, 20), (3, 33)])
def test_padding_across_vocab_shards(world, valid):
    # valid 20 < 24 rows of shard 0: shard 1 holds padding only and must contribute nothing
    h64, w64, _, a, b = make_inputs(19, v=48, dtype=torch.float64)
    target = torch.randint(0, valid, (19,), generator=torch.Generator().manual_seed(5))
    want = padded_reference(h64, w64, target, a, b, valid)
    hidden, weight = (t.detach().float() for t in (h64, w64))
    v_local = 48 // world
    for r, got in enumerate(run_sharded(world, hidden, weight, target, a, b, chunk=6, valid_vocab=valid)):
        assert_all_close(got, want[:3] + [want[3][r * v_local:(r + 1) * v_local]], atol=2e-5, rtol=1e-4)


class MaxNumel(TorchDispatchMode):
    """Records the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


@pytest.mark.parametrize("fused", [True, False])
def test_full_logits_never_materialised(fused):
    n, v, h, chunk = 64, 200, 8, 16
    hidden, weight, target, a, b = make_inputs(n, h=h, v=v)
    fn = (lambda *x: linear_logprobs_entropy(*x, chunk_size=chunk)) if fused else reference_logprobs_entropy
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with MaxNumel() as mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        values_and_grads(fn, hidden, weight, target, a, b)
    if fused:
        assert mode.max_numel <= chunk * v, f"a tensor of {mode.max_numel} elements exists (chunk x V = {chunk * v})"
        assert max(saved) <= max(v * h, n * h), f"saved for backward: {sorted(saved)[-3:]} elements"
    else:  # the reference does materialise [N, V]: proves the probe can see it
        assert mode.max_numel >= n * v and max(saved) >= n * v


@pytest.mark.parametrize("bad,match", [
    ({"target": torch.tensor([0, 50, 1])}, r"target ids must lie in \[0, 50\)"),
    ({"target": torch.tensor([0, -1, 1])}, r"target ids must lie in"),
    ({"target": torch.tensor([0, 1])}, r"target must be an integer tensor of shape \[3\]"),
    ({"chunk_size": 0}, r"chunk_size must be a positive int"),
    ({"temperature": 0.0}, r"temperature must be > 0"),
    ({"weight": torch.zeros(50, 5)}, r"same H"),
    ({"weight": torch.zeros(50, 16, dtype=torch.float64)}, r"must have one dtype"),
])
def test_bad_input_is_named(bad, match):
    kw = {"hidden": torch.zeros(3, 16), "weight": torch.zeros(50, 16), "target": torch.tensor([0, 1, 2]),
          "chunk_size": 4, "temperature": 1.0}
    kw.update(bad)
    with pytest.raises(ValueError, match=match):
        linear_logprobs_entropy(kw.pop("hidden"), kw.pop("weight"), kw.pop("target"), **kw)


def test_batched_helper_bad_shapes():
    with pytest.raises(ValueError, match="must be targets' shape"):
        fused_logprobs_entropy(torch.zeros(2, 3, 4), torch.zeros(5, 4), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="mask must have the targets' shape"):
        fused_logprobs_entropy(torch.zeros(2, 3, 4), torch.zeros(5, 4), torch.zeros(2, 3, dtype=torch.long),
                               mask=torch.ones(2, 4))
