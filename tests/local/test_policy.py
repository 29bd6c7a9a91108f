import logging

import pytest
import torch

from nemo_dapo.core.loss import make_loss_fn
from nemo_dapo.core.types import Policy
from nemo_dapo.local.policy import LocalPolicy
from tests.support.reference import reference_logprobs
from tests.local.tiny_models import random_batch, tiny_model


def nll_loss(logp, entropy, mb, num_tokens):
    """Token-mean NLL with the global token count (a micro-batch's share)."""
    return -(logp * mb.response_mask).sum() / num_tokens, {"num_tokens": mb.response_mask.sum()}


def pg_loss(logp, entropy, mb, num_tokens):
    """A tiny token-level policy-gradient loss: -sum(A * logp) / N."""
    return -(mb.advantages[:, None] * logp * mb.response_mask).sum() / num_tokens, {}


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture
def batch():
    b = random_batch(prompt_lengths=(3, 5, 4, 6, 2, 7, 3, 4), response_lengths=(4, 1, 6, 3, 5, 2, 6, 1))
    b.advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.0, 1.5])
    return b


def test_implements_the_policy_protocol():
    assert isinstance(LocalPolicy(tiny_model()), Policy)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_logprobs_match_full_logits(arch, batch):
    model = tiny_model(arch)
    logp, ent = LocalPolicy(model, logprob_batch_size=3).logprobs(batch)
    ref_logp, ref_ent = reference_logprobs(model, batch)
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    assert logp.shape == batch.response_ids.shape and bool((logp[batch.response_mask == 0] == 0).all())


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_logprobs_are_those_of_the_distribution_the_samples_came_from(temperature):
    """The trainer's log-probs are of logits / T, as the sampler's (and the engines') are: otherwise the importance
    ratio, the truncated importance weight and the engine/trainer mismatch compare two distributions."""
    from nemo_dapo.core.types import RolloutBatch
    from nemo_dapo.local.sampler import LocalSampler
    from tests.local.tiny_models import EOS, left_padded

    model = tiny_model()
    ids, mask = left_padded((3, 4))
    out = LocalSampler(model, eos_id=EOS, pad_id=0).generate(ids, mask, max_new_tokens=6, temperature=temperature,
                                                             seed=1)
    b = RolloutBatch(prompt_ids=ids, prompt_mask=mask.float(), response_ids=out.response_ids,
                     response_mask=out.response_mask, group_ids=torch.tensor([0, 0]), truncated=out.truncated)
    logp, _ = LocalPolicy(model, temperature=temperature).logprobs(b)
    m = out.response_mask.bool()
    torch.testing.assert_close(logp[m], out.logprobs[m], atol=1e-5, rtol=0)


def test_one_step_lowers_the_loss_on_a_fixed_batch(batch):
    policy = LocalPolicy(tiny_model(), lr=1e-2)
    n = float(batch.num_tokens())
    before = policy.train_step(batch, norm=n, loss_fn=nll_loss)
    after = policy.train_step(batch, norm=n, loss_fn=nll_loss)
    assert after["loss"] < before["loss"] - 1e-3
    assert before["skipped"] == 0.0 and before["grad_norm"] > 0 and before["num_tokens"] == n


@pytest.mark.parametrize("loss_fn", [pg_loss, make_loss_fn(eps_low=0.2, eps_high=0.28)], ids=["pg", "dapo"])
def test_micro_batch_1_vs_4_gives_the_same_gradients(batch, loss_fn):
    batch.old_logp = LocalPolicy(tiny_model()).logprobs(batch)[0] - 0.05  # ratios != 1 for the DAPO loss
    n = float(batch.num_tokens())
    results = []
    for mbs in (None, 1, 4):
        model = tiny_model()
        metrics, finite = LocalPolicy(model, micro_batch_size=mbs).accumulate_gradients(batch, n, loss_fn)
        results.append((metrics["loss"], grads(model)))
    (loss_all, g_all) = results[0]
    for loss, g in results[1:]:
        assert loss == pytest.approx(loss_all, abs=1e-6)
        for name in g_all:
            torch.testing.assert_close(g[name], g_all[name], atol=1e-6, rtol=1e-4)


