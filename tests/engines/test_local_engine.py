"""LocalEngine (continuous batching over a tiny transformers model) against the LocalSampler, the trainer's
reference log-probs and a slow cache-free decoder."""
import pytest
import torch

from nemo_dapo.core.sampling import inverse_cdf, sample_next, sampling_logp
from nemo_dapo.core.types import RolloutBatch
from nemo_dapo.engines.base import EngineError, EngineWeightError, Request
from nemo_dapo.engines.local import LocalEngine
from nemo_dapo.models.decoder import position_ids_from_mask, save_model
from tests.support.reference import reference_logprobs
from nemo_dapo.local.sampler import LocalSampler
from tests.local.tiny_models import EOS, PAD, VOCAB, left_padded, tiny_model

NEVER = -1  # an eos id no token can equal

LENGTHS = [3, 7, 5, 9, 4, 6, 2, 8]
BUDGETS = [5, 12, 3, 9, 7, 1, 10, 6]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def prompts(lengths=LENGTHS, seed=0):
    ids, mask = left_padded(lengths, seed)
    return [row[m > 0].tolist() for row, m in zip(ids, mask)]


def engine(model, eos=EOS, **kw):
    return LocalEngine(model, eos_id=eos, pad_id=PAD, **kw)


def run(eng, requests, max_calls=10000):
    for r in requests:
        eng.add(r)
    out, calls = {}, 0
    while eng.has_work():
        for c in eng.step():
            assert c.id not in out
            out[c.id] = c
        calls += 1
        assert calls < max_calls
    return out


def assert_same(a: dict, b: dict):
    """Same completions: tokens and finish reasons exactly, log-probs up to round-off (other batch shapes)."""
    assert sorted(a) == sorted(b)
    for k in a:
        assert [(s.token_ids, s.finish_reason) for s in a[k].samples] == \
               [(s.token_ids, s.finish_reason) for s in b[k].samples]
        for x, y in zip(a[k].samples, b[k].samples):
            torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)


def greedy_requests(budgets=BUDGETS, **kw):
    return [Request(id=f"r{i}", prompt_ids=p, max_new_tokens=b, temperature=0.0, **kw)
            for i, (p, b) in enumerate(zip(prompts(), budgets))]


@pytest.mark.parametrize("arch, slots, n, max_seq_len, steps", [("llama", 3, 1, None, 4), ("qwen2", 3, 2, 16, 1)])
def test_greedy_matches_the_sampler_with_slots_refilled_mid_flight(arch, slots, n, max_seq_len, steps):
    # fewer slots than sequences: finished rows are refilled while the others decode. max_seq_len 16 (a cache of
    # 32 columns, budgets cut to 16 - prompt) and ~70 decode steps also make the live window shift left.
    m = tiny_model(arch)
    eng = engine(m, max_batch_size=slots, max_seq_len=max_seq_len, steps_per_call=steps)
    shifts, make_room = [], eng._make_room

    def spy(need_left):
        live, before = len(eng._rows), eng._c
        make_room(need_left)
        shifts.append(live > 0 and eng._c < before)
    eng._make_room = spy
    out = run(eng, greedy_requests(n=n))
    budgets = [min(b, (max_seq_len or 128) - p) for p, b in zip(LENGTHS, BUDGETS)]
    ids, mask = left_padded(LENGTHS)
    gen = LocalSampler(m, eos_id=EOS, pad_id=PAD).generate(ids, mask, max_new_tokens=torch.tensor(budgets),
                                                           temperature=0.0)
    for i in range(len(LENGTHS)):
        k = int(gen.response_mask[i].sum())
        assert len(out[f"r{i}"].samples) == n
        for s in out[f"r{i}"].samples:
            assert s.token_ids == gen.response_ids[i, :k].tolist()
            torch.testing.assert_close(torch.tensor(s.logprobs), gen.logprobs[i, :k], atol=1e-5, rtol=0)
            assert s.finish_reason == ("length" if gen.truncated[i] else "stop")
    assert any(shifts) == bool(max_seq_len)


