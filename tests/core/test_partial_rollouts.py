"""Partial rollouts (core/partial.py, DAPOLoop with on_filler_full='suspend'): suspended groups keep their tokens,
log-probs and per-token weight versions, continue after the refit, are dropped past max_staleness, survive a
checkpoint; max_staleness 0 is the abort loop bit for bit. The engine is the toy adapter driven in this process
(tests/support/inprocess_client.py), so every run takes the same path."""
import pytest
import torch

from nemo_dapo.core.checkpoint import load_checkpoint, save_checkpoint
from nemo_dapo.core.loop import DAPOLoop
from nemo_dapo.core.partial import (SampleState, SuspendedGroup, complete, continuation_requests, split_stale,
                                    suspend)
from nemo_dapo.core.types import Generation
from nemo_dapo.engines.base import Completion, Sample
from nemo_dapo.engines.generator import EngineGenerator
from tests.core.test_loop import FakePolicy, fake_reward, make_loop, steady
from tests.engines.toy_engine import ToyEngine
from tests.support.inprocess_client import InProcessClient

EOS, MAX_NEW = 49, 40


LENGTHS = [3, 3, 4, 3, 5, 3, 4, 40]  # sample j of a request of seed s stops after LENGTHS[(s + j) % 8] tokens


class VersionedToy(ToyEngine):
    """The toy engine whose log-prob of every token says which weights drew it (-0.5 - 0.01 * w[0]), and whose
    lengths are long-tailed and follow the request's seed (not the engine's history: a resumed run sees the same)."""

    def add(self, request):
        super().add(request)
        caps = self.queue[-1][3]
        caps[:] = [min(c, LENGTHS[(request.seed + j) % len(LENGTHS)]) for j, c in enumerate(caps)]

    def _completion(self, rid, how):
        c = super()._completion(rid, how)
        lp = -0.5 - 0.01 * float(self.w[0])
        return Completion(c.id, [Sample(s.token_ids, [lp] * len(s.token_ids), s.finish_reason) for s in c.samples])


class PushingPolicy(FakePolicy):
    """The fake policy; each refit pushes w[0] = its update count (so each weight version samples other tokens)."""

    def __init__(self):
        super().__init__()
        self.pushed = []

    def hf_weight_buckets(self, bucket_bytes):
        self.pushed.append(float(self.version % 40))
        yield [("w", torch.tensor([self.pushed[-1], 0.0, 0.0, 0.0]))]


def loop_with(on_filler_full="suspend", max_staleness=1, groups=4, seed=3, tis_cap=2.0, round_tokens=None,
              reject_logp_diff=None, **settings):
    """Partial rollouts through the toy engine; ``settings``: more ``make_loop`` keywords."""
    from nemo_dapo.core.loss import make_loss_fn

    policy = PushingPolicy()
    gen = EngineGenerator(InProcessClient(VersionedToy()), eos_id=EOS, pad_id=0)
    base = make_loop(generator=gen, policy=policy, ds=True, groups=groups, group_size=4, mini=8,
                     max_new_tokens=MAX_NEW, streaming=True, on_filler_full=on_filler_full, seed=seed,
                     loss=make_loss_fn(eps_low=0.2, eps_high=0.28, clip_c=10.0, tis_cap=tis_cap,
                                       reject_logp_diff=reject_logp_diff), **settings)
    return DAPOLoop(policy=policy, generator=gen, reward_fn=base.reward_fn, loss_fn=base.loss_fn,
                    prompts=base.prompts, filler=base.filler, settings=base.settings, max_staleness=max_staleness,
                    round_tokens=round_tokens)


def trained(loop, step_calls):
    """Rows of the mini-batches the policy trained on since ``step_calls``."""
    return [mb for mb, _ in loop.policy.calls[step_calls:]]


