"""rollout.fill_order: with "prompt", streamed groups enter the dynamic-sampling filler in prompt order, so what
trains does not depend on the order in which the engine finishes them; with "finish" (the default) it does.

The engine is the toy adapter driven in this process; ``Reordering`` lets it finish every group and then hands them
to the loop in a seeded random order, as an engine with other timing would."""
import dataclasses
import random

import pytest
import torch

from nemo_dapo.engines.generator import EngineGenerator
from tests.core.test_loop import make_loop, steady
from tests.core.test_partial_rollouts import (EOS, MAX_NEW, BusyPolicy, PushingPolicy, VersionedToy,
                                              even_prompts_solved, skipping_settings)
from tests.support.inprocess_client import InProcessClient

# What depends on the engine's timing whatever the fill order: how much was generated before the abort.
TIMING_DEPENDENT = ("rollout/generated_tokens", "rollout/aborted_tokens", "rollout/aborted_requests",
                    "counters/generated_tokens", "counters/aborted_tokens")


class Reordered:
    """A finished GroupStream replayed in a shuffled order; ``abort`` ends it (the groups not yet handed over count
    as aborted, as an engine's unfinished requests would)."""

    def __init__(self, inner, rng: random.Random):
        self.items = list(inner)  # the engine finishes every group first
        rng.shuffle(self.items)
        self.generated_tokens, self.aborted_tokens, self.aborted_requests = inner.generated_tokens, 0, 0
        self._next = 0

    @property
    def done(self) -> bool:
        return self._next >= len(self.items)

    def __iter__(self):
        while not self.done:
            self._next += 1
            yield self.items[self._next - 1]

    def abort(self) -> None:
        rest, self._next = self.items[self._next:], len(self.items)
        self.aborted_requests += len(rest)
        self.aborted_tokens += sum(int(out.response_mask.sum()) for _, out in rest)


class Reordering:
    """The engine generator, its streams replayed in an order drawn from ``seed``."""

    def __init__(self, generator, seed: int):
        self.generator, self.rng = generator, random.Random(seed)

    def stream(self, *args, **kw):
        return Reordered(self.generator.stream(*args, **kw), self.rng)

    def stream_requests(self, *args, **kw):
        return Reordered(self.generator.stream_requests(*args, **kw), self.rng)

    def __getattr__(self, name):
        return getattr(self.generator, name)


