"""The collective weight transport into vLLM's own worker (collective_rpc, engines/vllm.py ``_rpc_group``) through a
real vLLM server in its venv: the broadcast weights give the same log-probs as the same weights through shared
memory, and a bucket the engine refuses (an unknown name, NaN) is refused before anyone enters the broadcast, so the
next update is read in step (a worker that skipped a broadcast would read the next bucket's bytes as this one's)."""
import os
import time

import pytest
import torch
from safetensors.torch import load_file

from nemo_dapo.engines import shm as S
from nemo_dapo.engines import weight_group as WG
from nemo_dapo.engines.base import EngineWeightError, Request
from nemo_dapo.engines.client import EngineClient, EngineProcess
from nemo_dapo.models.decoder import build_model, save_model
from tests.engines.test_vllm_engine import ROOT, TIED, VLLM_PYTHON

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not (os.path.isfile(VLLM_PYTHON) and os.access(VLLM_PYTHON, os.X_OK)),
    reason=f"no vLLM interpreter at {VLLM_PYTHON}: make one with `bash scripts/install.sh .venv-vllm engine-vllm`")]


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm_group")
    save_model(build_model(TIED, vocab_size=64, pad_id=0, bos_id=1, eos_id=2, seed=3), tmp / "model")
    proc = EngineProcess(engine="vllm", model_dir=str(tmp / "model"), address=f"unix:{tmp}/e.sock",
                         python=VLLM_PYTHON, options={"max_batch_size": 8}, log_path=str(tmp / "vllm.log"),
                         env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    client = EngineClient(proc.address, name="vllm", connect_timeout_s=300, request_timeout_s=120, process=proc)
    yield client, load_file(str(tmp / "model" / "model.safetensors"))
    proc.stop(client if client.alive else None)


def logprobs(client, rid):
    client.submit([Request(id=rid, prompt_ids=[1, 5, 9, 13], n=2, max_new_tokens=6, temperature=1.0, seed=7,
                           logprobs=True)])
    return [s.logprobs for s in client.next_completion().samples]


def buckets(weights, scale=1.0):
    names = sorted(weights)
    return [[(n, weights[n] * scale) for n in names[:len(names) // 2]], [(n, weights[n] * scale)
                                                                         for n in names[len(names) // 2:]]]


def test_broadcast_into_vllm_workers_equals_shared_memory_and_refusals_keep_it_in_step(vllm_server):
    client, weights = vllm_server
    client.update_weights(buckets(weights, 1.5))
    want = logprobs(client, "shm")
    stats, group = WG.update_over_group([client], buckets(weights, 0.5))
    assert client.health()["weight_group"] == "joined (in the engine's workers)" and stats["tensors"] == len(weights)
    moved = logprobs(client, "half")
    assert max(abs(a - b) for x, y in zip(moved, want) for a, b in zip(x, y)) > 1e-3
    _, group = WG.update_over_group([client], buckets(weights, 1.5), group=group)
    assert logprobs(client, "group") == want  # the same weights through either transport: the same numbers

    # Refused as the update's first bucket: after part of an update, a refused name leaves vLLM half-updated and
    # the adapter then refuses all work until a restart (both transports; engines/vllm.py).
    name = sorted(weights)[0]
    bad = [[("model.bogus.weight", torch.ones(3))], [(name, torch.full_like(weights[name], float("nan")))]]
    for bucket, culprit in zip(bad, ("model.bogus.weight", name)):
        t0 = time.monotonic()
        with pytest.raises(EngineWeightError) as e:
            WG.update_over_group([client], [bucket] + buckets(weights, 1.5))
        assert e.value.name == culprit and time.monotonic() - t0 < 60
    _, group = WG.update_over_group([client], buckets(weights, 1.5))  # a fresh group, read in step
    assert logprobs(client, "after") == want


def test_a_trainer_that_drops_the_group_mid_bucket_leaves_vllm_usable(vllm_server):
    client, weights = vllm_server
    client.update_weights(buckets(weights, 1.5))
    want = logprobs(client, "before")
    group = WG._form([client], "127.0.0.1", 60.0)
    specs, size = S.weight_layout(buckets(weights, 0.5)[0])
    assert client.call("update_weights", via="group", size=size, tensors=specs)["receiving"] == len(specs)
    group.close()  # the trainer goes away with the worker waiting in the broadcast
    deadline = time.monotonic() + 60
    while not client.health()["weight_group"].startswith("left") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert client.health()["weight_group"].startswith("left: a broadcast failed")
    WG.update_over_group([client], buckets(weights, 1.5))  # a new group and a whole update: usable again
    assert logprobs(client, "again") == want