# ---- the bookkeeping ------------------------------------------------------------------------------------------------
def gen_rows(rows, finished):
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask, lp = torch.zeros(len(rows), width), torch.zeros(len(rows), width)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = torch.tensor(r)
        mask[b, :len(r)] = 1
        lp[b, :len(r)] = -0.1 * (b + 1)
    return Generation(ids, mask, truncated=torch.tensor([r[-1] != EOS for r in rows]), logprobs=lp,
                      finished=torch.tensor(finished))


def test_suspend_continue_complete_keeps_tokens_logprobs_and_versions():
    g = suspend(gen_rows([[5, 6, 49], [7, 8], [9]], [True, False, False]), 0, index=2, uid=11, seed=77)
    assert g.unfinished() == [1, 2] and g.oldest_version() == 0 and g.num_tokens() == 6
    reqs = continuation_requests(g, [1, 2], max_new_tokens=5)
    assert [(p, n, budget) for p, n, budget, _ in reqs] == [([1, 2, 7, 8], 1, 3), ([1, 2, 9], 1, 4)]
    assert len({seed for *_, seed in reqs}) == 2  # each continued sample draws from a stream of its own
    g.resumes += 1
    again = suspend(gen_rows([[10, 49], [11]], [True, False]), 1, index=2, uid=11, seed=77, prior=g)
    assert again.unfinished() == [2] and again.samples[1].versions == [0, 0, 1, 1]
    assert continuation_requests(again, [1, 2], 5)[0][3] != reqs[1][3]  # a new seed for each resubmission
    out = complete(again, gen_rows([[12, 49]], [True]), 2, pad_id=0)
    assert out.response_ids.tolist() == [[5, 6, 49, 0], [7, 8, 10, 49], [9, 11, 12, 49]]
    assert out.token_version.tolist()[1:] == [[0, 0, 1, 1], [0, 1, 2, 2]]
    assert out.response_mask.sum(-1).tolist() == [3, 4, 4]
    torch.testing.assert_close(out.logprobs[2, :4], torch.tensor([-0.3, -0.2, -0.1, -0.1]))
    assert out.truncated.tolist() == [False, False, False]  # every sample ended with EOS


def test_a_suspended_sample_at_the_cap_counts_as_finished_and_states_round_trip():
    g = suspend(gen_rows([[5, 6], [7]], [False, False]), 3, index=0, uid=1, seed=5, max_new_tokens=2)
    assert g.unfinished() == [1] and g.samples[0].finish == "length"
    g.resumes = 2  # every field differs from its default
    assert SuspendedGroup.from_state(g.to_state()) == g


def test_split_stale_drops_groups_whose_oldest_token_is_too_old():
    fresh = SuspendedGroup(0, 1, 0, [SampleState([], [], [])])  # nothing generated yet: never stale
    old = SuspendedGroup(0, 2, 0, [SampleState([4, 5], [0.0, 0.0], [1, 2])])
    keep, drop = split_stale([fresh, old], version=3, max_staleness=1)
    assert keep == [fresh] and drop == [old]
    assert split_stale([old], version=3, max_staleness=2) == ([old], [])
    # every sample finished (overlap: during the update): nothing continues it, its span (1) is final
    done = SuspendedGroup(0, 3, 0, [SampleState([4, 5], [0.0, 0.0], [1, 2], "stop")])
    assert split_stale([done], version=9, max_staleness=1) == ([done], [])


# ---- the loop -------------------------------------------------------------------------------------------------------
def test_suspended_groups_continue_after_the_refit_with_per_token_versions_and_logprobs():
    loop = loop_with()
    m1 = loop.step()
    assert m1["rollout/aborted_tokens"] == 0 and m1["partial/suspended_groups"] > 0
    assert m1["partial/suspended_tokens"] > 0 and m1["partial/weight_version"] == 1
    held = {g.uid for g in loop._suspended}
    calls = len(loop.policy.calls)
    m2 = loop.step()
    assert m2["partial/resumed_groups"] == len(held) and m2["partial/stale_groups"] == 0
    rows = trained(loop, calls)
    resumed = [mb for mb in rows if any(int(u) in held for u in mb.group_ids)]
    assert resumed, "a resumed group reached the update"
    offsets = [0.0] + loop.policy.pushed  # w[0] of weight version v
    spans = set()
    for mb in rows:
        valid = mb.response_mask.bool()
        versions = mb.token_version[valid]
        expected = -0.5 - 0.01 * torch.tensor(offsets)[versions]
        torch.testing.assert_close(mb.engine_logp[valid], expected)  # each token's log-prob is its sampler's
        for b in range(len(mb)):
            spans.add(tuple(sorted(set(mb.token_version[b][valid[b]].tolist()))))
    assert (0, 1) in spans  # a response begun by version 0 and finished by version 1
    assert 0 < m2["partial/trained_stale_token_frac"] < 1 and m2["partial/trained_lag_max"] == 1