def same(a, b) -> bool:
    """Equality of nested containers whose leaves may be tensors (values and dtypes)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and same(vars(a), vars(b))
    return a == b


def run(fill_order, order_seed, on_filler_full="abort", steps=3):
    policy = PushingPolicy()
    gen = Reordering(EngineGenerator(InProcessClient(VersionedToy()), eos_id=EOS, pad_id=0), order_seed)
    loop = make_loop(generator=gen, policy=policy, ds=True, groups=4, group_size=4, mini=8, max_new_tokens=MAX_NEW,
                     streaming=True, on_filler_full=on_filler_full, fill_order=fill_order, seed=5)
    metrics = [loop.step() for _ in range(steps)]
    trained = [(mb.group_ids.tolist(), mb.response_ids.tolist()) for mb, _ in policy.calls]
    return trained, metrics, loop


@pytest.mark.parametrize("on_filler_full", ["abort", "finish"])
def test_prompt_order_trains_the_same_whatever_the_finishing_order(on_filler_full):
    a_trained, a_metrics, a = run("prompt", order_seed=1, on_filler_full=on_filler_full)
    b_trained, b_metrics, b = run("prompt", order_seed=2, on_filler_full=on_filler_full)
    assert a_trained == b_trained and a_trained
    for ma, mb in zip(a_metrics, b_metrics):
        assert {k: v for k, v in steady(ma).items() if k not in TIMING_DEPENDENT} == \
               {k: v for k, v in steady(mb).items() if k not in TIMING_DEPENDENT}
    assert same(a.filler.state_dict(), b.filler.state_dict())  # the carried-over groups too


def test_finish_order_follows_the_engine_timing():
    # The check above can fail: in finishing order the same engine outputs train differently.
    a_trained, _, _ = run("finish", order_seed=1)
    b_trained, _, _ = run("finish", order_seed=2)
    assert a_trained != b_trained


def test_prompt_order_with_abort_trains_a_prefix_of_the_drawn_prompts_and_counts_the_dropped_groups():
    trained, metrics, loop = run("prompt", order_seed=3, steps=1)
    uids = sorted({u for ids, _ in trained for u in ids})
    m = metrics[0]
    # dynamic sampling kept the informative groups among the first prompts drawn; none after the one that filled it
    assert m["filter/trained_groups"] == 4 and max(uids) < m["counters/consumed_prompts"]
    assert m["rollout/generated_tokens"] == m["response/tokens"] + m["rollout/aborted_tokens"]


def rounds_loop(order_seed, round_tokens=4, seed=5, reducer=None, overlap=False, busy=None, skipping=False):
    """Partial rollouts in prompt order (rounds of ``round_tokens`` tokens), the engine's completions replayed in an
    order drawn from ``order_seed``; ``reducer``: this rank's data-parallel collectives (None: one rank).
    ``busy`` (with ``order_seed`` None): no replay, the engine left to take ``busy`` decode steps in each update (a
    round submitted before the update is then collected part-done; a replayed one was run to its end at once).
    ``skipping``: history-based prompt skipping over 6 prompts, half of them always solved (prompts to skip)."""
    from nemo_dapo.core.loop import DAPOLoop
    from nemo_dapo.core.loss import make_loss_fn

    engine = EngineGenerator(InProcessClient(VersionedToy()), eos_id=EOS, pad_id=0)
    if busy is None:
        policy, gen = PushingPolicy(), Reordering(engine, order_seed)
    else:
        policy, gen = BusyPolicy(busy), engine
        policy.client = engine.client
    base = make_loop(generator=gen, policy=policy, ds=True, groups=4, group_size=4, mini=8, max_new_tokens=MAX_NEW,
                     streaming=True, on_filler_full="suspend", fill_order="prompt", seed=seed,
                     loss=make_loss_fn(eps_low=0.2, eps_high=0.28, clip_c=10.0, tis_cap=2.0),
                     **(skipping_settings() if skipping else {}))
    return DAPOLoop(policy=policy, generator=gen, reward_fn=even_prompts_solved if skipping else base.reward_fn,
                    loss_fn=base.loss_fn, prompts=base.prompts, filler=base.filler, settings=base.settings,
                    max_staleness=1, round_tokens=round_tokens, reducer=reducer, overlap=overlap)


def trained_rows(loop):
    return [(mb.group_ids.tolist(), mb.response_ids.tolist(), mb.token_version.tolist()) for mb, _ in loop.policy.calls]


def test_partial_rollouts_in_prompt_order_train_and_suspend_the_same_whatever_the_engine_timing():
    runs = []
    for order_seed in (1, 2):
        # seed 9: prompts whose groups behind the one that fills the batch are still mid-generation (most draws
        # of the toy's lengths finish them all while the head group runs: they are then carried over finished)
        loop = rounds_loop(order_seed, seed=9)
        metrics = [steady(loop.step()) for _ in range(3)]
        runs.append((trained_rows(loop), metrics, [g.to_state() for g in loop._suspended], loop))
    (ta, ma, sa, a), (tb, mb, sb, _) = runs
    assert ta == tb and ma == mb and sa == sb  # the generated-token counts too: no timing-dependent number is left
    assert sa and any(g["samples"][0]["tokens"] or g["samples"][1]["tokens"] for g in sa)  # partial work carried
    spans = {tuple(sorted(set(v for v, m in zip(row, mask) if m)))
             for mb_, _ in a.policy.calls for row, mask in zip(mb_.token_version.tolist(), mb_.response_mask.tolist())}
    assert (0, 1) in spans and (1, 2) in spans  # responses begun by one weight version and finished by the next
    assert ma[1]["partial/resumed_groups"] > 0 and ma[-1]["rollout/aborted_tokens"] == 0


@pytest.mark.parametrize("overlap,skipping", [(False, False), (True, False), (True, True)])
def test_partial_rollouts_in_prompt_order_under_data_parallelism_build_the_single_ranks_batches(overlap, skipping):
    """Two ranks (threads), each with its own engine and other engine timing, share every round's groups and the
    scoring of the finished head: together they train the rows one rank trains, and both carry over its state
    (with overlap too: each rank's share of the round run during the update; with history-based prompt skipping,
    both keep the one rank's history and skip its prompts)."""
    import threading

    from tests.core.test_loop import ThreadReducer

    steps = 3
    single = rounds_loop(order_seed=1, seed=9, overlap=overlap, skipping=skipping)
    expected = [steady(single.step()) for _ in range(steps)]
    shared, barrier = [None, None], threading.Barrier(2)
    ranks = [rounds_loop(order_seed=2 + r, seed=9, reducer=ThreadReducer(r, 2, shared, barrier), overlap=overlap,
                         skipping=skipping) for r in range(2)]
    got, errors = {0: [], 1: []}, []

    def run(r):
        try:
            got[r] = [steady(ranks[r].step()) for _ in range(steps)]
        except Exception as e:  # noqa: BLE001 - surfaced below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    batch_keys = sorted({k for m in expected for k in m if k.split("/")[0] in ("rollout", "partial", "counters",
                                                                                 "filter")})
    assert "partial/resumed_groups" in batch_keys and "counters/generated_tokens" in batch_keys
    # .get: a step names the mismatch of a lag class only if it trained tokens of that class; that mean is summed in
    # two parts on two ranks, so it is equal up to rounding
    loose = lambda k, v: pytest.approx(v, rel=1e-6) if "mismatch" in k and v is not None else v  # noqa: E731
    for r in range(2):
        assert [{k: loose(k, m.get(k)) for k in batch_keys} for m in got[r]] == [{k: m.get(k) for k in batch_keys}
                                                                                  for m in expected]
        assert [g.to_state() for g in ranks[r]._suspended] == [g.to_state() for g in single._suspended]
        assert same(ranks[r].filler.state_dict(), single.filler.state_dict())
        assert same(ranks[r].sampler.state_dict(), single.sampler.state_dict())  # the prompt history with it
    if skipping:
        assert expected[-1]["counters/skipped_prompts"] > 0
    assert expected[-1]["partial/resumed_groups"] > 0 and single._suspended
    rows = lambda calls: sorted(  # noqa: E731 - every trained row (group, tokens, versions) of some mini-batches
        (u, ids[:n], v[:n]) for mb, _ in calls for u, ids, v, n in zip(
            mb.group_ids.tolist(), mb.response_ids.tolist(), mb.token_version.tolist(),
            mb.response_mask.sum(-1).long().tolist()))
    calls = [ranks[r].policy.calls for r in range(2)]
    assert len(calls[0]) == len(calls[1]) == len(single.policy.calls) > 0
    for i, (mb, _) in enumerate(single.policy.calls):  # each mini-batch split between the ranks, nothing doubled
        assert rows([calls[0][i], calls[1][i]]) == rows([(mb, None)])


