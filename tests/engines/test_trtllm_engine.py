"""Contract tests: the trtllm adapter (through the real engine server and client, or in process) against a fake
TensorRT-LLM shaped like the pinned release (``nemo_dapo/engines/trtllm_api_snapshot.json``; the fake's own shape is
checked against that record by tests/engines/test_trtllm_check.py). They prove our side of the contract only."""
import ast
import inspect
import json
import os

import pytest
import torch

from nemo_dapo.engines.base import EngineError, EngineWeightError, Request
from nemo_dapo.engines.client import EngineClient, EngineProcess
from tests.engines import fake_trtllm as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAKE = "tests.engines.fake_trtllm:make_engine"
VOCAB, EOS, H = 40, 7, 4


def checkpoint(path):
    from safetensors.torch import save_file
    L = "model.layers.0."
    w = {"model.embed_tokens.weight": torch.zeros(VOCAB, H), "model.norm.weight": torch.zeros(H),
         L + "input_layernorm.weight": torch.zeros(H), L + "post_attention_layernorm.weight": torch.zeros(H),
         L + "self_attn.o_proj.weight": torch.zeros(H, H), L + "mlp.down_proj.weight": torch.zeros(H, 8),
         L + "mlp.gate_proj.weight": torch.zeros(8, H), L + "mlp.up_proj.weight": torch.zeros(8, H)}
    for p in "qkv":
        w[L + f"self_attn.{p}_proj.weight"], w[L + f"self_attn.{p}_proj.bias"] = torch.zeros(H, H), torch.zeros(H)
    save_file(w, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "vocab_size": VOCAB,
                                                  "eos_token_id": EOS, "tie_word_embeddings": True,
                                                  "torch_dtype": "float32"}))
    return w


def start(tmp_path, fail=None, **options):
    model = tmp_path / "ckpt"
    model.mkdir()
    weights = checkpoint(model)
    log = tmp_path / "fake.jsonl"
    env = {"PYTHONPATH": ROOT, "FAKE_TRTLLM_LOG": str(log), **({"FAKE_TRTLLM_FAIL": fail} if fail else {})}
    proc = EngineProcess(engine=FAKE, model_dir=str(model), address=f"unix:{tmp_path}/t.sock",
                         options={"abort_wait_s": 0.5, **options}, log_path=str(tmp_path / "e.log"), env=env)
    client = EngineClient(proc.address, name="trtllm", connect_timeout_s=60, request_timeout_s=30, process=proc)
    return proc, client, weights, log


def events(log, op):
    return [e for e in map(json.loads, open(log)) if e["op"] == op]


def expect(req, k, w=0):
    seed = req.seed * 1_000_003 + k
    toks = []
    for t in range(req.max_new_tokens):
        toks.append((seed + 3 * t + req.prompt_ids[-1] + w) % VOCAB)
        if toks[-1] in set(req.stop_token_ids) | {EOS}:
            break
    return toks


@pytest.fixture
def engine(tmp_path):
    proc, client, weights, log = start(tmp_path)
    yield client, weights, log
    proc.stop(client if client.alive else None)


def test_llm_built_with_the_budgets_kv_config_and_rl_hook(engine):
    client, _, log = engine
    (llm,) = events(log, "LLM")
    assert llm["backend"] == "pytorch" and llm["max_seq_len"] == 2048 + 20480 and llm["max_input_len"] == 2048
    assert llm["cuda_graph_config"] is None and llm["enable_sleep"] is True  # the release: no graphs with reload
    assert "allreduce_strategy" not in llm  # one TP-1 engine: TensorRT-LLM's default
    assert llm["kv_cache_config"] == {"free_gpu_memory_fraction": 0.85, "enable_block_reuse": True}
    assert llm["scheduler_config"] == {"capacity_scheduler_policy": "MAX_UTILIZATION"}
    assert llm["ray_worker_extension_cls"] == "nemo_dapo.engines.trtllm_worker.GroupWorkerExtension"
    assert client.info["max_seq_len"] == 22528 and client.info["vocab_size"] == VOCAB