def slow_greedy(model, prompt, n):
    """Sequential, no KV cache: one full forward over the whole sequence per new token."""
    seq = list(prompt)
    for _ in range(n):
        t = torch.tensor([seq])
        with torch.no_grad():
            logits = model(input_ids=t, position_ids=position_ids_from_mask(torch.ones_like(t))).logits
        seq.append(int(logits[0, -1].argmax()))
    return seq[len(prompt):]


def test_greedy_matches_a_slow_cache_free_decoder(model):
    out = run(engine(model, eos=NEVER, max_batch_size=2), greedy_requests())
    for i, (p, b) in enumerate(zip(prompts(), BUDGETS)):
        assert out[f"r{i}"].samples[0].token_ids == slow_greedy(model, p, b)


def test_the_live_window_moves_right_shifts_left_and_grows(model):
    # a 30-token prompt admitted while the cursor is at 4 (move right), a long row still live when the cursor reaches
    # the 128-column cache with a window wider than half of it (grow to 2 * max_seq_len = 200 and shift)
    P = prompts()
    longs = [Request(id="long1", prompt_ids=P[0], max_new_tokens=80, temperature=0.0),
             Request(id="one", prompt_ids=P[6], max_new_tokens=1, temperature=0.0),
             Request(id="wide", prompt_ids=prompts([30], seed=3)[0], max_new_tokens=5, temperature=0.0)]
    reqs = longs + greedy_requests()[:4] + [Request(id="long2", prompt_ids=P[3], max_new_tokens=90, temperature=0.0)]
    eng = engine(model, eos=NEVER, max_batch_size=2, max_seq_len=100, steps_per_call=3)
    moves, make_room = [], eng._make_room

    def spy(need_left):
        live, before = len(eng._rows), eng._c
        make_room(need_left)
        if live:
            moves.append((before, eng._c, eng._cache.keys[0].shape[2]))
    eng._make_room = spy
    out = run(eng, reqs)
    assert any(after > before for before, after, _ in moves)
    assert any(after < before and cap == 200 for before, after, cap in moves)
    for r in reqs:
        assert out[r.id].samples[0].token_ids == slow_greedy(model, r.prompt_ids, r.max_new_tokens), r.id


def test_sampled_logprobs_equal_the_trainer_reference(model):
    reqs = [Request(id=f"r{i}", prompt_ids=p, n=2, max_new_tokens=b, temperature=1.0, seed=i)
            for i, (p, b) in enumerate(zip(prompts(), BUDGETS))]
    out = run(engine(model, max_batch_size=5), reqs)
    samples = [(r.prompt_ids, s) for r in reqs for s in out[r.id].samples]
    P, R = max(len(p) for p, _ in samples), max(len(s.token_ids) for _, s in samples)
    B = len(samples)
    pid, pmask = torch.full((B, P), PAD), torch.zeros(B, P, dtype=torch.long)
    rid, rmask, logp = torch.full((B, R), PAD), torch.zeros(B, R), torch.zeros(B, R)
    for b, (p, s) in enumerate(samples):
        pid[b, P - len(p):], pmask[b, P - len(p):] = torch.tensor(p), 1
        n = len(s.token_ids)
        rid[b, :n], rmask[b, :n], logp[b, :n] = torch.tensor(s.token_ids), 1.0, torch.tensor(s.logprobs)
    batch = RolloutBatch(pid, pmask, rid, rmask, torch.arange(B), torch.zeros(B, dtype=torch.bool), pad_id=PAD)
    ref, _ = reference_logprobs(model, batch)
    torch.testing.assert_close(logp, ref, atol=1e-4, rtol=0)


def test_a_seeded_request_does_not_depend_on_what_else_runs(model):
    def req(**kw):
        return Request(id="me", prompt_ids=prompts()[3], n=3, max_new_tokens=12, temperature=0.9, top_p=0.95,
                       top_k=20, seed=7, **kw)
    alone = run(engine(model, eos=NEVER), [req()])["me"]
    others = [Request(id=f"o{i}", prompt_ids=p, n=2, max_new_tokens=b, temperature=1.0, seed=100 + i)
              for i, (p, b) in enumerate(zip(prompts(seed=1), BUDGETS))]
    mixed = run(engine(model, eos=NEVER, max_batch_size=3, steps_per_call=1), others[:3] + [req()] + others[3:])["me"]
    assert [s.token_ids for s in alone.samples] == [s.token_ids for s in mixed.samples]
    assert len({tuple(s.token_ids) for s in alone.samples}) > 1  # samples k differ from each other
    for a, b in zip(alone.samples, mixed.samples):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    other_seed = run(engine(model, eos=NEVER), [Request(**{**req().to_wire(), "seed": 8})])["me"]
    assert [s.token_ids for s in other_seed.samples] != [s.token_ids for s in alone.samples]