def test_rounds_hand_groups_over_in_prompt_order_and_suspend_only_at_round_ends():
    loop = rounds_loop(order_seed=1, round_tokens=4)
    m = loop.step()
    trained = {int(u) for mb, _ in loop.policy.calls for u in mb.group_ids}
    held = loop._suspended
    assert trained and held
    assert max(trained) < min(g.uid for g in held)  # handed over: a prefix of the draw order (uids grow with it)
    for g in held:  # a held sample stopped at a round's end, or finished (waiting for a group before it)
        assert all(smp.finish is not None or len(smp.tokens) % 4 == 0 for smp in g.samples), g
    assert m["counters/generated_tokens"] == m["response/tokens"] + sum(g.num_tokens() for g in held)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_resumed_prompt_order_run_reproduces_the_uninterrupted_one(tmp_path, overlap):
    from nemo_dapo.core.checkpoint import load_checkpoint, save_checkpoint

    a = rounds_loop(order_seed=1, overlap=overlap)
    a.step()
    b = rounds_loop(order_seed=7, overlap=overlap)  # the run that is killed, with other engine timing
    b.step()
    path = save_checkpoint(str(tmp_path), 1, {"loop": b.state_dict()})
    c = rounds_loop(order_seed=3, overlap=overlap)  # the rerun, with a third
    c.load_state_dict(load_checkpoint(path)["loop"])
    ma, mc = steady(a.step()), steady(c.step())
    assert ma == mc and ma["partial/resumed_groups"] > 0
    assert trained_rows(a)[-len(c.policy.calls):] == trained_rows(c)