def test_generation_keeps_eos_returns_logprobs_and_per_sample_seeds(engine):
    client, _, log = engine
    reqs = [Request(id="a", prompt_ids=[1, 2], n=3, max_new_tokens=12, seed=5),
            Request(id="b", prompt_ids=[3], n=1, max_new_tokens=20, seed=2, stop_token_ids=[11])]
    client.submit(reqs)
    got = {c.id: c for c in (client.next_completion() for _ in reqs)}
    for r in reqs:
        for k, s in enumerate(got[r.id].samples):
            assert s.token_ids == expect(r, k)
            assert s.finish_reason == ("stop" if s.token_ids[-1] in {EOS, *r.stop_token_ids} else "length")
            assert s.logprobs == pytest.approx([-0.1 * (t + 1) for t in range(len(s.token_ids))])
    params = events(log, "SamplingParams")
    assert sorted(p["seed"] for p in params[:3]) == [5 * 1_000_003 + k for k in range(3)]
    assert all(p["logprobs"] == 0 and p["logprobs_mode"] == "processed" and p["include_stop_str_in_output"]
               and p["end_id"] == EOS for p in params)
    assert any(s.finish_reason == "stop" and s.token_ids[-1] == EOS for c in got.values() for s in c.samples) or \
        any(s.token_ids[-1] == 11 for s in got["b"].samples)


def test_abort_returns_partial_samples(engine):
    client, _, _ = engine
    client.submit([Request(id="long", prompt_ids=[1], n=2, max_new_tokens=2000, seed=1, ignore_eos=True)])
    assert client.abort(["long"]) == 1
    c = client.next_completion()
    assert c.id == "long" and [s.finish_reason for s in c.samples] == ["aborted", "aborted"]
    assert all(len(s.token_ids) < 2000 and len(s.logprobs) == len(s.token_ids) for s in c.samples)


def test_weight_update_in_buckets_holds_fused_parts_and_makes_the_final_call(engine):
    client, weights, log = engine
    new = {n: torch.ones_like(t) for n, t in weights.items()}
    names = sorted(new)
    q = [n for n in names if "q_proj" in n]
    buckets = [[(n, new[n]) for n in q], [(n, new[n]) for n in names if n not in q]]
    client.update_weights(buckets)
    sent = events(log, "update_weights")
    # bucket 1 (q alone) is held back until bucket 2 completes q/k/v; then one partial call, then the final one
    assert len(sent) == 2 and set(sent[0]["names"]) == set(names)
    assert sent[1] == {"op": "update_weights", "rank": 0, "final": True} and events(log, "reset_prefix_cache")
    r = Request(id="w", prompt_ids=[2], n=1, max_new_tokens=6, seed=3)
    client.submit([r])
    assert client.next_completion().samples[0].token_ids == expect(r, 0, w=H)  # norm weight now sums to H


def test_bad_name_or_failed_bucket_refuses_generation(tmp_path):
    proc, client, weights, _ = start(tmp_path, fail="model.norm.weight")
    try:
        with pytest.raises(EngineWeightError, match="model.bogus"):
            client.update_weights([[("model.bogus.weight", torch.ones(2))]])
        with pytest.raises(EngineError, match="mixed weights"):
            client.submit([Request(id="x", prompt_ids=[1])])
        with pytest.raises(EngineWeightError, match="reload failed"):
            client.update_weights([[("model.norm.weight", torch.ones(H))]])
        with pytest.raises(EngineError):
            client.submit([Request(id="y", prompt_ids=[1])])
    finally:
        proc.stop(client if client.alive else None)


