"""Streaming dynamic sampling: the shared step loop over a real engine server process (toy engine, fake policy)."""
import pytest
import torch

from nemo_dapo.engines.generator import EngineGenerator
from tests.core.test_loop import FakePolicy, make_loop
from tests.engines.test_protocol import start

# Sample j of the k-th request stops after LENGTHS[(k + j) % 8] tokens: most short, a few at the cap.
LENGTHS = [3, 3, 4, 3, 5, 3, 4, 40]


class WeightedFakePolicy(FakePolicy):
    """The fake policy plus the one weight of the toy engine, so that every step pushes a real update."""

    def hf_weight_buckets(self, bucket_bytes):
        yield [("w", torch.zeros(4))]


@pytest.fixture
def engine(tmp_path):
    proc, client = start(tmp_path, lengths=LENGTHS, step_delay_s=0.002, vocab_size=64)  # prompts hold ids < 60
    yield client
    proc.stop(client)


def loop_over(client, **kw):
    policy = WeightedFakePolicy()
    gen = EngineGenerator(client, eos_id=49, pad_id=0, sleep_level=1)
    return make_loop(generator=gen, policy=policy, ds=True, groups=4, group_size=4, mini=8, max_new_tokens=40,
                     streaming=True, **kw)


def test_abort_once_full_trains_on_the_first_finished_groups_and_counts_the_waste(engine):
    loop = loop_over(engine, on_filler_full="abort")
    m = loop.step()
    assert m["filter/trained_groups"] == 4 and m["train/batch_samples"] == 16
    assert m["rollout/aborted_requests"] > 0 and m["rollout/aborted_tokens"] > 0
    assert m["rollout/generated_tokens"] == m["response/tokens"] + m["rollout/aborted_tokens"]
    assert m["counters/aborted_tokens"] == m["rollout/aborted_tokens"]
    assert 0 < m["timing/to_last_needed_s"] <= m["timing/step_s"]
    assert engine.health()["running"] == 0  # nothing left behind in the engine
    m2 = loop.step()  # the next step starts clean: late completions of aborted requests never leak into it
    assert m2["filter/trained_groups"] == 4


def test_finish_policy_lets_running_groups_complete_into_the_carry_over(engine):
    loop = loop_over(engine, on_filler_full="finish")
    m = loop.step()
    assert m["rollout/aborted_requests"] == 0 and m["rollout/aborted_tokens"] == 0
    assert m["filter/trained_groups"] == 4 and m["filter/carried"] + m["filter/discarded"] > 0
    assert m["timing/to_last_needed_s"] < m["timing/step_s"]


def test_a_trainer_that_left_the_engine_asleep_is_followed_by_one_that_wakes_it(engine):
    """A trainer killed while its engine slept (sleep_level 1: the update phase) leaves the server asleep; the rerun's
    client learns it at hello, so its first refit and generation wake the engine instead of being refused."""
    from nemo_dapo.engines.client import EngineClient

    first = loop_over(engine)
    first.step()
    first.generator.sleep()  # the update phase of the next step; then the trainer dies
    engine.close()
    again = EngineClient(engine.address, name="rerun", connect_timeout_s=60, request_timeout_s=20,
                         process=engine.process)
    try:
        assert again.asleep_at_connect and again.health()["sleeping"] is True
        loop = loop_over(again)
        loop.generator.update_weights(loop.policy)  # what a resumed run does first
        assert loop.step()["filter/trained_groups"] == 4
    finally:
        again.close()
    fresh = EngineClient(engine.address, name="next", connect_timeout_s=60, request_timeout_s=20,
                         process=engine.process)
    try:
        assert not fresh.asleep_at_connect  # the rerun left it awake after its step's generation
    finally:
        fresh.close()


def test_streaming_needs_a_stream_capable_generator():
    with pytest.raises(ValueError, match="streaming dynamic sampling needs a generator with stream"):
        make_loop(streaming=True)


def test_streaming_under_data_parallelism_drains_and_ranks_agree(tmp_path):
    """Two ranks (threads), each with its own engine server: streams are drained (no early stop across ranks),
    every rank's filler sees the same gathered groups, and the counters agree."""
    import threading

    from tests.core.test_loop import ThreadReducer

    world, shared, barrier = 2, [None, None], threading.Barrier(2)
    servers = [start(tmp_path, name=f"rank{r}", lengths=LENGTHS, vocab_size=64) for r in range(world)]
    loops = []
    for r, (_, client) in enumerate(servers):
        gen = EngineGenerator(client, eos_id=49, pad_id=0)
        loops.append(make_loop(generator=gen, policy=WeightedFakePolicy(), ds=True, groups=4, group_size=4, mini=8,
                               max_new_tokens=40, streaming=True,
                               reducer=ThreadReducer(r, world, shared, barrier)))
    metrics, errors = [None, None], []

    def run(r):
        try:
            metrics[r] = loops[r].step()
        except Exception as e:  # noqa: BLE001 - surfaced below
            errors.append(e)
            barrier.abort()

    try:
        threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors
        assert loops[0].counters == loops[1].counters
        assert metrics[0]["rollout/aborted_requests"] == 0 and metrics[0]["filter/trained_groups"] == 4
        assert metrics[0]["rollout/generated_tokens"] == metrics[1]["rollout/generated_tokens"] > 0
    finally:
        for proc, client in servers:
            proc.stop(client)