def test_every_generated_token_is_trained_held_or_counted_as_dropped():
    loop = loop_with(max_staleness=1)
    responses = 0.0
    for _ in range(5):
        m = loop.step()
        responses += m["response/tokens"]
    c, p = loop.counters, loop.partial_counters
    held = sum(g.num_tokens() for g in loop._suspended)
    assert c["generated_tokens"] == responses + held + p["stale_tokens"] + c["aborted_tokens"]
    assert c["aborted_tokens"] == 0
    assert m["partial/discarded_token_frac"] == p["stale_tokens"] / c["generated_tokens"]


def test_groups_older_than_max_staleness_are_dropped_and_counted():
    loop = loop_with(max_staleness=1)
    loop.step()
    held = list(loop._suspended)
    assert held and all(g.oldest_version() == 0 for g in held)
    loop.generator.update_weights(loop.policy)  # a second refit before they could continue: now 2 versions old
    loop._version += 1
    m = loop.step()
    assert m["partial/stale_groups"] == len(held) and m["partial/resumed_groups"] == 0
    assert m["partial/stale_tokens"] == sum(g.num_tokens() for g in held) > 0
    assert m["partial/discarded_token_frac"] > 0


def test_max_staleness_0_is_the_abort_loop_bit_for_bit():
    runs = []
    for mode, staleness in (("abort", 1), ("suspend", 0)):
        loop = loop_with(on_filler_full=mode, max_staleness=staleness)
        runs.append(([steady(loop.step()) for _ in range(3)], loop))
    (ma, a), (ms, s) = runs
    assert ma == ms and ma[0]["rollout/aborted_tokens"] > 0  # the abort had work to throw away
    assert len(a.policy.calls) == len(s.policy.calls)
    for (x, nx), (y, ny) in zip(a.policy.calls, s.policy.calls):
        assert nx == ny
        for f in ("response_ids", "response_mask", "engine_logp", "old_logp", "advantages", "group_ids"):
            assert torch.equal(getattr(x, f), getattr(y, f)), f
    assert not any(k.startswith("partial/") for k in ma[0])  # no new metrics outside partial rollouts
    genuine = loop_with(on_filler_full="suspend", max_staleness=1).step()
    assert genuine["rollout/aborted_tokens"] == 0 and genuine["partial/suspended_tokens"] > 0


def test_suspended_work_survives_a_checkpoint_and_continues_as_uninterrupted(tmp_path):
    a = loop_with()
    a.step()
    path = save_checkpoint(str(tmp_path), 1, {"loop": a.state_dict()})
    state = load_checkpoint(path)["loop"]  # the safe loader of every checkpoint
    assert state["partial"]["suspended"]
    b = loop_with()
    b.load_state_dict(state)
    assert b._version == a._version and len(b._suspended) == len(a._suspended)
    ma, mb = steady(a.step()), steady(b.step())
    assert ma == mb and ma["partial/resumed_groups"] == len(state["partial"]["suspended"])


