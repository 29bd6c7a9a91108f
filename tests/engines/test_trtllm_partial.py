"""Contract test (TensorRT-LLM cannot run here): what partial rollouts need from the TRT-LLM adapter, against the fake
shaped like the pinned release (tests/engines/fake_trtllm.py). A cancelled sample's final result carries the tokens
and log-probs generated so far (PyExecutor._handle_canceled_requests marks the request finished with reason
CANCELLED and sends it through the ordinary response path); the adapter reports them as "aborted", and prompt +
partial response with the remaining budget is an ordinary request."""
import time

import pytest

from nemo_dapo.engines.base import EngineError, Request
from tests.engines import fake_trtllm as F
from tests.engines.test_trtllm_engine import VOCAB, checkpoint, engine, events  # noqa: F401 - the fixture

BUDGET = 400


def drawn(req, k):
    """The fake's tokens of sample k of an ignore_eos request (tensorrt_llm seeds each sample as the adapter does)."""
    return [(req.seed * 1_000_003 + k + 3 * t + req.prompt_ids[-1]) % VOCAB for t in range(req.max_new_tokens)]


def test_an_aborted_sample_reports_its_prefix_and_continues_from_prompt_plus_partial(engine):  # noqa: F811
    client, _, log = engine
    r = Request(id="long", prompt_ids=[1, 4], n=2, max_new_tokens=BUDGET, seed=3, ignore_eos=True)
    client.submit([r])
    time.sleep(0.05)  # the fake draws a token every 2 ms
    assert client.abort(["long"]) == 1
    (c,) = [client.next_completion()]
    for k, s in enumerate(c.samples):
        n = len(s.token_ids)
        assert s.finish_reason == "aborted" and 0 < n < BUDGET
        assert s.token_ids == drawn(r, k)[:n]
        assert len(s.logprobs) == n and s.logprobs[-1] == -0.1 * n  # the log-prob of each token it drew
    assert len(events(log, "cancel_request")) == 2  # each sample through the release's abort -> cancel chain
    p = c.samples[0]
    cont = Request(id="cont", prompt_ids=r.prompt_ids + p.token_ids, n=1, max_new_tokens=BUDGET - len(p.token_ids),
                   seed=9, ignore_eos=True)
    client.submit([cont])
    got = client.next_completion()
    assert got.id == "cont" and got.samples[0].token_ids == drawn(cont, 0)
    assert len(p.token_ids) + len(got.samples[0].token_ids) == BUDGET and got.samples[0].finish_reason == "length"
    assert events(log, "SamplingParams")[-1]["max_tokens"] == BUDGET - len(p.token_ids)


class _Handle:
    def __init__(self, tokens, logprobs, reason):
        from types import SimpleNamespace
        drawn = tokens + [9] * max(0, logprobs - len(tokens))  # a surplus log-prob names a token not returned
        self.outputs = [SimpleNamespace(token_ids=tokens, logprobs=[{t: F.Logprob(-1.0 - i)} for i, t in
                                                                   enumerate(drawn[:logprobs])],
                                        finish_reason=reason)]


@pytest.mark.parametrize("reason,logprobs,want", [("cancelled", 2, [5, 6]), ("length", 2, None),
                                                   ("cancelled", 4, [5, 6, 7]), ("length", 4, None)])
def test_tokens_without_their_log_prob(tmp_path, reason, logprobs, want):
    """A log-prob fewer, or more, than tokens: a cancelled sample keeps the tokens that have their log-prob
    (TensorRT-LLM releases differ in whether a cancel can split a token from its log-prob, and result.py trims a
    surplus only for requests not cancelled); any other sample is an error, never a silent shift of log-probs
    against tokens."""
    d = tmp_path / "c"
    d.mkdir()
    checkpoint(d)
    eng = F.make_engine(str(d))
    try:
        h = _Handle([5, 6, 7], logprobs, reason)
        eng._live["r"] = {"handles": [h], "samples": [None], "stops": set(), "logprobs": True}
        if want is None:
            with pytest.raises(EngineError, match=f"3 tokens but {logprobs} log-probs"):
                eng._collect("r", 0, h, None)
        else:
            eng._collect("r", 0, h, None)
            s = eng._live["r"]["samples"][0]
            assert s.token_ids == want and s.logprobs == [-1.0 - i for i in range(len(want))]
            assert s.finish_reason == "aborted"
    finally:
        eng.close()
