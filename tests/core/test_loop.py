"""The step loop against fake backends: phases, counters, global token counts, advantages, resume, DP split."""
import copy
import itertools
import logging
import threading
import time

import pytest
import torch

from nemo_dapo.core.dynamic_sampling import BatchFiller, BudgetExhausted
from nemo_dapo.core.loop import DAPOLoop, LoopSettings
from nemo_dapo.core.loop_data import PromptSampler, PromptSet, balanced_split
from nemo_dapo.core.loop_eval import evaluate
from nemo_dapo.core.loss import make_loss_fn
from nemo_dapo.core.overlong import soft_overlong_penalty
from nemo_dapo.core.types import Generation, LossInput, RolloutBatch
from tests.support.loop_settings import loop_settings

EOS, PAD = 2, 0


class FakeGenerator:
    """Responses of random length in [min_len, max_new_tokens]; a response is 'correct' when its first token is even.

    ``policy`` (optional) shifts the draws by the policy's version, so results depend on the trained state.
    ``correct_prompts`` / ``wrong_prompts``: first prompt token values whose responses are always right / wrong.
    """

    def __init__(self, min_len=1, policy=None, correct_prompts=(), wrong_prompts=(), empty=False):
        self.min_len, self.policy, self.empty = min_len, policy, empty
        self.correct_prompts, self.wrong_prompts = set(correct_prompts), set(wrong_prompts)
        self.calls = 0

    def generate(self, prompt_ids, prompt_mask, *, max_new_tokens, temperature=1.0, top_p=1.0, seed=None):
        self.calls += 1
        version = self.policy.version if self.policy is not None else 0
        g = torch.Generator().manual_seed((seed or 0) + 1000 * version)
        b = prompt_ids.shape[0]
        lengths = torch.randint(self.min_len, max_new_tokens + 1, (b,), generator=g)
        if self.empty:
            lengths = torch.zeros(b, dtype=torch.long)
        width = int(lengths.max()) if b else 0
        ids = torch.randint(3, 50, (b, width), generator=g)
        for i, p in enumerate(prompt_ids[:, -1].tolist()):
            if width:
                ids[i, 0] = 4 if p in self.correct_prompts else 5 if p in self.wrong_prompts else ids[i, 0]
        mask = (torch.arange(width)[None] < lengths[:, None]).float()
        hit_eos = torch.rand(b, generator=g) < 0.7
        truncated = (lengths == max_new_tokens) & ~hit_eos
        ids = torch.where(mask > 0, ids, torch.full_like(ids, PAD))
        return Generation(response_ids=ids, response_mask=mask, truncated=truncated, logprobs=-mask)

    def update_weights(self, policy):
        pass


def fake_reward(response_ids, response_mask, ground_truths):
    first = torch.where(response_mask[:, 0] > 0, response_ids[:, 0], torch.ones_like(response_ids[:, 0])) \
        if response_ids.shape[1] else torch.ones(response_ids.shape[0], dtype=torch.long)
    acc = (first % 2 == 0).float()
    return acc * 2 - 1, acc, [str(int(x)) for x in first]


class FakePolicy:
    """Records every call; runs the real loss on log-probs equal to the old ones (ratio 1)."""

    def __init__(self, skip_calls=()):
        self.version, self.calls, self.skip_calls = 0, [], set(skip_calls)

    def logprobs(self, batch):
        mask = batch.response_mask
        return -0.5 * mask, 1.0 * mask

    def train_step(self, minibatch, *, norm, loss_fn):
        logp = minibatch.old_logp.clone().requires_grad_()
        loss, metrics = loss_fn(logp, torch.ones_like(logp), LossInput.of(minibatch), norm)
        loss.backward()
        self.calls.append((minibatch, norm))
        skipped = len(self.calls) in self.skip_calls
        if not skipped:
            self.version += 1
        return {"loss": float(loss), "grad_norm": float(logp.grad.norm()), "skipped": float(skipped),
                **{k: float(v) for k, v in metrics.items()}}

    def state_dict(self):
        return {"version": self.version}

    def load_state_dict(self, state):
        self.version = state["version"]


