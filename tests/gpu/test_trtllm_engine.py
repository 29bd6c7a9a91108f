"""Device check of the ``trtllm`` engine in the TensorRT-LLM release container (skipped without CUDA or tensorrt_llm).

    python -m pytest tests/gpu/test_trtllm_engine.py -q -s

A tiny random Qwen2 (QKV bias; bf16 engine, fp32 reference) is saved to a tmp dir and served with ``--engine trtllm``.
Its weights are then replaced through the RL hook by those of a megatron-core GPTModel: the checkpoint converted
with ``convert.hf_to_megatron`` into ``convert_build.gpt_model_from_hf`` (one process, TP = PP = EP = 1), perturbed,
and streamed by ``refit_hf.hf_weight_buckets`` in bf16 buckets, exactly the trainer's path. Checks:
  * the installed tensorrt_llm matches the recorded release (nemo_dapo.engines.trtllm_check, as the image build does);
  * engine log-probs of the sampled tokens (temperature 1: processed == raw) match the torch HF model built from the
    perturbed Megatron weights (``convert.megatron_to_hf``): max |diff| < 0.05 nats (bf16 engine, fp32 reference);
  * the same through the collective weight transport (gloo, received in the Ray workers by our extension; and nccl
    from a second GPU, GPU to GPU, where the machine has two: NCCL refuses two ranks on one GPU);
  * in-flight throughput beats static waves (same requests; a wave waits for its longest member) by >= 1.2x.
The refit check needs megatron-core in the container (``pip install --no-deps megatron-core==0.10.0``); without it
it skips with that reason and the throughput check still runs.
"""
import importlib.util
import os
import time

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if importlib.util.find_spec("tensorrt_llm") is None:
    pytest.skip("needs tensorrt_llm (the TensorRT-LLM release container)", allow_module_level=True)

from nemo_dapo.engines.base import Request  # noqa: E402
from nemo_dapo.engines.client import EngineClient, EngineProcess  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL = 0.05


def tiny_qwen2(path):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False, eos_token_id=1, torch_dtype="bfloat16")
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    return model.float()


def token_logprobs(model, prompt, tokens):
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def worst_gap(client, ref, reqs) -> float:
    """Largest |engine - reference| log-prob of the tokens the engine samples for ``reqs``."""
    client.submit(reqs)
    worst = 0.0
    for _ in reqs:
        c = client.next_completion()
        prompt = next(r.prompt_ids for r in reqs if r.id == c.id)
        for s in c.samples:
            gap = token_logprobs(ref, prompt, s.token_ids) - torch.tensor(s.logprobs)
            worst = max(worst, float(gap.abs().max()))
    return worst


def test_the_installed_release_matches_the_record():
    import json
    from nemo_dapo.engines import trtllm_check
    problems = trtllm_check.check(json.loads(trtllm_check.SNAPSHOT.read_text()))
    assert problems == [], "\n".join(problems)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen2")
    model = tiny_qwen2(d)
    proc = EngineProcess(engine="trtllm", model_dir=str(d), address=f"unix:{d}/e.sock",
                         options={"prompt_budget": 128, "response_budget": 256, "max_batch_size": 64,
                                  "free_gpu_memory_fraction": 0.3}, log_path=str(d / "e.log"),
                         env={"PYTHONPATH": ROOT})
    client = EngineClient(proc.address, name="trtllm", connect_timeout_s=900, request_timeout_s=300, process=proc)
    yield model, client
    proc.stop(client if client.alive else None)


def megatron_from_hf(hf_model):
    """A single-process megatron-core GPTModel holding ``hf_model``'s weights (the trainer's side of a refit)."""
    pytest.importorskip("megatron.core", reason="the refit check needs megatron-core in this container")
    import torch.distributed as dist
    from nemo_dapo.megatron.convert import padded_vocab_size
    from tests.support.megatron_convert import hf_to_megatron
    from nemo_dapo.megatron.convert_build import gpt_model_from_hf
    from tests.support.megatron_model import initialize_parallel, load_full_state_dict
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
        initialize_parallel(1, 1, 1)
    cfg = hf_model.config
    padded = padded_vocab_size(cfg.vocab_size)
    mc = gpt_model_from_hf(cfg, padded_vocab=padded, use_cpu_initialization=True, params_dtype=torch.float32)
    with torch.no_grad():
        load_full_state_dict(mc, hf_to_megatron(hf_model.state_dict(), cfg, padded_vocab=padded))
    return mc


