"""Vocab-parallel log-prob/entropy under torchrun (gloo, 2 ranks) against the single-device core reference.

One torchrun runs every case (TP=2, TP=1, explicit group; fp32 and bf16); the tests below check its saved results.
"""
from pathlib import Path

import pytest
import torch

from nemo_dapo.core.logprobs import reference_logprobs_entropy
from nemo_dapo.megatron.vocab_parallel import tp_vocab_shard, vocab_parallel_logits_logprobs_entropy
from tests.support.dist import run_torchrun

WORKER = Path(__file__).parent / "workers" / "vocab_parallel_worker.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("vocab_parallel")
    run_torchrun(WORKER, nproc=2, out_dir=out)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def reference(res, dtype=None):
    """Values and gradients of the same loss on one device, from the full weight (or full logits)."""
    inp = res["inputs"]
    hidden, weight = (inp[k].to(dtype or inp[k].dtype).requires_grad_() for k in ("hidden", "weight"))
    if "grad_logits" in res:
        logits = (hidden @ weight.t()).detach().requires_grad_()
        logp, ent = reference_logprobs_entropy(logits, torch.eye(weight.shape[0], dtype=logits.dtype),
                                               inp["targets"], temperature=res["temperature"])
        wrt = (logits,)
    else:
        logp, ent = reference_logprobs_entropy(hidden, weight, inp["targets"], temperature=res["temperature"])
        wrt = (hidden, weight)
    if res["masked"]:
        logp, ent = logp * inp["mask"], ent * inp["mask"]
    loss = (logp * inp["a"]).sum() + (ent * inp["b"]).sum()
    grads = torch.autograd.grad(loss, wrt) if loss.requires_grad else tuple(torch.zeros_like(w) for w in wrt)
    return dict(logp=logp.detach(), ent=ent.detach(), grads=grads)


def got_and_want(res, partial_grad_hidden_sum=None):
    """Pairs (name, ours, single-device reference, fp64 truth) for one rank's result."""
    ref, truth = reference(res), reference(res, torch.float64)
    tp, r = res["tp"], res["tp_rank"]
    pairs = [("logp", res["logp"], ref["logp"], truth["logp"]), ("entropy", res["ent"], ref["ent"], truth["ent"])]
    if "grad_logits" in res:
        shard = lambda g: g.chunk(tp, dim=-1)[r]  # noqa: E731
        pairs.append(("grad_logits", res["grad_logits"], shard(ref["grads"][0]), shard(truth["grads"][0])))
    else:
        grad_h = res["grad_hidden"] if partial_grad_hidden_sum is None else partial_grad_hidden_sum
        pairs.append(("grad_hidden", grad_h, ref["grads"][0], truth["grads"][0]))
        shard = lambda g: g.chunk(tp, dim=0)[r]  # noqa: E731
        pairs.append(("grad_weight", res["grad_weight"], shard(ref["grads"][1]), shard(truth["grads"][1])))
    return pairs


def check(key, pairs, low_precision, tp):
    for name, x, r, t in pairs:
        assert x.shape == r.shape, f"{key} {name}: shape {tuple(x.shape)} != {tuple(r.shape)}"
        if not low_precision:
            torch.testing.assert_close(x.double(), r.double(), atol=2e-5, rtol=1e-5,
                                       msg=lambda m: f"{key} {name}: {m}")
            continue
        # bf16: both round; ours must be about as close to the fp64 truth as the single-device reference
        scale = max(t.abs().max().item(), 1e-12) if t.numel() else 1.0
        err = (x.double() - t).abs().max().item() if t.numel() else 0.0
        ref_err = (r.double() - t).abs().max().item() if t.numel() else 0.0
        # the replicated input's gradient is a sum of tp partials that the bf16 matmul rounds one by one before
        # they are summed (as in Megatron's ColumnParallelLinear): allow one bf16 rounding (2^-8) per partial
        slack = 2 ** -8 * scale * tp if name == "grad_hidden" and tp > 1 else 1e-6 * scale
        assert err <= 2 * ref_err + slack, f"{key} {name}: error {err:.3g} vs reference's {ref_err:.3g}"