def test_suspend_needs_a_generator_that_takes_explicit_requests():
    with pytest.raises(ValueError, match="stream_requests"):
        base = make_loop()
        DAPOLoop(policy=base.policy, generator=base.generator, reward_fn=base.reward_fn, loss_fn=base.loss_fn,
                 prompts=base.prompts, filler=base.filler,
                 settings=make_loop(on_filler_full="suspend").settings, max_staleness=1)
    with pytest.raises(ValueError, match="max_staleness must be an int >= 0"):
        base = make_loop()
        DAPOLoop(policy=base.policy, generator=base.generator, reward_fn=base.reward_fn, loss_fn=base.loss_fn,
                 prompts=base.prompts, filler=base.filler, settings=base.settings, max_staleness=-1)


# ---- overlap (one-step-off) -----------------------------------------------------------------------------------------
class BusyPolicy(PushingPolicy):
    """PushingPolicy whose every update lets the engine take ``steps`` decode steps first: the engine generating
    while the trainer trains, made deterministic (the in-process client steps only when asked)."""

    def __init__(self, steps=3):
        super().__init__()
        self.steps, self.client = steps, None

    def train_step(self, minibatch, *, norm, loss_fn):
        for _ in range(self.steps):
            if self.client.adapter.has_work():
                self.client.ready.extend(self.client.adapter.step())
        return super().train_step(minibatch, norm=norm, loss_fn=loss_fn)


def overlap_loop(seed=3, steps=3, fill_order="finish", reward_fn=None, **settings):
    """The overlap (engine steps during each update: ``BusyPolicy``), in rounds of 4 tokens in prompt order."""
    loop = loop_with(seed=seed, fill_order=fill_order, round_tokens=4 if fill_order == "prompt" else None, **settings)
    policy = BusyPolicy(steps)
    policy.client = loop.generator.client
    return DAPOLoop(policy=policy, generator=loop.generator, reward_fn=reward_fn or loop.reward_fn,
                    loss_fn=loop.loss_fn, prompts=loop.prompts, filler=loop.filler, settings=loop.settings,
                    max_staleness=1, overlap=True, round_tokens=loop.round_tokens)


def test_the_overlap_logs_the_responses_the_loss_left_out_as_counted_in_the_trained_mini_batches():
    """algorithm.reject_logp_diff through the step loop: the toy engine's log-probs say which weights drew a token
    (0.01 a version below the fake trainer's), so the responses that later weights sampled are left out, and each
    step logs actor/rejected, the mean over its updates of the rows the loss left out of each mini-batch."""
    from nemo_dapo.core.loss import rejection_keep

    loop = overlap_loop(fill_order="prompt", reject_logp_diff=0.005)
    total = rejected = 0
    for _ in range(3):
        calls = len(loop.policy.calls)
        m = loop.step()
        counts = []
        for mb in trained(loop, calls):
            valid = mb.response_mask.bool().any(-1)
            keep = rejection_keep(mb.old_logp, mb.engine_logp, mb.response_mask, 0.005)
            counts.append(int((valid & ~keep).sum()))
            total += int(valid.sum())
        assert m["actor/rejected"] == pytest.approx(sum(counts) / len(counts))
        rejected += sum(counts)
    assert 0 < rejected < total  # the first version's responses stay, later ones go


def test_overlap_generates_during_the_update_and_trains_that_work_one_version_later():
    loop = overlap_loop()
    m1 = loop.step()
    assert not loop._live and loop._suspended  # parked before the refit: nothing runs past a step
    finished_early = [g for g in loop._suspended if not g.unfinished()]
    assert finished_early and all(g.oldest_version() == 0 for g in loop._suspended)  # drawn by version 0
    drawn_ahead = loop._drawn_ahead
    calls = len(loop.policy.calls)
    m2 = loop.step()
    assert m2["partial/resumed_groups"] >= len(finished_early)
    uids = {int(u) for mb in trained(loop, calls) for u in mb.group_ids}
    assert {g.uid for g in finished_early} & uids  # work done during the update was trained next step ...
    assert m2["partial/trained_lag_max"] == 1  # ... one version later, within max_staleness
    assert "partial/logp_mismatch_fresh" in m1 and "partial/logp_mismatch_stale" not in m1  # split by lag
    assert "partial/logp_mismatch_stale" in m2
    assert drawn_ahead > 0  # the next batch was drawn early, counted when step 2 began
    assert m2["counters/consumed_prompts"] >= m1["counters/consumed_prompts"] + drawn_ahead


