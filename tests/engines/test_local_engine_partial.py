"""LocalEngine: the partial output an abort reports (what a suspended request keeps), and its continuation as
prompt + partial response with the remaining budget, against the same request run uninterrupted."""
import pytest
import torch

from nemo_dapo.engines.base import Request
from nemo_dapo.engines.local import LocalEngine
from tests.engines.test_local_engine import prompts
from tests.local.tiny_models import PAD, tiny_model

NEVER = -1  # an eos id no token can equal: every sample runs to its budget
BUDGET = 12


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def engine(model):
    return LocalEngine(model, eos_id=NEVER, pad_id=PAD, max_batch_size=4, steps_per_call=1)


def finish(eng, rid):
    while True:
        for c in eng.step():
            if c.id == rid:
                return c


def uninterrupted(model, prompt, **kw):
    eng = engine(model)
    eng.add(Request(id="full", prompt_ids=prompt, max_new_tokens=BUDGET, **kw))
    return finish(eng, "full").samples


def suspended_then_continued(model, prompt, steps, **kw):
    """Run ``steps`` engine steps, abort (the partial output), then continue each sample from prompt + partial."""
    eng = engine(model)
    eng.add(Request(id="a", prompt_ids=prompt, max_new_tokens=BUDGET, **kw))
    for _ in range(steps):
        assert not eng.step()
    partial = {c.id: c for c in eng.abort(["a"])}["a"].samples
    assert not eng.has_work()
    rest = []
    for k, s in enumerate(partial):
        eng.add(Request(id=f"c{k}", prompt_ids=prompt + s.token_ids, max_new_tokens=BUDGET - len(s.token_ids),
                        **{**kw, "n": 1}))
        rest.append(finish(eng, f"c{k}").samples[0])
    return partial, rest


def test_greedy_partial_output_is_the_prefix_and_its_continuation_the_rest(model):
    prompt = prompts()[1]
    full = uninterrupted(model, prompt, n=2, temperature=0.0)
    partial, rest = suspended_then_continued(model, prompt, 5, n=2, temperature=0.0)
    for f, p, r in zip(full, partial, rest):
        assert p.finish_reason == "aborted" and 0 < len(p.token_ids) < BUDGET
        assert len(p.logprobs) == len(p.token_ids)
        assert p.token_ids + r.token_ids == f.token_ids and r.finish_reason == "length"
        torch.testing.assert_close(torch.tensor(p.logprobs + r.logprobs), torch.tensor(f.logprobs), atol=1e-5,
                                   rtol=0)


def test_sampled_partial_output_is_the_prefix_drawn_with_its_logprobs(model):
    prompt = prompts()[3]
    full = uninterrupted(model, prompt, n=3, temperature=1.0, seed=7)
    partial, rest = suspended_then_continued(model, prompt, 4, n=3, temperature=1.0, seed=7)
    for f, p, r in zip(full, partial, rest):
        n = len(p.token_ids)
        assert p.token_ids == f.token_ids[:n] and p.finish_reason == "aborted"
        torch.testing.assert_close(torch.tensor(p.logprobs), torch.tensor(f.logprobs[:n]), atol=1e-5, rtol=0)
        assert n + len(r.token_ids) == BUDGET  # the continuation used the remaining budget