def test_a_refused_first_bucket_leaves_no_fused_part_behind(engine):
    """q of a first bucket that is refused (another tensor of it is) must not complete q/k/v in the next update:
    one that sends k and v alone is still a partial fused module."""
    client, weights, _ = engine
    q = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(EngineWeightError, match="model.bogus"):
        client.update_weights([[(q, torch.ones(H, H)), ("model.bogus.weight", torch.ones(2))]])
    with pytest.raises(EngineWeightError, match="missing .*q_proj"):
        client.update_weights([[(n, torch.ones_like(t)) for n, t in weights.items() if n != q]])


def test_partial_fused_module_fails_at_finish(engine):
    client, weights, _ = engine
    with pytest.raises(EngineWeightError, match="k_proj"):
        client.update_weights([[("model.layers.0.self_attn.q_proj.weight", torch.ones(H, H))]])


def test_sleep_and_wake_send_the_memory_tags(engine):
    client, _, log = engine
    client.sleep(2)
    client.wake()
    client.sleep(1)
    client.wake()
    assert [(e["op"], e["tags"]) for e in map(json.loads, open(log)) if e["op"] in ("sleep", "wakeup")] == [
        ("sleep", ["kv_cache", "model"]), ("wakeup", ["kv_cache", "model"]),
        ("sleep", ["kv_cache"]), ("wakeup", ["kv_cache"])]


@pytest.mark.parametrize("block_reuse", [True, False])
def test_a_kv_cache_woken_without_an_update_serves_no_request_until_one(tmp_path, block_reuse):
    """The release wakes a released KV pool without restoring it and only the update's finalize resets the prefix
    cache that points into it: with block reuse, generation between such a wake and the next update is refused
    (loudly, not read from zeroed blocks); an update of the same weights clears it. Without reuse nothing is stale."""
    proc, client, weights, _ = start(tmp_path, enable_block_reuse=block_reuse)
    try:
        r = Request(id="a", prompt_ids=[2], n=1, max_new_tokens=4, seed=3)
        client.sleep(1)
        client.wake()
        if block_reuse:
            with pytest.raises(EngineError, match="woken without a weight update"):
                client.submit([r])
            client.update_weights([list(weights.items())])
        client.submit([r])
        assert client.next_completion().samples[0].token_ids == expect(r, 0)
    finally:
        proc.stop(client if client.alive else None)


def test_unknown_option_is_a_clear_error(tmp_path):
    (tmp_path / "c").mkdir()
    checkpoint(tmp_path / "c")
    with pytest.raises(EngineError, match=r"unknown option\(s\) \['max_seqlen'\].*response_budget"):
        F.make_engine(str(tmp_path / "c"), max_seqlen=4)
    with pytest.raises(EngineError, match="rejected the LLM arguments"):
        F.make_engine(str(tmp_path / "c"), llm_kwargs={"not_an_llm_arg": 1})
    with pytest.raises(EngineError, match="capacity_scheduler='fcfs'; use max_utilization or guaranteed_no_evict"):
        F.make_engine(str(tmp_path / "c"), capacity_scheduler="fcfs")
    F.make_engine(str(tmp_path / "c"), capacity_scheduler="guaranteed_no_evict")  # TRT-LLM's own default


def test_registered_as_trtllm():
    from nemo_dapo.core import engine_registry
    from nemo_dapo.engines.trtllm import TRTLLMEngine

    assert engine_registry.load(engine_registry.ENGINES["trtllm"].adapter) is TRTLLMEngine


def _adapter_calls():
    """Keywords the adapter passes to each TensorRT-LLM constructor, its LLM arguments and the RPCs it names."""
    src = ast.parse(open(os.path.join(ROOT, "nemo_dapo/engines/trtllm.py")).read())
    calls = {"SamplingParams": set(), "KvCacheConfig": set(), "SchedulerConfig": set(), "LLM": set()}
    rpcs = set()
    for node in ast.walk(src):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                getattr(node.value.func, "id", "") == "dict" and [getattr(x, "id", "") for x in node.targets] == ["args"]:
            calls["LLM"] |= {k.arg for k in node.value.keywords}
        if isinstance(node, ast.Subscript) and getattr(node.value, "id", "") == "args" and \
                isinstance(node.slice, ast.Constant):
            calls["LLM"].add(node.slice.value)
        if isinstance(node, ast.Call):
            fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if fn.lstrip("_") in calls and fn.lstrip("_") != "LLM":
                calls[fn.lstrip("_")] |= {k.arg for k in node.keywords if k.arg}
            if fn in ("_collective_rpc", "_rpc") and node.args and isinstance(node.args[0], ast.Constant):
                rpcs.add(node.args[0].value)
    return calls, rpcs