def test_overlap_accounts_for_every_generated_token_and_resumes_as_uninterrupted(tmp_path):
    loop = overlap_loop()
    responses = 0.0
    for _ in range(4):
        responses += loop.step()["response/tokens"]
    c, p = loop.counters, loop.partial_counters
    held = sum(g.num_tokens() for g in loop._suspended)
    assert c["generated_tokens"] == responses + held + p["stale_tokens"] + c["aborted_tokens"]
    path = save_checkpoint(str(tmp_path), 4, {"loop": loop.state_dict()})
    again = overlap_loop()
    again.load_state_dict(load_checkpoint(path)["loop"])
    assert steady(loop.step()) == steady(again.step())


def test_overlap_needs_partial_rollouts():
    loop = loop_with(on_filler_full="abort")
    with pytest.raises(ValueError, match="overlap needs partial rollouts"):
        DAPOLoop(policy=loop.policy, generator=loop.generator, reward_fn=loop.reward_fn, loss_fn=loop.loss_fn,
                 prompts=loop.prompts, filler=loop.filler, settings=loop.settings, max_staleness=1, overlap=True)


@pytest.mark.parametrize("extra", [["rollout.on_filler_full=abort"], ["rollout.max_staleness=0"],
                                   ["rollout.server.sleep_level=1"]])
def test_the_cpu_config_refuses_overlap_without_partial_rollouts_or_with_a_sleeping_engine(extra):
    from nemo_dapo.local.config import ConfigError, load_config

    keys = ["rollout.engine=local", "rollout.streaming=true", "rollout.on_filler_full=suspend",
            "algorithm.tis_cap=2.0", "rollout.overlap=true"]
    assert load_config("tiny_cpu", keys).rollout.overlap is True
    with pytest.raises(ConfigError, match="rollout.overlap"):
        load_config("tiny_cpu", keys + extra)


def test_overlap_trains_groups_finished_during_the_update_and_bounds_every_responses_span():
    loop, late, trained_late, spans = overlap_loop(), set(), set(), []
    for _ in range(6):
        before = len(loop.policy.calls)
        loop.step()
        for mb in trained(loop, before):
            trained_late |= late & {int(u) for u in mb.group_ids}
            for versions, mask in zip(mb.token_version, mb.response_mask):  # each trained response's span
                v = versions[mask.bool()]
                spans.append(int(v.max() - v.min()) if v.numel() else 0)
        # finished during this update, the oldest token already past the bound for the next weights
        late = {g.uid for g in loop._suspended if not g.unfinished()
                and loop._version - g.oldest_version() > loop.max_staleness}
    assert max(spans) <= loop.max_staleness  # every trained response spans at most max_staleness versions
    assert trained_late  # such groups were trained in the next step, not dropped as stale


def test_overlap_holds_the_next_batch_that_the_filler_asks_for_no_more():
    """Finishing order: the groups still running when the batch fills count toward the next step's batch, and the
    overlap draws only the rest of it (see test_fill_order for prompt order)."""
    loop, asked = overlap_loop(), []
    share = loop._ahead_share

    def watched(carried):
        asked.append((carried, loop.filler.next_step_gen_batch_size()))
        return share(carried)
    loop._ahead_share = watched
    for _ in range(3):
        loop.step()
        carried, size = asked[-1]
        assert len(loop._suspended) == max(size, carried)  # parked before the refit: all of the next batch
    assert any(size > carried > 0 for carried, size in asked)


