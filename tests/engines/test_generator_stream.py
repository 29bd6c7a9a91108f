"""GroupStream (engines/generator.py): dropping some groups of a live stream aborts only their requests, counts every
token they produced, and leaves the other groups to finish or be suspended as before. In-process toy engine: the
same order on every run."""
from nemo_dapo.engines.generator import EngineGenerator
from tests.engines.toy_engine import ToyEngine
from tests.support.inprocess_client import InProcessClient

EOS = 49  # the toy (vocab 48) never draws it: every sample runs to its budget


def stream(budgets):
    """One request per group, n=2 samples, group k with max_new_tokens budgets[k]."""
    client = InProcessClient(ToyEngine(vocab=48))
    gen = EngineGenerator(client, eos_id=EOS, pad_id=0)
    requests = [[([1, 2, 3 + k], 2, b, 10 + k)] for k, b in enumerate(budgets)]
    return client, gen.stream_requests(requests)


def test_dropped_groups_count_their_tokens_and_the_others_run_on():
    client, s = stream([3, 20, 30])
    it = iter(s)
    k, out = next(it)
    assert k == 0 and int(out.response_mask.sum()) == 6
    s.drop([1])  # group 1 has 3 tokens per sample so far (the engine stepped 3 times)
    rest = dict(it)
    assert sorted(rest) == [2] and int(rest[2].response_mask.sum()) == 60
    assert s.aborted_tokens == 6  # group 1's partial samples, reported by the abort
    assert s.generated_tokens == 6 + 6 + 60  # every token the engine produced for the stream
    assert not client.adapter.has_work() and not client.ready


def test_a_drop_before_a_suspend_leaves_only_the_others_suspended():
    client, s = stream([20, 20, 20])
    for _ in range(4):
        client.ready.extend(client.adapter.step())
    s.drop([0, 2])
    parts = s.suspend()
    assert sorted(parts) == [1] and int(parts[1].response_mask.sum()) == 8
    assert s.aborted_tokens == 16 and s.generated_tokens == 24
    assert not client.ready  # nothing of the dropped requests is left for a later stream


def test_dropping_a_group_counts_its_finished_request_held_for_the_others():
    client = InProcessClient(ToyEngine(vocab=48))
    gen = EngineGenerator(client, eos_id=EOS, pad_id=0)
    # group 0: two requests (a resumed group's unfinished samples), a short and a long one; group 1 short
    s = gen.stream_requests([[([1, 2], 1, 2, 1), ([1, 2], 1, 30, 2)], [([4, 5], 1, 4, 3)]])
    it = iter(s)
    assert next(it)[0] == 1  # by then group 0's short request finished and is held for its long one
    assert s.generated_tokens == 2 + 4
    s.drop([0])
    assert s.aborted_tokens == 2  # the held request, at once
    assert s.suspend() == {}
    assert s.aborted_tokens == 2 + 4 and s.generated_tokens == 2 + 4 + 4  # the long one, cut after 4 steps
    assert not client.ready and not client.adapter.has_work()