def test_refit_from_megatron_then_logprobs_match(served):
    from transformers import Qwen2ForCausalLM
    from tests.support.megatron_convert import megatron_to_hf
    from tests.support.megatron_model import single_rank_state_dict
    from nemo_dapo.megatron.refit_hf import hf_weight_buckets
    model, client = served
    mc = megatron_from_hf(model)
    with torch.no_grad():
        for p in mc.parameters():
            p.add_(0.02 * torch.randn_like(p))
    client.update_weights(hf_weight_buckets(mc, model.config, bucket_bytes=1 << 20, dtype=torch.bfloat16))
    # the reference holds exactly the (bf16-rounded) weights the engine got, in HF form
    ref = Qwen2ForCausalLM(model.config)
    hf_state = megatron_to_hf(single_rank_state_dict(mc), model.config)
    ref.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in hf_state.items()}, strict=False)
    ref = ref.float().eval()
    worst = worst_gap(client, ref, [Request(id=f"r{i}", prompt_ids=[5 + i, 9, 17], n=2, max_new_tokens=24, seed=i)
                                    for i in range(4)])
    print(f"max |engine - megatron| log-prob after refit: {worst:.4f} nats (tolerance {TOL})")
    assert worst < TOL


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_the_weight_group_loads_in_the_workers_what_the_reference_holds(served, backend):
    """The collective weight transport into the Ray workers through our extension of the RL hook: the HF model's
    weights, perturbed, in two buckets that cut the fused q/k/v; engine log-probs match a torch model holding the
    same bf16 weights, as after the shared-memory refit above. nccl: sent from the last GPU (the engine is on 0)."""
    from transformers import Qwen2ForCausalLM
    from nemo_dapo.engines import weight_group as WG
    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("nccl needs a second GPU for the trainer's rank (NCCL refuses two ranks on one GPU)")
    model, client = served
    assert client.info["weight_group_ranks"] == 1
    torch.manual_seed(1)
    state = {k: (v + 0.02 * torch.randn_like(v)).to(torch.bfloat16) for k, v in model.state_dict().items()}
    names = sorted(state)
    half = len(names) // 2
    if backend == "nccl":
        assert client.info["nccl"] == WG.nccl_version()
        torch.cuda.set_device(torch.cuda.device_count() - 1)
        sent = {k: v.cuda() for k, v in state.items()}
    else:
        sent = state
    stats, group = WG.update_over_group([client], [[(n, sent[n]) for n in names[:half]],
                                                   [(n, sent[n]) for n in names[half:]]], backend=backend)
    suffix = " over nccl" if backend == "nccl" else ""
    assert client.health()["weight_group"] == "joined (in the engine's workers)" + suffix
    assert stats["tensors"] == len(names)
    ref = Qwen2ForCausalLM(model.config)
    ref.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    ref = ref.float().eval()
    worst = worst_gap(client, ref, [Request(id=f"g{i}", prompt_ids=[7 + i, 3, 11], n=2, max_new_tokens=24, seed=i)
                                    for i in range(4)])
    group.close()
    print(f"max |engine - reference| log-prob after the group update: {worst:.4f} nats (tolerance {TOL})")
    assert worst < TOL


def test_inflight_beats_static_waves(served):
    _, client = served
    lengths = [8 if i % 4 else 200 for i in range(32)]

    def reqs(tag):
        return [Request(id=f"{tag}{i}", prompt_ids=[3, 4, 5], max_new_tokens=n, ignore_eos=True, seed=i)
                for i, n in enumerate(lengths)]

    t0 = time.perf_counter()
    client.submit(reqs("f"))
    for _ in lengths:
        client.next_completion()
    inflight = time.perf_counter() - t0
    t0 = time.perf_counter()
    wave = 8
    for i in range(0, len(lengths), wave):  # a static batch: the next wave starts when the longest one ends
        batch = reqs(f"s{i}_")[i:i + wave]
        client.submit(batch)
        for _ in batch:
            client.next_completion()
    static = time.perf_counter() - t0
    print(f"in-flight {inflight:.2f} s, static waves {static:.2f} s, speed-up {static / inflight:.2f}x")
    assert static / inflight >= 1.2