def test_stop_tokens_eos_and_budget(model):
    free = run(engine(model, eos=NEVER), greedy_requests())
    row = free["r3"].samples[0].token_ids
    stop = row[3]
    n = row.index(stop) + 1
    by_stop = run(engine(model, eos=NEVER), greedy_requests(stop_token_ids=[stop]))["r3"].samples[0]
    by_eos = run(engine(model, eos=stop), greedy_requests())["r3"].samples[0]
    for s in (by_stop, by_eos):
        assert s.finish_reason == "stop" and s.token_ids == row[:n] and s.token_ids[-1] == stop
    assert free["r3"].samples[0].finish_reason == "length" and len(row) == BUDGETS[3]
    ignored = run(engine(model, eos=stop), greedy_requests(ignore_eos=True))["r3"].samples[0]
    assert ignored.finish_reason == "length" and ignored.token_ids == row
    # a budget past max_seq_len is cut there
    cut = run(engine(model, eos=NEVER, max_seq_len=12), greedy_requests())["r3"].samples[0]
    assert cut.finish_reason == "length" and cut.token_ids == row[:12 - LENGTHS[3]]
    with pytest.raises(ValueError, match="max_seq_len"):
        engine(model, max_seq_len=9).add(greedy_requests()[3])


def test_abort_a_running_and_a_queued_request(model):
    eng = engine(model, eos=NEVER, max_batch_size=2, steps_per_call=3)
    eng.add(Request(id="run", prompt_ids=prompts()[0], n=2, max_new_tokens=50, temperature=0.0))
    eng.add(Request(id="queued", prompt_ids=prompts()[1], n=2, max_new_tokens=5, temperature=0.0))
    assert eng.step() == []
    out = {c.id: c for c in eng.abort(["run", "queued", "unknown"])}
    assert set(out) == {"run", "queued"} and not eng.has_work()
    assert [s.finish_reason for s in out["run"].samples] == ["aborted", "aborted"]
    # one token from the prefill, one per decode step
    assert [len(s.token_ids) for s in out["run"].samples] == [4, 4]
    assert [len(s.logprobs) for s in out["run"].samples] == [4, 4]
    assert [(s.token_ids, s.finish_reason) for s in out["queued"].samples] == [([], "aborted")] * 2
    # the freed slots serve the next request as if nothing had happened
    after = run(eng, greedy_requests())
    assert after["r2"].samples[0].token_ids == slow_greedy(model, prompts()[2], BUDGETS[2])


def test_load_weights_changes_outputs_and_rejects_bad_tensors():
    a, b = tiny_model(seed=0), tiny_model(seed=1)
    eng = engine(a, eos=NEVER)
    before = run(eng, greedy_requests())
    want = run(engine(b, eos=NEVER), greedy_requests())
    eng.load_weights(list(b.state_dict().items())[:3])  # partial buckets are fine
    eng.load_weights(list(b.state_dict().items())[3:])
    eng.finish_weights()
    after = run(eng, greedy_requests())
    assert [c.samples[0].token_ids for c in after.values()] == [want[k].samples[0].token_ids for k in after]
    assert [c.samples[0].token_ids for c in after.values()] != [before[k].samples[0].token_ids for k in after]
    snapshot = {k: v.clone() for k, v in a.state_dict().items()}
    w = a.state_dict()["model.embed_tokens.weight"]
    for bad, name in [([("model.embed_tokens.weight", w), ("model.nope.weight", w)], "model.nope.weight"),
                      ([("lm_head.weight", w[:, :-1])], "lm_head.weight")]:
        with pytest.raises(EngineWeightError, match=name.replace(".", r"\.")) as e:
            eng.load_weights([(k, torch.zeros_like(v)) for k, v in bad])
        assert e.value.name == name
    assert all(torch.equal(v, snapshot[k]) for k, v in a.state_dict().items())  # a rejected bucket changes nothing