def test_adapter_uses_only_what_the_snapshot_records():
    snap = json.load(open(os.path.join(ROOT, "nemo_dapo/engines/trtllm_api_snapshot.json")))
    calls, rpcs = _adapter_calls()
    assert calls["SamplingParams"] and calls["SamplingParams"] <= set(snap["SamplingParams"]["fields"])
    assert calls["KvCacheConfig"] <= set(snap["KvCacheConfig"]["fields"])
    assert calls["SchedulerConfig"] and calls["SchedulerConfig"] <= set(snap["SchedulerConfig"]["fields"])
    assert {"cuda_graph_config", "allreduce_strategy", "enable_sleep"} <= calls["LLM"]
    assert calls["LLM"] <= set(snap["TorchLlmArgs"]["fields"]) | set(snap["LLM"]["kwargs_besides_fields"])
    ours = set(snap["group_worker_extension"]["methods"])
    assert rpcs == set(snap["sleep"]["rpc_methods"]) | {"update_weights"} | ours
    assert rpcs <= set(snap["WorkerExtension"]["methods"]) | set(snap["sleep"]["rpc_methods"]) | ours
    from nemo_dapo.engines import trtllm as T
    assert T.WORKER_EXTENSION == snap["group_worker_extension"]["class_path"]
    src = open(T.__file__).read()
    assert f'logprobs_mode="{snap["LogprobMode"]["adapter_value"]}"' in src
    assert "cuda_graph_config=None" in src and snap["cuda_graphs"]["adapter_value"] is None
    defaults = inspect.signature(T.TRTLLMEngine).parameters
    assert defaults["sleep_tags"].default is None and \
        {str(k): v for k, v in {1: ["kv_cache"], 2: ["kv_cache", "model"]}.items()} == snap["sleep"]["adapter_tags"]
    assert "_sleep_tags = {1: [\"kv_cache\"], 2: [\"kv_cache\", \"model\"]" in src
    assert T._FINISH[snap["cancel"]["finish_reason"]] == "aborted"  # what a partial rollout continues from
    assert "h.abort" in src  # RequestOutput.abort(): the path snap["cancel"] records