# ---- overlap in prompt order: one round while the trainer trains ---------------------------------------------------
def overlap_run(steps=4, **kw):
    loop = rounds_loop(seed=9, overlap=True, **kw)
    metrics = [steady(loop.step()) for _ in range(steps)]
    return trained_rows(loop), metrics, [g.to_state() for g in loop._suspended], loop


def test_overlap_in_prompt_order_trains_the_same_whatever_the_engines_did_during_the_update():
    """The round submitted at the full batch is collected before the refit: run to its end at once (replayed), the
    engine left idle through the update, or part-done by it, the run trains and carries over the same."""
    runs = [overlap_run(order_seed=1), overlap_run(order_seed=None, busy=0), overlap_run(order_seed=None, busy=5)]
    (ta, ma, sa, a) = runs[0]
    for tb, mb, sb, _ in runs[1:]:
        assert ta == tb and ma == mb and sa == sb
    assert ma[1]["partial/resumed_groups"] > 0 and ma[-1]["partial/trained_lag_max"] >= 1
    spans = [int(v[m.bool()].max() - v[m.bool()].min()) for mb, _ in a.policy.calls
             for v, m in zip(mb.token_version, mb.response_mask)]
    assert max(spans) == a.max_staleness  # responses continued by the next weights, none spanning more
    # it is not the loop without overlap: the next batch's prompts were drawn (and started) a step early
    plain = rounds_loop(order_seed=1, seed=9)
    first = steady(plain.step())
    assert ma[0]["counters/consumed_prompts"] == first["counters/consumed_prompts"]  # counted when step 2 begins
    assert ma[0]["counters/generated_tokens"] > first["counters/generated_tokens"]
    c, p = a.counters, a.partial_counters  # every generated token trained, held or counted as dropped
    assert c["generated_tokens"] == sum(m["response/tokens"] for m in ma) + sum(
        g.num_tokens() for g in a._suspended) + p["stale_tokens"] + c["aborted_tokens"]


def test_overlap_in_prompt_order_runs_its_round_during_the_update():
    seen = []

    class Watching(BusyPolicy):
        def train_step(self, minibatch, *, norm, loss_fn):
            seen.append(self.client.adapter.has_work())
            return super().train_step(minibatch, norm=norm, loss_fn=loss_fn)

    for overlap in (True, False):
        loop = rounds_loop(order_seed=None, busy=2, seed=9, overlap=overlap)
        watching = Watching(2)
        watching.client = loop.policy.client
        loop.policy = watching
        seen.clear()
        loop.step()
        assert seen and seen[0] == overlap  # requests in flight when the trainer starts training, or none


def test_overlap_in_prompt_order_stopped_before_the_update_waits_for_its_round_and_resumes_as_uninterrupted(
        tmp_path):
    from nemo_dapo.core.checkpoint import load_checkpoint, save_checkpoint

    a = rounds_loop(order_seed=1, seed=9, overlap=True)
    expected = [steady(a.step()) for _ in range(2)]
    b = rounds_loop(order_seed=None, busy=3, seed=9, overlap=True)
    assert b.step(should_stop=lambda phase: phase == "update") is None  # a time limit hit with the batch full
    assert b._ahead is None and b.filler.full()  # the round is collected: the checkpoint holds all of it
    path = save_checkpoint(str(tmp_path), 0, {"loop": b.state_dict()})
    c = rounds_loop(order_seed=2, seed=9, overlap=True)
    c.load_state_dict(load_checkpoint(path)["loop"])
    got = [steady(c.step()) for _ in range(2)]
    assert trained_rows(c) == trained_rows(a)  # the same rows, trained in the same order
    same_keys = [k for k in expected[-1] if k.startswith(("counters/", "partial/"))]
    assert {k: got[-1][k] for k in same_keys} == {k: expected[-1][k] for k in same_keys}
    assert [g.to_state() for g in c._suspended] == [g.to_state() for g in a._suspended]