def test_sleep_wake_generate(model):
    eng = engine(model, eos=NEVER, max_batch_size=3)
    first = run(eng, greedy_requests())
    eng.sleep(2)
    assert eng._cache is None
    eng.add(greedy_requests()[0])
    with pytest.raises(EngineError, match="asleep"):
        eng.step()
    eng.wake(tags=["weights"])  # a partial wake readies the weights for a refit: the KV cache is still released
    with pytest.raises(EngineError, match="asleep"):
        eng.step()
    eng.abort(["r0"])
    eng.wake()
    again = run(eng, greedy_requests())
    assert_same(again, first)
    eng.add(greedy_requests()[1])
    eng.step()
    with pytest.raises(EngineError, match="running"):
        eng.sleep(1)


def test_training_mode_is_restored_and_info(model, tmp_path):
    model.train()
    eng = engine(model, max_batch_size=4)
    run(eng, greedy_requests())
    assert model.training
    assert eng.info() == dict(model="LlamaForCausalLM", vocab_size=VOCAB, max_batch_size=4, eos_id=EOS,
                              max_seq_len=128, sleep_releases={"1": ["kv_cache"], "2": ["kv_cache"]},
                              wake_tags=["weights", "kv_cache"])
    loaded = LocalEngine.from_path(save_model(model, tmp_path / "m"), max_batch_size=2)
    assert (loaded.eos_id, loaded.pad_id) == (EOS, PAD)
    assert_same(run(loaded, greedy_requests()), run(eng, greedy_requests()))


def test_sampling_distribution_top_k_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 2.5]])
    lp = sampling_logp(logits, 1.0, 1.0, 2)
    assert torch.isfinite(lp).sum(-1).tolist() == [2, 2]
    torch.testing.assert_close(lp[0, :2], torch.log_softmax(logits[0, :2], -1))
    # top_p is sample_next's rule: its reported log-probs are ours at the tokens it drew
    x = torch.randn(64, 30, generator=torch.Generator().manual_seed(0))
    tok, ref = sample_next(x, 0.7, 0.8, torch.Generator().manual_seed(1))
    torch.testing.assert_close(sampling_logp(x, 0.7, 0.8, 0).gather(1, tok[:, None]).squeeze(1), ref)


def test_inverse_cdf_draws_follow_the_distribution():
    logp = torch.log_softmax(torch.tensor([[2.0, float("-inf"), 1.0, 0.0, float("-inf")]]), -1).repeat(20000, 1)
    tok = inverse_cdf(logp, torch.rand(20000, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    freq = torch.bincount(tok, minlength=5).float() / len(tok)
    assert freq[1] == 0 and freq[4] == 0
    torch.testing.assert_close(freq, logp[0].exp(), atol=0.015, rtol=0)  # ~5 standard errors at n = 20000
    edge = inverse_cdf(logp[:3], torch.tensor([0.0, 1.0 - 1e-12, 1.0], dtype=torch.float64))
    assert edge.tolist() == [0, 3, 3]  # u rounding up to 1 never lands on a zero-mass tail token


def test_a_request_id_already_queued_or_running_is_refused(model):
    eng = engine(model, eos=NEVER, max_batch_size=1, steps_per_call=1)
    first, second = greedy_requests()[:2]
    eng.add(first)
    eng.add(second)
    assert eng.step() == []
    for rid in ("r0", "r1"):  # one running, one queued
        with pytest.raises(ValueError, match=f"request id '{rid}' is already queued or running"):
            eng.add(Request(id=rid, prompt_ids=[5], max_new_tokens=2, temperature=0.0))
    assert_same(run(eng, []), run(engine(model, eos=NEVER), [first, second]))


def test_a_checkpoint_with_several_eos_ids_stops_at_the_first(model, tmp_path):
    model.config.eos_token_id = [EOS, EOS + 1]
    try:
        path = save_model(model, tmp_path / "m")
    finally:
        model.config.eos_token_id = EOS
    loaded = LocalEngine.from_path(path)
    assert loaded.eos_id == EOS and loaded.pad_id == PAD
