"""Contract tests: the collective weight transport into TensorRT-LLM's Ray workers (engines/trtllm_worker.py, our
extension of the release's RL hook) through the real engine server, client and gloo group, against the fake
TensorRT-LLM (tests/engines/fake_trtllm.py), with two TP workers, each its own group rank. The fake mixes the
extension into its workers as the release does (resolved by import path, a name the worker has refused). The GPU
test beside them needs the release container: tests/gpu/test_trtllm_engine.py (the same transport, real engine)."""
import json

import pytest
import torch

from nemo_dapo.engines import weight_group as WG
from nemo_dapo.engines.base import EngineWeightError, Request
from nemo_dapo.engines.trtllm_worker import EXTENSION
from tests.engines.test_trtllm_engine import events, expect, start

L = "model.layers.0."


@pytest.fixture
def tp2(tmp_path):
    proc, client, weights, log = start(tmp_path, tensor_parallel_size=2)
    yield client, weights, log
    proc.stop(client if client.alive else None)


def split_qkv(weights, scale=1.0):
    """Two buckets that cut the fused q/k/v module in two (q, k in the first; v in the second), plus lm_head, which
    a tied checkpoint drops."""
    first = sorted(n for n in weights if not n.startswith(L + "self_attn.v_proj"))
    second = sorted(n for n in weights if n.startswith(L + "self_attn.v_proj"))
    return [[(n, weights[n] * scale) for n in first] + [("lm_head.weight", weights["model.embed_tokens.weight"])],
            [(n, weights[n] * scale) for n in second]]


def loaded(log, since=0):
    """Names and shapes each reload received since event ``since``, in order (both workers)."""
    ev = [e for e in map(json.loads, open(log))][since:]
    return [dict(zip(e["names"], map(tuple, e["shapes"]))) for e in ev if e["op"] == "reload"]


def test_the_workers_receive_exactly_the_engines_names_and_shapes_as_shared_memory_does(tp2):
    client, weights, log = tp2
    assert client.info["weight_group_ranks"] == 2
    (llm,) = events(log, "LLM")
    assert llm["ray_worker_extension_cls"] == EXTENSION
    n0 = sum(1 for _ in open(log))
    client.update_weights(split_qkv(weights, 2.0))
    via_shm = loaded(log, n0)
    req = Request(id="a", prompt_ids=[3, 5], max_new_tokens=5, seed=4)
    client.submit([req])
    w = int(round(float((weights["model.norm.weight"] * 2.0).sum())))
    assert client.next_completion().samples[0].token_ids == expect(req, 0, w)

    n1 = sum(1 for _ in open(log))
    stats, group = WG.update_over_group([client], buckets=split_qkv(weights, 3.0))
    via_group = loaded(log, n1)
    assert client.health()["weight_group"] == "joined (in the engine's workers)"
    assert stats["tensors"] == len(weights) + 1  # what the trainer sent, lm_head included
    # per worker: the first bucket without q and k (held for v), the second with all three; lm_head never
    assert len(via_group) == 4 and via_group[0] == via_group[1] and via_group[2] == via_group[3]
    assert via_group == via_shm  # the two workers' reloads are the same, so their order does not matter
    first, second = via_group[0], via_group[2]
    assert "lm_head.weight" not in first and L + "self_attn.q_proj.weight" not in first
    assert {L + f"self_attn.{p}_proj.{leaf}" for p in "qkv" for leaf in ("weight", "bias")} == set(second)
    assert sum(1 for e in events(log, "update_weights") if e.get("final")) == 4  # one finalize per worker per update
    client.submit([Request(id="b", prompt_ids=[3, 5], max_new_tokens=5, seed=4)])
    w = int(round(float((weights["model.norm.weight"] * 3.0).sum())))
    assert client.next_completion().samples[0].token_ids == expect(req, 0, w)  # the broadcast weights serve
    group.close()


def test_a_refused_or_non_finite_tensor_names_itself_and_the_next_update_is_read_in_step(tp2):
    client, weights, log = tp2
    norm = "model.norm.weight"
    with pytest.raises(EngineWeightError) as e:  # refused from its spec, before anyone enters the broadcast
        WG.update_over_group([client], buckets=[[("model.bogus.weight", torch.ones(3))]])
    assert e.value.name == "model.bogus.weight"
    with pytest.raises(EngineWeightError) as e:  # seen by the workers: nothing of the bucket loaded
        nan = torch.full_like(weights[norm], float("nan"))
        WG.update_over_group([client], buckets=[[(norm, nan)]])
    assert e.value.name == norm and "NaN" in str(e.value)
    assert all(norm not in r for r in loaded(log))
    WG.update_over_group([client], buckets=split_qkv(weights, 3.0))  # a new group, read in step
    req = Request(id="c", prompt_ids=[3, 5], max_new_tokens=5, seed=4)
    client.submit([req])
    assert client.next_completion().samples[0].token_ids == expect(req, 0, round(float(weights[norm].sum() * 3)))


def test_a_fused_module_left_incomplete_fails_the_update_by_name(tp2):
    client, weights, _ = tp2
    bucket = [(n, weights[n]) for n in sorted(weights) if not n.startswith(L + "self_attn.v_proj")]
    with pytest.raises(EngineWeightError, match="only part of fused module"):
        WG.update_over_group([client], buckets=[bucket])


def test_the_extension_is_the_releases_hook_plus_two_decorated_methods():
    from nemo_dapo.engines import trtllm_worker as TW
    from tests.engines import fake_trtllm as F
    F.install()  # as the other in-process contract tests do
    TW._extension_class.cache_clear()
    cls = TW.GroupWorkerExtension
    assert issubclass(cls, F.WorkerExtension) and {"nemo_dapo_join", "nemo_dapo_receive"} <= set(vars(cls))
    assert cls.nemo_dapo_receive.__wrapped__ is TW._receive  # under the release's control-action decorator
    assert cls.nemo_dapo_join.__wrapped__ is TW._join
    TW._extension_class.cache_clear()
    with pytest.raises(AttributeError):
        TW.NotAThing  # noqa: B018
