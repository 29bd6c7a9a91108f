"""An engine of two workers: vLLM's CPU build at tensor parallel 2 (its multiprocess executor, one worker per core),
the shape of a cluster engine whose GPUs each hold a shard. Both transports must reach both workers: shared memory
through the server's ``collective_rpc`` reload, the weight group with one rank per worker (``weight_group_ranks``),
each worker loading its shard of the broadcast tensors. The log-probs are checked against transformers on the same
weights, so a worker that loaded the wrong bytes or no bytes shows. Also, without vLLM, how the adapter reads the
workers' answers to a broadcast bucket."""
import os

import pytest
import torch
from safetensors.torch import load_file

from nemo_dapo.engines import weight_group as WG
from nemo_dapo.engines.client import EngineClient, EngineProcess
from nemo_dapo.models.decoder import build_model, save_model
from tests.engines.test_vllm_engine import ROOT, TIED, VLLM_PYTHON
from tests.engines.test_vllm_weight_group import buckets

PROMPT = [1, 5, 9, 13]
NO_VLLM = not (os.path.isfile(VLLM_PYTHON) and os.access(VLLM_PYTHON, os.X_OK))


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm_tp2")
    save_model(build_model(TIED, vocab_size=64, pad_id=0, bos_id=1, eos_id=2, seed=3), tmp / "model")
    cores = sorted(os.sched_getaffinity(0))[:2]
    options = {"max_batch_size": 8, "tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    proc = EngineProcess(engine="vllm", model_dir=str(tmp / "model"), address=f"unix:{tmp}/e.sock",
                         python=VLLM_PYTHON, log_path=str(tmp / "vllm.log"), options=options,
                         env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                              "VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}|{cores[1]}"})
    client = EngineClient(proc.address, name="vllm-tp2", connect_timeout_s=300, request_timeout_s=120, process=proc)
    yield client, load_file(str(tmp / "model" / "model.safetensors")), tmp / "model"
    proc.stop(client if client.alive else None)


def sampled(client, rid):
    from nemo_dapo.engines.base import Request
    client.submit([Request(id=rid, prompt_ids=PROMPT, n=2, max_new_tokens=6, temperature=1.0, seed=7,
                           logprobs=True)])
    return [(s.token_ids, s.logprobs) for s in client.next_completion().samples]


def reference(model_dir, scale, samples):
    """transformers' log-probs of each sample's tokens, every weight of the checkpoint times ``scale``."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # tied: the embedding and the head are one parameter, scaled once
            p.mul_(scale)
        out = []
        for tokens, _ in samples:
            ids = torch.tensor([PROMPT + tokens])
            lp = torch.log_softmax(model(ids).logits[0, len(PROMPT) - 1:-1].float(), dim=-1)
            out.append(lp.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist())
    return out


def worst(samples, ref):
    return max(abs(a - b) for (_, lps), r in zip(samples, ref) for a, b in zip(lps, r))


@pytest.mark.slow
@pytest.mark.skipif(NO_VLLM, reason=f"no vLLM interpreter at {VLLM_PYTHON}: make one with `bash scripts/install.sh "
                                    ".venv-vllm engine-vllm`")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="vLLM's CPU workers bind one core each: needs 2")
def test_both_transports_reach_both_workers_of_a_tensor_parallel_engine(tp2):
    client, weights, model_dir = tp2
    assert client.info["weight_group_ranks"] == 2  # the weight group gives each worker a rank of its own
    client.update_weights(buckets(weights, 1.5))
    via_shm = sampled(client, "shm")
    assert worst(via_shm, reference(model_dir, 1.5, via_shm)) < 1e-4

    stats, group = WG.update_over_group([client], buckets(weights, 0.5))
    assert client.health()["weight_group"] == "joined (in the engine's workers)" and stats["tensors"] == len(weights)
    half = sampled(client, "half")
    assert worst(half, reference(model_dir, 0.5, half)) < 1e-4
    WG.update_over_group([client], buckets(weights, 1.5), group=group)
    assert sampled(client, "group") == via_shm  # the same weights through either transport: the same numbers
    group.close()


class _Workers:
    """vLLM's engine as the adapter's group receive sees it: ``collective_rpc`` answers once per worker."""

    def __init__(self, answers):
        self.answers = answers

    def collective_rpc(self, fn, args=()):
        return self.answers


@pytest.mark.parametrize("answers, raised", [
    ([None, ("broken", "worker 1: peer closed")], "GroupBroken"),  # the second worker's broadcast alone failed
    ([("nan", "w"), ("broken", "worker 1: peer closed")], "GroupBroken"),
    ([None, ("nan", "w")], "EngineWeightError"),
    ([None, None], None),
])
def test_every_workers_answer_counts_not_the_first_workers_alone(answers, raised):
    """Without vLLM: how the adapter reads its workers' answers to a broadcast bucket. Each worker has its own
    broadcast and its own shard, so the second's failure is the bucket's even where the first's went through."""
    from nemo_dapo.engines.vllm import VLLMEngine
    engine = VLLMEngine.__new__(VLLMEngine)
    engine.name, engine._engine, engine._dtype, engine._tied = "vllm", _Workers(answers), torch.float32, {}
    engine._updating, engine._received, engine._broken = True, set(), None
    spec = {"name": "w", "dtype": "float32", "shape": [4], "offset": 0}
    try:
        engine.receive_weights([spec], 16)
        got = None
    except Exception as e:  # noqa: BLE001 - which error is the result
        got = type(e).__name__
    assert got == raised and (raised is not None or engine._received == {"w"})