def prompt_set(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = [[1] + torch.randint(3, 60, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
           for _ in range(n)]
    return PromptSet(ids, [str(i) for i in range(n)], pad_id=PAD)


def make_loop(*, groups=4, group_size=4, mini=8, epochs=1, ds=False, max_new_tokens=12, loss=None,
              generator=None, policy=None, reducer=None, prompts=None, max_gen_batches=6, seed=3,
              on_budget_exhausted="train_partial", **settings):
    policy = policy or FakePolicy()
    generator = generator or FakeGenerator(policy=policy)
    s = loop_settings(group_size=group_size, mini_batch_size=mini, max_new_tokens=max_new_tokens, ppo_epochs=epochs,
                      seed=seed, **settings)
    filler = BatchFiller(groups, enabled=ds, max_gen_batches=max_gen_batches, on_budget_exhausted=on_budget_exhausted)
    loss = loss or make_loss_fn(eps_low=0.2, eps_high=0.28, clip_c=10.0)
    return DAPOLoop(policy=policy, generator=generator, reward_fn=fake_reward, loss_fn=loss,
                    prompts=prompts or prompt_set(), filler=filler, settings=s, reducer=reducer)


def steady(metrics):
    return {k: v for k, v in metrics.items() if not k.startswith(("timing/", "perf/"))}


# ---- the step -------------------------------------------------------------------------------------------------------
def test_step_counters_and_minibatch_coverage():
    loop = make_loop(groups=4, group_size=4, mini=6, epochs=2)
    m = loop.step()
    calls = loop.policy.calls
    # 16 samples -> mini-batches of 6, 6, 4 -> 3 updates per epoch, 2 epochs.
    assert len(calls) == 6
    assert m["counters/optimizer_steps"] == 6 and m["counters/rollout_steps"] == 1
    assert m["counters/gen_batches"] == 1 and m["counters/consumed_prompts"] == 4
    assert m["counters/consumed_samples"] == 16 and m["counters/trained_samples"] == 16
    for epoch in range(2):
        seen = sorted(int(u) for mb, _ in calls[3 * epoch:3 * epoch + 3] for u in mb.group_ids)
        assert seen == sorted([0, 1, 2, 3] * 4)  # every sample exactly once per epoch
    loop.step()
    assert loop.counters["rollout_steps"] == 2 and loop.counters["optimizer_steps"] == 12
    assert loop.counters["consumed_prompts"] == 8


def test_norm_is_the_global_minibatch_count_after_overlong_filtering():
    loss = make_loss_fn(eps_low=0.2, eps_high=0.28, overlong_filter=True)
    loop = make_loop(loss=loss, generator=FakeGenerator(min_len=8), mini=5)
    for _ in range(3):
        loop.step()
    assert any(bool(mb.truncated.any()) for mb, _ in loop.policy.calls)  # the filter had something to do
    for mb, norm in loop.policy.calls:
        expected = float((mb.response_mask * (~mb.truncated).float()[:, None]).sum())
        assert norm == expected


@pytest.mark.parametrize("settings, l_max, eps, scale", [
    ({}, 10, 1e-6, True),  # the defaults: the penalty from the generation cap
    ({"overlong": {"l_max": 8, "l_cache": 4}}, 8, 1e-6, True),  # an l_max of its own
    ({"scale_by_std": False}, 10, 1e-6, False),  # Dr. GRPO: centred only
    ({"adv_eps": 1.0}, 10, 1.0, True),
])
def test_advantages_are_group_normalised_shaped_rewards(settings, l_max, eps, scale):
    loop = make_loop(groups=3, group_size=5, mini=15, max_new_tokens=10, shuffle_minibatches=False, **settings)
    loop.step()
    (mb, _), = loop.policy.calls
    lengths = mb.response_mask.sum(-1).long()
    assert bool((lengths > l_max - 4).any())  # some responses are shaped
    score = mb.acc * 2 - 1
    shaped = score + soft_overlong_penalty(lengths, l_max=l_max, l_cache=4)
    assert torch.allclose(mb.rewards, shaped)
    # Slow obvious reference: loop over groups.
    for uid in mb.group_ids.unique():
        rows = mb.group_ids == uid
        r = shaped[rows]
        ref = (torch.zeros_like(r) if bool((r == r[0]).all()) else
               (r - r.mean()) / (r.std() + eps) if scale else r - r.mean())
        assert torch.allclose(mb.advantages[rows], ref, atol=1e-6)


def test_dynamic_sampling_refills_with_informative_groups_only():
    prompts = prompt_set(40)
    last = [p[-1] for p in prompts.prompt_ids]
    gen = FakeGenerator(correct_prompts=last[::3], wrong_prompts=last[1::3])
    loop = make_loop(ds=True, groups=6, generator=gen, prompts=prompts, mini=24)
    m = loop.step()
    (mb, _), = loop.policy.calls
    for uid in mb.group_ids.unique():
        acc = mb.acc[mb.group_ids == uid]
        assert 0 < float(acc.mean()) < 1
    assert m["filter/kept"] >= 6 and m["filter/filtered_all_correct"] + m["filter/filtered_all_wrong"] > 0
    assert m["counters/gen_batches"] == m["filter/num_gen_batches"]


def test_hopeless_prompts_exhaust_the_budget_by_policy(caplog):
    prompts = prompt_set(40)
    gen = FakeGenerator(wrong_prompts=[p[-1] for p in prompts.prompt_ids])
    with pytest.raises(BudgetExhausted, match="max_gen_batches"):
        make_loop(ds=True, generator=gen, prompts=prompts, max_gen_batches=2, on_budget_exhausted="raise").step()
    loop = make_loop(ds=True, generator=FakeGenerator(wrong_prompts=[p[-1] for p in prompts.prompt_ids]),
                     prompts=prompts, max_gen_batches=2)
    with caplog.at_level(logging.WARNING, logger="nemo_dapo"):
        m = loop.step()  # train_partial with nothing kept: the step is counted, no update is made
    assert loop.policy.calls == [] and m["counters/rollout_steps"] == 1 and m["counters/gen_batches"] == 2
    assert "no informative group" in caplog.text


def test_group_ids_are_unique_per_draw_even_for_repeated_prompts():
    prompts = PromptSet([[1, 7]] * 3, ["1"] * 3, pad_id=PAD)  # the same prompt three times
    loop = make_loop(groups=6, group_size=2, mini=12, prompts=prompts)
    loop.step()
    (mb, _), = loop.policy.calls
    ids = mb.group_ids.tolist()
    assert sorted(set(ids)) == list(range(6)) and all(ids.count(u) == 2 for u in set(ids))


def test_empty_responses_skip_the_update_instead_of_dividing_by_zero(caplog):
    loop = make_loop(generator=FakeGenerator(empty=True))
    with caplog.at_level(logging.WARNING, logger="nemo_dapo"):
        m = loop.step()
    assert loop.policy.calls == []
    assert m["counters/skipped_updates"] == 2 and m["counters/optimizer_steps"] == 0  # 16 samples / mini 8
    assert "without valid tokens" in caplog.text


class SlowRefit(FakeGenerator):
    def update_weights(self, policy):
        time.sleep(0.05)


def test_refit_time_is_logged_apart_from_the_other_phases():
    m = make_loop(generator=SlowRefit()).step()
    assert m["timing/refit_s"] >= 0.05  # the trainer's time in update_weights
    phases = sum(m[f"timing/{k}_s"] for k in ("gen", "reward", "old_logp", "update", "refit"))
    assert phases <= m["timing/step_s"]  # counted once, in its own phase
    nothing_kept = make_loop(generator=SlowRefit(wrong_prompts=range(60)), ds=True, max_gen_batches=1).step()
    assert nothing_kept["counters/optimizer_steps"] == 0 and nothing_kept["timing/refit_s"] == 0.0  # no refit


def test_nonfinite_update_reported_by_policy_is_counted_and_logged(caplog):
    loop = make_loop(policy=FakePolicy(skip_calls={1}))
    with caplog.at_level(logging.WARNING, logger="nemo_dapo"):
        m = loop.step()
    assert m["counters/skipped_updates"] == 1 and m["counters/optimizer_steps"] == 1
    assert m["actor/skipped"] == 1.0
    assert "non-finite" in caplog.text


def test_resume_from_state_dict_gives_the_same_metrics():
    a = make_loop(ds=True)
    a.step()
    state = copy.deepcopy(a.state_dict())
    expected = [steady(a.step()) for _ in range(2)]
    b = make_loop(ds=True)
    b.load_state_dict(state)
    got = [steady(b.step()) for _ in range(2)]
    assert got == expected
    c = make_loop(ds=True)  # the check can fail: without the state the next steps differ
    assert [steady(c.step()) for _ in range(2)] != expected


def test_settings_and_rank_errors_name_the_setting():
    with pytest.raises(ValueError, match="mini_batch_size"):
        loop_settings(group_size=2, mini_batch_size=0, max_new_tokens=8)
    # the block's own rule (core/settings.problems), against the cap that a null l_max stands for
    with pytest.raises(ValueError, match=r"LoopSettings.overlong.l_cache must be an integer in \(0, l_max=8\)"):
        loop_settings(group_size=2, mini_batch_size=4, max_new_tokens=8, overlong={"l_cache": 9})
    with pytest.raises(TypeError):  # no field has a default here: the YAML holds them
        LoopSettings(group_size=2, mini_batch_size=4, max_new_tokens=8)

    class TwoRanks:
        rank, world_size = 0, 2
    with pytest.raises(ValueError, match="mini_batch_size=1"):
        make_loop(mini=1, reducer=TwoRanks())


# ---- data parallelism (two ranks in two threads) --------------------------------------------------------------------
class ThreadReducer:
    """A Reducer over threads: every collective is a gather of all ranks' values through a shared list."""

    def __init__(self, rank, world_size, shared, barrier):
        self.rank, self.world_size, self._shared, self._barrier = rank, world_size, shared, barrier

    def gather_objects(self, obj):
        self._barrier.wait()
        self._shared[self.rank] = obj
        self._barrier.wait()
        out = list(self._shared)
        self._barrier.wait()
        return out

    def sum(self, x):
        return sum(torch.as_tensor(v) for v in self.gather_objects(x))

    def max(self, x):
        return torch.stack([torch.as_tensor(v) for v in self.gather_objects(x)]).max(0).values


def test_two_ranks_share_filler_state_and_split_minibatches_by_tokens():
    world, shared, barrier = 2, [None, None], threading.Barrier(2)
    loops = [make_loop(ds=True, groups=4, mini=8, reducer=ThreadReducer(r, world, shared, barrier))
             for r in range(world)]
    errors = []

    def run(loop):
        try:
            for _ in range(2):
                loop.step()
        except Exception as e:  # noqa: BLE001 - surfaced below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(lp,)) for lp in loops]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    f0, f1 = (lp.filler.state_dict() for lp in loops)
    assert [g["uid"] for g in f0["groups"]] == [g["uid"] for g in f1["groups"]]
    assert loops[0].counters == loops[1].counters
    calls0, calls1 = loops[0].policy.calls, loops[1].policy.calls
    assert len(calls0) == len(calls1) > 0
    for (mb0, n0), (mb1, n1) in zip(calls0, calls1):
        t0, t1 = mb0.lengths.tolist(), mb1.lengths.tolist()
        assert n0 == n1 == sum(t0) + sum(t1)  # both ranks normalise by the same global count
        assert abs(sum(t0) - sum(t1)) <= max(t0 + t1)  # greedy balance: within one sample
        assert len(mb0) + len(mb1) == 8
    for step in range(2):  # 16 samples = 2 mini-batches per step; together the ranks train each sample once
        uids = [u for mb, _ in calls0[2 * step:2 * step + 2] + calls1[2 * step:2 * step + 2]
                for u in mb.group_ids.tolist()]
        assert len(set(uids)) == 4 and all(uids.count(u) == 4 for u in set(uids))


class OneRankOf:
    """The reducer one rank of ``world`` sees; enough for splitting a batch into mini-batch shares."""

    def __init__(self, rank, world):
        self.rank, self.world_size = rank, world


def test_a_last_mini_batch_smaller_than_the_world_joins_the_one_before():
    n = 9  # mini-batches of 8 and 1: the 1 cannot give each of 2 ranks a row
    batch = RolloutBatch(prompt_ids=torch.ones(n, 2, dtype=torch.long), prompt_mask=torch.ones(n, 2, dtype=torch.long),
                         response_ids=torch.ones(n, 3, dtype=torch.long), response_mask=torch.ones(n, 3),
                         group_ids=torch.arange(n), truncated=torch.zeros(n, dtype=torch.bool))
    shares = [make_loop(mini=8, reducer=OneRankOf(rank, 2), shuffle_minibatches=False)._minibatch_shares(batch)
              for rank in (0, 1)]
    assert [len(s) for s in shares] == [1, 1]  # one update, every row in it
    assert all(s[0] for s in shares) and sorted(shares[0][0] + shares[1][0]) == list(range(n))


# ---- prompt sampler, prompt set, balanced split ---------------------------------------------------------------------
def test_prompt_sampler_epochs_are_permutations_and_state_resumes():
    s = PromptSampler(7, seed=5)
    first, uids = s.draw(10)
    assert sorted(first[:7]) == list(range(7)) and uids == list(range(10))
    assert s.epoch == 1 and s.position == 3 and s.consumed == 10
    state = s.state_dict()
    expected = [s.draw(4) for _ in range(3)]
    t = PromptSampler(7, seed=5)
    t.load_state_dict(state)
    assert [t.draw(4) for _ in range(3)] == expected
    assert PromptSampler(7, seed=6).draw(7)[0] != PromptSampler(7, seed=5).draw(7)[0]
    with pytest.raises(ValueError, match="same data"):
        PromptSampler(8, seed=5).load_state_dict(state)


def test_prompt_set_collate_left_pads_and_rejects_bad_input():
    ps = PromptSet([[1, 5, 6], [1, 7]], ["3", "4"], pad_id=0)
    ids, mask = ps.collate([1, 0])
    assert ids.tolist() == [[0, 1, 7], [1, 5, 6]] and mask.tolist() == [[0, 1, 1], [1, 1, 1]]
    with pytest.raises(ValueError, match="empty"):
        PromptSet([], [])
    with pytest.raises(ValueError, match="ground truths"):
        PromptSet([[1]], ["1", "2"])
    with pytest.raises(ValueError, match="prompt 1 has no tokens"):
        PromptSet([[1], []], ["1", "2"])


def _best_max_load(tokens, world):
    """Slow reference: the optimal largest rank load over every assignment."""
    best = float("inf")
    for assign in itertools.product(range(world), repeat=len(tokens)):
        loads = [0] * world
        for t, r in zip(tokens, assign):
            loads[r] += t
        best = min(best, max(loads))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_balanced_split_is_a_partition_close_to_optimal(seed):
    g = torch.Generator().manual_seed(seed)
    n, world = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
    tokens = torch.randint(0, 30, (n,), generator=g).tolist()
    shares = balanced_split(tokens, world)
    assert len(shares) == world and sorted(i for s in shares for i in s) == list(range(n))
    assert all(s == sorted(s) for s in shares)
    largest = max(sum(tokens[i] for i in s) for s in shares)
    assert largest <= 4 / 3 * _best_max_load(tokens, world) + 1e-9
    assert balanced_split(tokens, world) == shares  # deterministic: every rank computes the same split


def test_balanced_split_spreads_samples_when_tokens_tie():
    shares = balanced_split([0, 0, 0, 0], 2)
    assert sorted(len(s) for s in shares) == [2, 2]
    assert balanced_split([10, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2) == [[0], list(range(1, 11))]
    with pytest.raises(ValueError, match="world_size"):
        balanced_split([1], 0)


# ---- evaluation -----------------------------------------------------------------------------------------------------
class PromptEcho:
    """Deterministic per row: answers with the prompt's last token, so results cannot depend on batching."""

    def generate(self, prompt_ids, prompt_mask, *, max_new_tokens, temperature=1.0, top_p=1.0, seed=None):
        ids = prompt_ids[:, -1:].clone()
        return Generation(response_ids=ids, response_mask=torch.ones_like(ids, dtype=torch.float),
                          truncated=torch.zeros(len(ids), dtype=torch.bool))

    def update_weights(self, policy):
        pass


def test_evaluate_accuracy_is_the_mean_over_samples_and_batching_free():
    ps = prompt_set(9)
    a = evaluate(PromptEcho(), fake_reward, ps, n_samples=3, max_new_tokens=4, batch_size=1)
    b = evaluate(PromptEcho(), fake_reward, ps, n_samples=3, max_new_tokens=4, batch_size=256)
    expected = sum(p[-1] % 2 == 0 for p in ps.prompt_ids) / 9
    assert a.acc.shape == (9, 3) and abs(a.accuracy - expected) < 1e-6
    assert torch.equal(a.acc, b.acc) and a.preds == b.preds
    assert a.summary()["val/problems"] == 9.0
    with pytest.raises(ValueError, match="n_samples"):
        evaluate(PromptEcho(), fake_reward, ps, n_samples=0, max_new_tokens=4)


def test_rollout_batch_payloads_survive_torch_save(tmp_path):
    loop = make_loop(ds=True, groups=5, mini=40)
    loop.step()
    path = tmp_path / "state.pt"
    torch.save(loop.state_dict(), path)
    state = torch.load(path, weights_only=False)
    assert state["filler"]["groups"], "expected surplus groups carried to the next step"
    for g in state["filler"]["groups"]:
        assert isinstance(g["payload"], RolloutBatch) and len(g["payload"]) == 4


# ---- history-based prompt skipping ---------------------------------------------------------------------------------
class RecordingGenerator(FakeGenerator):
    """Also records the last prompt token of every generated row (prompts below make it the prompt index + 10)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.generated = []

    def generate(self, prompt_ids, prompt_mask, **kw):
        self.generated.append(sorted(set(int(t) - 10 for t in prompt_ids[:, -1])))
        return super().generate(prompt_ids, prompt_mask, **kw)


def _skip_loop(**kw):
    n = 12
    prompts = PromptSet([[1, 10 + i] for i in range(n)], [str(i) for i in range(n)], pad_id=PAD)
    gen = RecordingGenerator(correct_prompts=[10 + i for i in range(0, n, 2)])  # even prompts: always all-correct
    loop = make_loop(ds=True, groups=3, group_size=4, mini=12, prompts=prompts, generator=gen,
                     skip_history={"enabled": True, "skip_prob": 0.9, "max_skips": 2}, **kw)
    return loop, gen


def test_skipped_prompts_are_not_generated_and_are_counted():
    loop, gen = _skip_loop()
    accepted, skipped = [], []
    consider = loop.sampler.history.consider

    def recording_consider(index):
        out = consider(index)
        (skipped if out else accepted[-1]).append(index)
        return out

    loop.sampler.history.consider = recording_consider
    draw = loop.sampler.draw
    loop.sampler.draw = lambda n: (accepted.append([]), draw(n))[1]
    total_skipped = 0
    for _ in range(8):
        m = loop.step()
        total_skipped += m["rollout/skipped_prompts"]
    assert total_skipped > 0 and loop.counters["skipped_prompts"] == total_skipped == len(skipped)
    # Each generate call saw exactly the prompts the sampler accepted, never one it passed over instead.
    assert gen.generated == [sorted(set(a)) for a in accepted]
    assert sum(i % 2 == 0 for i in skipped) > 0.8 * len(skipped)  # the all-correct prompts are the skipped ones
    groups = loop.counters["trained_samples"] / 4
    assert m["rollout/responses_per_trained_group"] == pytest.approx(loop.counters["consumed_samples"] / groups)


def test_skipping_off_generates_every_drawn_prompt():
    loop, gen = _skip_loop()
    loop.sampler.history = None  # the same loop without skipping (default settings leave it None)
    for _ in range(4):
        m = loop.step()
    assert m["counters/skipped_prompts"] == 0 and m["rollout/skipped_prompts"] == 0
    assert make_loop().sampler.history is None


def test_resume_restores_the_prompt_history():
    a, _ = _skip_loop()
    for _ in range(4):
        a.step()
    state = copy.deepcopy(a.state_dict())
    assert state["sampler"]["history"]["streak"]  # the history is in the checkpoint
    expected = [steady(a.step()) for _ in range(3)]
    b, _ = _skip_loop()
    b.load_state_dict(state)
    assert b.sampler.history.streak == {k: v for k, v in state["sampler"]["history"]["streak"]}
    assert [steady(b.step()) for _ in range(3)] == expected
    c, _ = _skip_loop()  # the check can fail: the same position without the history decides differently
    state_c = copy.deepcopy(state)
    del state_c["sampler"]["history"]
    c.load_state_dict(state_c)
    assert [steady(c.step()) for _ in range(3)] != expected