def test_overlap_draws_ahead_only_for_a_step_that_the_callers_budget_runs():
    """The sample budget ends an overlapped run where it ends the synchronous loop: the next step runs while
    consumed_samples is below it, and only then is its batch drawn ahead (counted when that step begins)."""
    plain = int(loop_with(seed=3).step()["counters/consumed_samples"])
    last = overlap_loop()
    assert last.step(sample_cap=0)["counters/consumed_samples"] == plain and last._drawn_ahead == 0  # the last step
    spent = overlap_loop()
    assert spent.step(sample_cap=plain)["counters/consumed_samples"] == plain and spent._drawn_ahead == 0
    more = overlap_loop()
    assert more.step(sample_cap=plain + 1)["counters/consumed_samples"] == plain  # the next step runs ...
    ahead = more._drawn_ahead
    assert ahead > 0  # ... so its batch was drawn
    m2 = more.step(sample_cap=plain + 1)
    assert m2["counters/consumed_samples"] >= plain + 4 * ahead and more._drawn_ahead == 0  # spent: nothing drawn


def even_prompts_solved(response_ids, response_mask, ground_truths):
    """The fake reward (first token even), except that prompts with an even ground truth are always solved: their
    groups are all correct, so the history has prompts to skip."""
    _, acc, answers = fake_reward(response_ids, response_mask, ground_truths)
    solved = torch.tensor([int(t) % 2 == 0 for t in ground_truths])
    acc = torch.where(solved, torch.ones_like(acc), acc)
    return acc * 2 - 1, acc, answers


def skipping_settings() -> dict:
    """``make_loop`` keywords for history-based prompt skipping over 6 prompts, so that prompts come round again
    (and get skipped) within a few steps; use with the reward ``even_prompts_solved``."""
    from tests.core.test_loop import prompt_set

    return dict(prompts=prompt_set(n=6), skip_history={"enabled": True, "skip_prob": 0.9, "max_skips": 2})


def skipping_overlap_loop(fill_order: str):
    """The overlap with history-based prompt skipping (``skipping_settings``)."""
    return overlap_loop(fill_order=fill_order, reward_fn=even_prompts_solved, **skipping_settings())


@pytest.mark.parametrize("fill_order", ["finish", "prompt"])
def test_overlap_keeps_history_based_prompt_skipping(fill_order, tmp_path):
    """Every group scored under the overlap (those drawn ahead and finished during the update included) updates the
    prompt history once, under its own prompt; prompts get skipped, also when drawn ahead; a checkpoint carries the
    history and resumes as uninterrupted."""
    loop = skipping_overlap_loop(fill_order)
    index_of, recorded, scored, ahead, skipped_ahead = {}, [], [], set(), []
    draw, record, add, draw_more = loop.sampler.draw, loop.sampler.history.record, loop.filler.add_groups, \
        loop._draw_more

    def recording_draw(n):
        indices, uids = draw(n)
        index_of.update(zip(uids, indices))
        return indices, uids

    def recording_draw_more(n):
        before = loop.sampler.skipped
        indices, uids = draw_more(n)
        ahead.update(uids)
        skipped_ahead.append(loop.sampler.skipped - before)
        return indices, uids

    loop.sampler.draw = recording_draw
    loop.sampler.history.record = lambda index, acc: (recorded.append((index, tuple(acc))), record(index, acc))[1]
    loop.filler.add_groups = lambda groups: (scored.extend(groups), add(groups))[1]
    loop._draw_more = recording_draw_more
    for _ in range(6):
        loop.step()
    assert sorted(recorded) == sorted((index_of[g.uid], tuple(g.acc.tolist())) for g in scored)
    assert ahead & {g.uid for g in scored}  # groups drawn ahead were scored and recorded too
    assert loop.counters["skipped_prompts"] > 0 and sum(skipped_ahead) > 0  # skipping also acts on the draw-ahead
    state = loop.state_dict()
    assert state["sampler"]["history"]["streak"]
    path = save_checkpoint(str(tmp_path), 6, {"loop": state})
    again = skipping_overlap_loop(fill_order)
    again.load_state_dict(load_checkpoint(path)["loop"])
    assert [steady(loop.step()) for _ in range(2)] == [steady(again.step()) for _ in range(2)]