def test_nan_loss_skips_the_update_and_leaves_everything_unchanged(batch, caplog):
    model = tiny_model()
    policy = LocalPolicy(model, lr=1e-2)
    policy.train_step(batch, norm=float(batch.num_tokens()), loss_fn=nll_loss)
    w, opt = weights(model), policy.optimizer.state_dict()
    nan_loss = lambda logp, ent, mb, n: (logp.sum() * float("nan"), {})  # noqa: E731
    with caplog.at_level(logging.WARNING):
        out = policy.train_step(batch, norm=1.0, loss_fn=nan_loss)
    assert out["skipped"] == 1.0 and "non-finite loss" in caplog.text
    assert all(torch.equal(w[k], v) for k, v in weights(model).items())
    assert policy.optimizer.state_dict()["state"][0]["step"] == opt["state"][0]["step"]
    assert policy.num_updates == 1 and policy.num_skipped == 1
    assert all(p.grad is None for p in model.parameters())


def test_non_finite_gradient_with_finite_loss_is_skipped(batch, caplog):
    model = tiny_model()
    policy = LocalPolicy(model)
    w = weights(model)
    # sqrt at 0 is finite, its gradient is not: d sqrt(0 * s) = inf * 0 = nan
    bad_grad = lambda logp, ent, mb, n: (torch.sqrt(logp.sum() * 0.0), {})  # noqa: E731
    with caplog.at_level(logging.WARNING):
        out = policy.train_step(batch, norm=1.0, loss_fn=bad_grad)
    assert out["skipped"] == 1.0 and out["loss"] == 0.0 and "non-finite gradient" in caplog.text
    assert all(torch.equal(w[k], v) for k, v in weights(model).items())


def test_state_dict_round_trip_gives_identical_next_steps(batch):
    n = float(batch.num_tokens())
    a = LocalPolicy(tiny_model(seed=0), lr=1e-2, warmup_steps=5)
    for _ in range(2):
        a.train_step(batch, norm=n, loss_fn=pg_loss)
    state = a.state_dict()
    expected = [a.train_step(batch, norm=n, loss_fn=pg_loss) for _ in range(2)]
    b = LocalPolicy(tiny_model(seed=1), lr=1e-2, warmup_steps=5)  # different initial weights, fresh optimizer
    b.load_state_dict(state)
    got = [b.train_step(batch, norm=n, loss_fn=pg_loss) for _ in range(2)]
    assert got == expected
    assert all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values()))


def test_state_dict_is_a_copy(batch):
    policy = LocalPolicy(tiny_model(), lr=1e-2)
    state = policy.state_dict()
    policy.train_step(batch, norm=float(batch.num_tokens()), loss_fn=nll_loss)
    assert not all(torch.equal(state["model"][k], v) for k, v in policy.model.state_dict().items())


def test_load_state_dict_rejects_a_partial_state():
    with pytest.raises(KeyError, match="optimizer"):
        LocalPolicy(tiny_model()).load_state_dict({"model": {}})


def test_linear_warmup_and_grad_clip(batch):
    policy = LocalPolicy(tiny_model(), lr=1e-2, warmup_steps=4, grad_clip=1e-3)
    n = float(batch.num_tokens())
    lrs = [policy.train_step(batch, norm=n, loss_fn=nll_loss)["lr"] for _ in range(6)]
    assert lrs == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-2, 1e-2, 1e-2])
    # the reported norm is the one before clipping; the applied gradient has norm grad_clip
    model = policy.model
    policy.optimizer.zero_grad()
    metrics, _ = policy.accumulate_gradients(batch, n, nll_loss)
    total = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters() if p.grad is not None))
    assert total > 1e-3
    torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1e-3)
    clipped = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters() if p.grad is not None))
    assert clipped == pytest.approx(1e-3, rel=1e-4)


def test_logprobs_restore_training_mode_and_need_no_grad(batch):
    policy = LocalPolicy(tiny_model())
    policy.model.train()
    logp, ent = policy.logprobs(batch)
    assert policy.model.training and not logp.requires_grad and not ent.requires_grad


def test_bad_micro_batch_size():
    with pytest.raises(ValueError, match="micro_batch_size"):
        LocalPolicy(tiny_model(), micro_batch_size=0)


def test_a_resumed_policy_keeps_its_update_and_skip_counts(batch):
    policy = LocalPolicy(tiny_model(), lr=1e-2)
    policy.train_step(batch, norm=float(batch.num_tokens()), loss_fn=pg_loss)
    policy.train_step(batch, norm=1.0, loss_fn=lambda logp, ent, mb, n: (logp.sum() * float("nan"), {}))
    resumed = LocalPolicy(tiny_model(seed=1), lr=1e-2)
    resumed.load_state_dict(policy.state_dict())
    assert (resumed.num_updates, resumed.num_skipped) == (policy.num_updates, policy.num_skipped) == (1, 1)