def test_overlap_in_prompt_order_with_nothing_carried_and_nothing_drawn_runs_no_round():
    loop = rounds_loop(order_seed=1, seed=9, overlap=True)
    loop.step()
    held = [g.to_state() for g in loop._suspended]
    loop._sample_cap = loop.counters["consumed_samples"]  # the run's last samples are drawn
    loop._round_ahead([])  # a batch that handed over every group it drew
    assert loop._ahead is None and [g.to_state() for g in loop._suspended] == held
    loop._park_live()  # the refit then has nothing to wait for


def test_overlap_in_prompt_order_holds_the_next_batch_that_the_filler_asks_for_no_more():
    """What runs during the update is the next step's generation batch (the filler's over-sampled size, the carried
    groups counted in it), so the batches stay the size the pass rate asks for; drawing a whole batch beside the
    carried groups made every later batch larger and its tail wait a step more (trained two versions late)."""
    loop, asked = rounds_loop(order_seed=1, seed=9, overlap=True), []
    round_ahead = loop._round_ahead

    def watched(carried):
        asked.append((len(carried), loop.filler.next_step_gen_batch_size()))
        round_ahead(carried)
    loop._round_ahead = watched
    for _ in range(4):
        steady(loop.step())
        carried, size = asked[-1]
        assert len(loop._suspended) == max(size, carried)
    assert any(size > carried for carried, size in asked)  # prompts were drawn ahead


def test_overlap_in_prompt_order_does_not_continue_a_group_the_next_weights_drop_as_stale():
    from nemo_dapo.core.partial import SampleState, SuspendedGroup
    loop = rounds_loop(order_seed=1, seed=9, overlap=True)
    loop._version, loop._sample_cap = 2, 0  # max_staleness 1: the next weights (3) drop version-1 work; none drawn
    old, recent = (SuspendedGroup(index=k, uid=1000 + k, seed=k, samples=[SampleState([5], [-0.5], [v])
                                                                          for _ in range(4)])
                   for k, v in ((0, 1), (1, 2)))
    loop._round_ahead([old, recent])
    todo, live, _ = loop._ahead
    assert [todo[k].uid for k in live] == [recent.uid]


def test_prompt_order_with_partial_rollouts_needs_rounds():
    from nemo_dapo.core.loop import DAPOLoop

    base = rounds_loop(order_seed=1)
    kw = dict(policy=base.policy, generator=base.generator, reward_fn=base.reward_fn, loss_fn=base.loss_fn,
              prompts=base.prompts, filler=base.filler, settings=base.settings, max_staleness=1)
    with pytest.raises(ValueError, match="give round_tokens >= 1"):
        DAPOLoop(**kw)

    class TwoRanks:
        rank, world_size = 0, 2
    # under data parallelism, finishing order would stop each rank's share at another point
    kw["settings"] = dataclasses.replace(base.settings, fill_order="finish")
    with pytest.raises(ValueError, match="under data parallelism run in rounds: set fill_order='prompt'"):
        DAPOLoop(**kw, reducer=TwoRanks())
    assert DAPOLoop(**kw).max_staleness == 1  # one rank may suspend in finishing order


def test_the_cpu_config_takes_prompt_order_with_suspend_with_or_without_overlap():
    from nemo_dapo.local.config import ConfigError, load_config

    keys = ["rollout.engine=local", "rollout.streaming=true", "rollout.on_filler_full=suspend", "algorithm.tis_cap=2.0",
            "rollout.fill_order=prompt"]
    assert load_config("tiny_cpu", keys + ["rollout.round_tokens=4"]).rollout.round_tokens == 4
    assert load_config("tiny_cpu", keys + ["rollout.overlap=true", "rollout.server.sleep_level=0"]).rollout.overlap
    with pytest.raises(ConfigError, match="rollout.round_tokens"):
        load_config("tiny_cpu", keys + ["rollout.round_tokens=0"])
