import pytest
import torch

from nemo_dapo.core.types import Generator, RolloutBatch
from nemo_dapo.models.decoder import position_ids_from_mask
from tests.support.reference import reference_logprobs
from nemo_dapo.core.sampling import sample_next
from nemo_dapo.core.settings import MIN_TEMPERATURE
from nemo_dapo.local.sampler import LocalSampler
from tests.local.tiny_models import EOS, PAD, left_padded, tiny_model

NEVER = -1  # an eos id no token can equal: rows run to their budget


@pytest.fixture
def model():
    return tiny_model()


def sampler(model, eos=EOS):
    return LocalSampler(model, eos_id=eos, pad_id=PAD)


def as_batch(prompt_ids, prompt_mask, gen) -> RolloutBatch:
    B = prompt_ids.shape[0]
    return RolloutBatch(prompt_ids, prompt_mask, gen.response_ids, gen.response_mask, torch.arange(B), gen.truncated)


def test_implements_the_generator_protocol(model):
    assert isinstance(sampler(model), Generator)


def test_same_seed_same_tokens_other_seed_differs(model):
    ids, mask = left_padded([3, 7, 5, 4])
    s = sampler(model, eos=NEVER)
    a = s.generate(ids, mask, max_new_tokens=12, seed=5)
    b = s.generate(ids, mask, max_new_tokens=12, seed=5)
    c = s.generate(ids, mask, max_new_tokens=12, seed=6)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.response_ids, c.response_ids)


def test_seed_none_follows_the_global_rng(model):
    ids, mask = left_padded([3, 4])
    s = sampler(model, eos=NEVER)
    torch.manual_seed(11)
    a = s.generate(ids, mask, max_new_tokens=8)
    torch.manual_seed(11)
    b = s.generate(ids, mask, max_new_tokens=8)
    assert torch.equal(a.response_ids, b.response_ids)


def test_logprobs_agree_with_a_full_forward(model):
    # sampled log-probs (KV cache, rows dropping out as they finish) vs one full forward pass over prompt + response
    ids, mask = left_padded([2, 6, 4, 5, 3])
    gen = sampler(model).generate(ids, mask, max_new_tokens=torch.tensor([9, 3, 12, 1, 7]), seed=0)
    ref_logp, _ = reference_logprobs(model, as_batch(ids, mask, gen))
    torch.testing.assert_close(gen.logprobs, ref_logp, atol=1e-5, rtol=0)  # fp32 round-off only
    assert bool((gen.logprobs[gen.response_mask == 0] == 0).all())


def test_greedy_matches_stepwise_argmax_without_cache(model):
    ids, mask = left_padded([4, 2, 6])
    gen = sampler(model, eos=NEVER).generate(ids, mask, max_new_tokens=8, temperature=0.0)
    for b in range(ids.shape[0]):
        seq = ids[b][mask[b] > 0].tolist()
        for _ in range(8):
            t = torch.tensor([seq])
            with torch.no_grad():
                logits = model(input_ids=t, position_ids=position_ids_from_mask(torch.ones_like(t))).logits
            seq.append(int(logits[0, -1].argmax()))
        assert gen.response_ids[b].tolist() == seq[-8:]


def test_left_padding_does_not_change_the_output(model):
    ids, mask = left_padded([3, 9])
    s = sampler(model, eos=NEVER)
    alone = s.generate(ids[:1, -3:], mask[:1, -3:], max_new_tokens=6, temperature=0.0)
    padded = s.generate(ids, mask, max_new_tokens=6, temperature=0.0)
    assert torch.equal(alone.response_ids[0], padded.response_ids[0])
    torch.testing.assert_close(alone.logprobs[0], padded.logprobs[0], atol=1e-5, rtol=0)


def test_rows_stop_at_their_own_eos(model):
    ids, mask = left_padded([3, 5, 4])
    free = sampler(model, eos=NEVER).generate(ids, mask, max_new_tokens=10, temperature=0.0)
    eos = int(free.response_ids[0, 3])  # make row 0's 4th greedy token the EOS
    out = sampler(model, eos=eos).generate(ids, mask, max_new_tokens=10, temperature=0.0)
    for b in range(3):
        row = free.response_ids[b].tolist()
        n = row.index(eos) + 1 if eos in row else 10
        assert out.response_mask[b].sum() == n
        assert out.response_ids[b, :n].tolist() == row[:n]
        assert bool((out.response_ids[b, n:] == PAD).all()) and bool((out.response_mask[b, n:] == 0).all())
        assert bool(out.truncated[b]) == (eos not in row)
    assert out.response_mask[0].sum() <= 4 and not out.truncated[0]