@pytest.fixture
def local_ckpt(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    return d, checkpoint(d)


@pytest.mark.parametrize("mode,copies", [("shared", 1), ("per_rank", 2)])
def test_refit_moves_the_model_once_per_engine_when_shared(local_ckpt, mode, copies):
    """TP=2: with refit_copy=shared every bucket is materialised on the engine's devices once and both ranks open
    that copy; per_rank copies it to each rank. Counted: the bytes of the tensors handed to reduce_tensor."""
    d, weights = local_ckpt
    eng = F.make_engine(str(d), tensor_parallel_size=2, refit_copy=mode)
    try:
        F.REDUCED.clear()
        new = {n: torch.full_like(t, 2.0) for n, t in weights.items()}
        names = sorted(new)
        eng.load_weights((n, new[n]) for n in names[:5])
        eng.load_weights((n, new[n]) for n in names[5:])
        eng.finish_weights()
        model_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        moved = sum(F.REDUCED)
        assert moved == copies * model_bytes, (moved, model_bytes)
        for w in eng._llm._f_workers:  # both ranks loaded every weight
            assert all(torch.equal(w.engine.model_engine.model.weights[n], new[n]) for n in names)
    finally:
        eng.close()


def test_tp_engines_of_a_multi_engine_run_get_nccl_allreduce(local_ckpt, tmp_path, monkeypatch):
    d, _ = local_ckpt
    log = tmp_path / "l.jsonl"
    monkeypatch.setenv("FAKE_TRTLLM_LOG", str(log))
    F.make_engine(str(d), tensor_parallel_size=2, allreduce_strategy="NCCL").close()
    (llm,) = events(log, "LLM")
    assert llm["allreduce_strategy"] == "NCCL" and llm["tensor_parallel_size"] == 2
    with pytest.raises(EngineError, match="rejected the LLM arguments"):
        F.make_engine(str(d), allreduce_strategy="FASTEST")


def test_a_missing_engine_dependency_is_a_clean_engine_error(local_ckpt, monkeypatch):
    d, _ = local_ckpt

    def no_ray(self, world_size):
        raise ModuleNotFoundError("No module named 'ray'")
    monkeypatch.setattr(F.RayExecutor, "__init__", no_ray)
    with pytest.raises(EngineError, match=r"dependency is not importable \(No module named 'ray'\).*installs and "
                                          "checks ray"):
        F.make_engine(str(d))


def test_bad_refit_options_are_refused(local_ckpt):
    d, _ = local_ckpt
    with pytest.raises(EngineError, match="refit_copy='twice'; use shared or per_rank"):
        F.make_engine(str(d), refit_copy="twice")
    with pytest.raises(EngineError, match="1 devices for tensor_parallel_size=2"):
        F.make_engine(str(d), tensor_parallel_size=2, devices=["cpu"])


def test_the_fake_refuses_a_reload_with_cuda_graphs_on(local_ckpt):
    """What the release says (PR #10456): the fake's update_weights refuses graphs, so the adapter must turn them off."""
    d, weights = local_ckpt
    F.install()
    llm = F.LLM(str(d), backend="pytorch", orchestrator_type="ray",
                ray_worker_extension_cls="tensorrt_llm.llmapi.rlhf_utils.WorkerExtension")
    with pytest.raises(RuntimeError, match="incompatible with CUDA graphs"):
        llm._collective_rpc("update_weights", args=(None,))


def test_strict_fake_rejects_unrecorded_names():
    with pytest.raises(TypeError, match="beam_width"):
        F.SamplingParams(beam_width=2)
    with pytest.raises(ValueError, match="'log_softmax' is not a valid LogprobMode"):
        F.SamplingParams(logprobs_mode="log_softmax")
    out = F.CompletionOutput()
    with pytest.raises(AttributeError, match="text"):
        out.text


@pytest.mark.parametrize("level, first_wake", [(2, [("wakeup", ["model"])]), (1, [])])
def test_a_refit_while_asleep_wakes_the_weights_alone_and_the_kv_cache_only_for_the_final_call(engine, level,
                                                                                               first_wake):
    """The colocated order: the buckets load with the KV cache released; the final call (post-processing and a
    prefix-cache reset) gets the KV cache back first, since the release does not say it tolerates a released pool."""
    client, weights, log = engine
    assert client.info["sleep_releases"] == {"1": ["kv_cache"], "2": ["kv_cache", "weights"]}
    client.sleep(level)
    if level == 2:
        client.call("wake", tags=["weights"])
    client.update_weights([[(n, torch.ones_like(t)) for n, t in weights.items()]])
    client.wake()
    seen = [(e["op"], e.get("tags", e.get("final", False))) for e in map(json.loads, open(log))
            if e["op"] in ("sleep", "wakeup", "update_weights") and e.get("rank", 0) == 0]
    partial = [s for s in seen if s[0] == "update_weights" and s[1] is False]
    assert partial and seen == [("sleep", ["kv_cache", "model"] if level == 2 else ["kv_cache"]), *first_wake,
                                *partial, ("wakeup", ["kv_cache"]), ("update_weights", True)]