def keys(ranks, prefix):
    found = sorted(k for k in ranks[0] if k.startswith(prefix + "/"))
    assert found, f"the worker saved no {prefix} case"
    return found


@pytest.mark.slow
@pytest.mark.parametrize("prefix,tp", [("tp2", 2), ("tp1", 1), ("explicit_group", 2)])
def test_equals_single_device_reference(ranks, prefix, tp):
    for key in keys(ranks, prefix):
        if "sp_partial_grad" in key:
            continue  # below
        for rank in ranks:
            res = rank[key]
            assert res["tp"] == tp, f"{key}: ran at TP={res['tp']}, expected {tp}"
            check(key, got_and_want(res), res["inputs"]["hidden"].dtype == torch.bfloat16, tp)


@pytest.mark.slow
def test_values_identical_on_tp_ranks(ranks):
    for key in keys(ranks, "tp2"):
        assert ranks[0][key]["tp_rank"] != ranks[1][key]["tp_rank"]
        assert torch.equal(ranks[0][key]["logp"], ranks[1][key]["logp"]), key
        assert torch.equal(ranks[0][key]["ent"], ranks[1][key]["ent"]), key


@pytest.mark.slow
def test_reduce_grad_hidden_false_leaves_partials_that_sum_to_the_gradient(ranks):
    """Sequence-parallel style: the caller's reduce-scatter sums the partial hidden-state gradients."""
    for key in (k for k in keys(ranks, "tp2") if "sp_partial_grad" in k):
        partials = [rank[key]["grad_hidden"] for rank in ranks]
        total = (partials[0].double() + partials[1].double()).to(partials[0].dtype)
        full = reference(ranks[0][key])["grads"][0]
        assert not torch.allclose(partials[0].double(), full.double(), atol=1e-3), f"{key}: rank 0 already summed"
        for rank in ranks:
            check(key, got_and_want(rank[key], partial_grad_hidden_sum=total),
                  rank[key]["inputs"]["hidden"].dtype == torch.bfloat16, 2)


def test_bad_calls_are_named():
    from megatron.core import parallel_state
    if not parallel_state.model_parallel_is_initialized():
        with pytest.raises(RuntimeError, match="initialize_model_parallel"):
            tp_vocab_shard(8)
    with pytest.raises(ValueError, match="must be targets' shape"):
        vocab_parallel_logits_logprobs_entropy(torch.zeros(2, 3, 8), torch.zeros(2, 4, dtype=torch.long))


@pytest.mark.parametrize("entry", ["hidden", "logits"])
def test_valid_vocab_is_honoured_without_tensor_parallelism(gloo_world_of_one, entry):
    """At TP = 1 (a one-rank group) the padding rows beyond ``valid_vocab`` must still leave the softmax, through
    both entry points: the engine samples from the real vocabulary only. Reference: plain log_softmax over the
    first ``valid`` logits, in fp64."""
    import torch.distributed as dist

    from nemo_dapo.megatron.vocab_parallel import vocab_parallel_logprobs_entropy

    g = torch.Generator().manual_seed(5)
    padded, valid, temperature = 16, 11, 0.7
    hidden, weight = torch.randn(3, 4, 8, generator=g), torch.randn(padded, 8, generator=g)
    targets = torch.randint(0, valid, (3, 4), generator=g)
    logits = hidden @ weight.t()
    ref = torch.log_softmax(logits[..., :valid].double() / temperature, -1)
    want_logp = ref.gather(-1, targets[..., None])[..., 0]
    want_ent = -(ref.exp() * ref).sum(-1)
    if entry == "hidden":
        logp, ent = vocab_parallel_logprobs_entropy(hidden, weight, targets, temperature=temperature,
                                                    group=dist.group.WORLD, valid_vocab=valid, chunk_size=5)
    else:
        logp, ent = vocab_parallel_logits_logprobs_entropy(logits, targets, temperature=temperature,
                                                           group=dist.group.WORLD, valid_vocab=valid, chunk_size=5)
    torch.testing.assert_close(logp.double(), want_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), want_ent, atol=1e-5, rtol=1e-5)