def test_a_row_whose_eos_is_its_last_budgeted_token_finished_and_is_not_truncated(model):
    ids, mask = left_padded([3, 5, 4])
    free = sampler(model, eos=NEVER).generate(ids, mask, max_new_tokens=10, temperature=0.0)
    eos = int(free.response_ids[0, 3])
    first = free.response_ids[0].tolist().index(eos)  # row 0 reaches the EOS at token first + 1: its whole budget
    out = sampler(model, eos=eos).generate(ids, mask, max_new_tokens=first + 1, temperature=0.0)
    assert out.response_mask[0].sum() == first + 1 and int(out.response_ids[0, first]) == eos
    assert not out.truncated[0]
    for b in (1, 2):  # a row cut at the same budget without its EOS is truncated
        assert bool(out.truncated[b]) == (eos not in free.response_ids[b, :first + 1].tolist())


def test_per_row_budget(model):
    ids, mask = left_padded([3, 5, 4, 2])
    budget = torch.tensor([1, 7, 0, 4])
    out = sampler(model, eos=NEVER).generate(ids, mask, max_new_tokens=budget, seed=0)
    assert out.response_mask.sum(-1).long().tolist() == [1, 7, 0, 4]
    assert out.response_ids.shape == (4, 7)
    assert out.truncated.tolist() == [True, True, True, True]


def test_top_p_tiny_is_greedy_and_sampling_follows_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    tok, lp = sample_next(logits, 1.0, 1e-6, torch.Generator().manual_seed(0))
    assert bool((tok == 0).all()) and torch.allclose(lp, torch.zeros_like(lp))
    tok, lp = sample_next(logits, 0.5, 1.0, torch.Generator().manual_seed(0))
    freq = torch.bincount(tok, minlength=4).float() / len(tok)
    expected = torch.softmax(logits[0] / 0.5, -1)
    assert torch.allclose(freq, expected, atol=0.015)  # ~5 standard errors at n = 20000
    torch.testing.assert_close(lp, expected.log()[tok])
    # top_p = 0.8: the two most likely tokens (mass 0.665 + 0.245) cover it; the tail is never drawn
    tok, lp = sample_next(logits, 1.0, 0.8, torch.Generator().manual_seed(0))
    assert set(tok.tolist()) == {0, 1}
    kept = torch.softmax(logits[0, :2], -1)
    torch.testing.assert_close(lp, kept.log()[tok])


def test_a_top_p_that_rounds_to_zero_keeps_the_top_token_and_a_tiny_temperature_is_refused():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4, 1)
    for top_p in (1e-50, 1e-300):  # 0 in float32: every token was masked, and the log-probs were NaN
        tok, lp = sample_next(logits, 1.0, top_p, torch.Generator().manual_seed(0))
        assert tok.tolist() == [0] * 4 and lp.tolist() == [0.0] * 4
    for temperature in (1e-39, MIN_TEMPERATURE / 2):  # 1e-39 divided the logits into inf
        with pytest.raises(ValueError, match="below 0.0001"):
            sample_next(logits, temperature, 1.0, None)
    tok, lp = sample_next(logits, MIN_TEMPERATURE, 1.0, torch.Generator().manual_seed(0))
    assert tok.tolist() == [0] * 4 and bool(torch.isfinite(lp).all())


def test_update_weights_copies_a_separate_model():
    a, b = tiny_model(seed=0), tiny_model(seed=1)
    s = sampler(b)
    s.update_weights(type("P", (), {"model": a})())
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=torch.tensor([1, 2, 3])), "entries"),
    (dict(max_new_tokens=-1), ">= 0"),
    (dict(max_new_tokens=4, top_p=0.0), "top_p"),
    (dict(max_new_tokens=4, temperature=-1.0), "temperature"),
])
def test_bad_arguments(model, kwargs, match):
    ids, mask = left_padded([3, 4])
    with pytest.raises(ValueError, match=match):
        sampler(model).generate(ids, mask, **kwargs)


def test_right_padded_prompts_are_rejected(model):
    ids, mask = left_padded([3, 4])
    with pytest.raises(ValueError, match="LEFT-padded"):
        sampler(model).generate(ids.flip(1), mask.flip(1), max_new_tokens=4)


def test_a_block_sampled_with_its_first_row_index_is_that_block_of_the_whole_batch(model):
    """What lets rollout.processes split a batch without changing a row's draws (run_parallel.py)."""
    ids, mask = left_padded([3, 5, 4, 6])
    s = sampler(model, eos=NEVER)
    whole = s.generate(ids, mask, max_new_tokens=6, seed=11)
    block = s.generate(ids[2:], mask[2:], max_new_tokens=6, seed=11, first_row=2)
    assert torch.equal(block.response_ids, whole.response_ids[2:])
    shifted = s.generate(ids[2:], mask[2:], max_new_tokens=6, seed=11)  # row 0's stream: other draws
    assert not torch.equal(shifted.response_ids, block.response_ids)
