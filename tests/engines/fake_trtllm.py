"""A fake ``tensorrt_llm`` that enforces ``trtllm_api_snapshot.json``: only the recorded modules, constructor keywords,
attributes and RPC methods exist (anything else: TypeError / AttributeError). It proves our side of the contract only.

The toy model: sample token t of a request is ``(seed + 3 t + prompt[-1] + W) % vocab`` with W the rounded sum of
``model.norm.weight`` (so a weight update changes the outputs); log-prob ``-0.1 (t + 1)``. Calls are appended as JSON
lines to ``$FAKE_TRTLLM_LOG``; ``$FAKE_TRTLLM_FAIL`` names a weight whose bucket makes ``update_weights`` raise.
Use ``make_engine`` as the server's ``--engine tests.engines.fake_trtllm:make_engine``.
"""
from __future__ import annotations

import asyncio
import enum
import json
import os
import sys
import types

import torch

SNAPSHOT = json.load(open(os.path.join(os.path.dirname(__file__), "trtllm_api_snapshot.json")))
# What this fake implements; a test checks it equals the snapshot, so neither can change alone.
IMPLEMENTED = {
    "LLM.kwargs": {"model", "backend", "skip_tokenizer_init", "dtype", "tensor_parallel_size",
                   "moe_expert_parallel_size", "max_seq_len", "max_input_len", "max_batch_size", "max_num_tokens",
                   "kv_cache_config", "orchestrator_type", "ray_worker_extension_cls", "enable_sleep",
                   "cuda_graph_config", "disable_overlap_scheduler", "pipeline_parallel_size", "enable_attention_dp",
                   "trust_remote_code", "scheduler_config"},
    "SamplingParams.kwargs": {"max_tokens", "temperature", "top_p", "top_k", "seed", "end_id", "pad_id",
                              "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "detokenize", "logprobs",
                              "logprobs_mode", "n"},
    "KvCacheConfig.kwargs": {"free_gpu_memory_fraction", "enable_block_reuse", "max_tokens"},
    "SchedulerConfig.kwargs": {"capacity_scheduler_policy"},
    "CapacitySchedulerPolicy.members": {"MAX_UTILIZATION", "GUARANTEED_NO_EVICT", "STATIC_BATCH"},
    "RequestOutput.attributes": {"outputs", "finished", "request_id", "sampling_params", "aresult", "abort"},
    "CompletionOutput.attributes": {"index", "token_ids", "logprobs", "finish_reason", "stop_reason"},
    "rpc": {"update_weights", "check_weights_updated", "sleep", "wakeup"},
}


def _log(**event):
    path = os.environ.get("FAKE_TRTLLM_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(event) + "\n")


class _Strict:
    """Public attributes are those recorded for the class; fake internals start with ``_f_``."""
    _f_public: frozenset = frozenset()

    def __getattribute__(self, name):
        if not name.startswith("__") and not name.startswith("_f_") and name not in type(self)._f_public:
            raise AttributeError(f"{type(self).__name__}.{name} is not in the recorded TensorRT-LLM API")
        return object.__getattribute__(self, name)


def _check_kwargs(cls: str, kw: dict, allowed) -> None:
    bad = sorted(set(kw) - set(allowed))
    if bad:
        raise TypeError(f"{cls}() got keyword(s) {bad} not in the recorded API (snapshot)")


class KvCacheConfig(_Strict):
    _f_public = frozenset(SNAPSHOT["KvCacheConfig"]["kwargs"])

    def __init__(self, **kw):
        _check_kwargs("KvCacheConfig", kw, SNAPSHOT["KvCacheConfig"]["kwargs"])
        for k, v in kw.items():
            object.__setattr__(self, k, v)


class SchedulerConfig(_Strict):
    _f_public = frozenset(SNAPSHOT["SchedulerConfig"]["kwargs"])

    def __init__(self, **kw):
        _check_kwargs("SchedulerConfig", kw, SNAPSHOT["SchedulerConfig"]["kwargs"])
        policy = kw.get("capacity_scheduler_policy")
        if policy is not None and not isinstance(policy, CapacitySchedulerPolicy):
            raise TypeError(f"capacity_scheduler_policy must be a CapacitySchedulerPolicy, got {policy!r}")
        for k, v in kw.items():
            object.__setattr__(self, k, v)


class CapacitySchedulerPolicy(str, enum.Enum):  # the recorded members, nothing else
    MAX_UTILIZATION = "MAX_UTILIZATION"
    GUARANTEED_NO_EVICT = "GUARANTEED_NO_EVICT"
    STATIC_BATCH = "STATIC_BATCH"


class SamplingParams(_Strict):
    _f_public = frozenset(SNAPSHOT["SamplingParams"]["kwargs"])

    def __init__(self, **kw):
        _check_kwargs("SamplingParams", kw, SNAPSHOT["SamplingParams"]["kwargs"])
        if kw.get("logprobs_mode", "raw") not in SNAPSHOT["SamplingParams"]["values"]["logprobs_mode"]:
            raise ValueError(f"logprobs_mode {kw['logprobs_mode']!r}")
        defaults = dict(max_tokens=32, temperature=None, top_p=None, top_k=None, seed=None, end_id=None, pad_id=None,
                        stop_token_ids=None, include_stop_str_in_output=False, ignore_eos=False, detokenize=True,
                        logprobs=None, logprobs_mode="raw", n=1)
        for k, v in {**defaults, **kw}.items():
            object.__setattr__(self, k, v)
        _log(op="SamplingParams", **kw)


class Logprob(_Strict):
    _f_public = frozenset(SNAPSHOT["Logprob"]["attributes"])

    def __init__(self, logprob, rank=None):
        object.__setattr__(self, "logprob", logprob)
        object.__setattr__(self, "rank", rank)


class CompletionOutput(_Strict):
    _f_public = frozenset(SNAPSHOT["CompletionOutput"]["attributes"])

    def __init__(self):
        for k, v in dict(index=0, token_ids=[], logprobs=[], finish_reason=None, stop_reason=None).items():
            object.__setattr__(self, k, v)


class RequestOutput(_Strict):
    _f_public = frozenset(SNAPSHOT["RequestOutput"]["attributes"]) | set(SNAPSHOT["RequestOutput"]["methods"])

    def __init__(self, llm, rid, prompt, params):
        for k, v in dict(request_id=rid, sampling_params=params, outputs=[CompletionOutput()], finished=False,
                         _f_cancel=False, _f_event=asyncio.Event()).items():
            object.__setattr__(self, k, v)
        object.__setattr__(self, "_f_task", asyncio.ensure_future(self._f_run(llm, prompt, params)))

    async def _f_run(self, llm, prompt, p):
        out, w = self.outputs[0], llm._f_w
        stops = set(p.stop_token_ids or ())
        for t in range(p.max_tokens):
            await asyncio.sleep(0.002)
            if self._f_cancel:
                out.finish_reason = "cancelled"
                break
            tok = ((p.seed or 0) + 3 * t + prompt[-1] + w) % llm._f_vocab
            out.token_ids.append(tok)
            if p.logprobs == 0:
                out.logprobs.append({tok: Logprob(-0.1 * (t + 1), 1)})
            if (tok == p.end_id and not p.ignore_eos) or tok in stops:
                out.finish_reason, out.stop_reason = "stop", (None if tok == p.end_id else tok)
                if tok in stops and not p.include_stop_str_in_output:  # what result.py does
                    out.token_ids.pop()
                    out.logprobs and out.logprobs.pop()
                break
        else:
            out.finish_reason = "length"
        object.__setattr__(self, "finished", True)
        self._f_event.set()

    async def aresult(self):
        await self._f_event.wait()
        return self

    def abort(self):
        object.__setattr__(self, "_f_cancel", True)


def get_device_uuid(device_id: int) -> str:
    return f"GPU-fake-{int(device_id)}"


def fake_reduce_tensor(t: torch.Tensor):
    """Shaped like torch's CUDA reduction: (rebuild_fn, args) with the device index at args[6]."""
    return (lambda tensor, *rest: tensor), (t, None, None, None, None, None, t.device.index or 0)


class LLM(_Strict):
    _f_public = frozenset(SNAPSHOT["LLM"]["methods"])

    def __init__(self, **kw):
        _check_kwargs("LLM", kw, SNAPSHOT["LLM"]["kwargs"])
        ext = SNAPSHOT["WorkerExtension"]["class_path"]
        if kw.get("backend") != "pytorch" or kw.get("orchestrator_type") != "ray" or \
                kw.get("ray_worker_extension_cls") != ext or not isinstance(kw.get("kv_cache_config"), KvCacheConfig):
            raise ValueError("the fake models the PyTorch backend with the Ray RL worker extension only")
        config = json.load(open(os.path.join(kw["model"], "config.json")))
        from safetensors.torch import load_file
        weights = {}
        for f in sorted(os.listdir(kw["model"])):
            if f.endswith(".safetensors"):
                weights.update(load_file(os.path.join(kw["model"], f)))
        for k, v in dict(_f_vocab=int(config["vocab_size"]), _f_weights=weights, _f_tp=kw.get("tensor_parallel_size", 1),
                         _f_asleep=False, _f_n=0).items():
            object.__setattr__(self, k, v)
        self._f_reweigh()
        _log(op="LLM", **{k: (v if isinstance(v, (int, float, str, bool, type(None))) else type(v).__name__)
                          for k, v in kw.items() if k not in ("kv_cache_config", "scheduler_config")},
             kv_cache_config=dict(vars(kw["kv_cache_config"])),
             scheduler_config={k: getattr(v, "value", v) for k, v in vars(kw["scheduler_config"]).items()}
             if "scheduler_config" in kw else None)

    def _f_reweigh(self):
        object.__setattr__(self, "_f_w", int(round(float(self._f_weights["model.norm.weight"].sum()))))

    def generate_async(self, inputs, sampling_params=None, **kw):
        _check_kwargs("LLM.generate_async", kw, SNAPSHOT["LLM"]["methods"]["generate_async"]["params"][2:])
        asyncio.get_running_loop()  # RequestOutput.aresult needs the loop it was made in (result.py)
        if self._f_asleep:
            raise RuntimeError("engine is asleep")
        object.__setattr__(self, "_f_n", self._f_n + 1)
        return RequestOutput(self, self._f_n, list(inputs), sampling_params)

    def _collective_rpc(self, method, args=(), **kw):
        allowed = set(SNAPSHOT["WorkerExtension"]["methods"]) | set(SNAPSHOT["sleep"]["rpc_methods"])
        if method not in allowed:
            raise AttributeError(f"worker has no RPC method {method!r} in the recorded API")
        if method in ("sleep", "wakeup"):
            (tags,) = args
            bad = [t for t in tags if t not in SNAPSHOT["sleep"]["tags"]]
            if bad:
                raise ValueError(f"Unknown memory tag {bad}")
            object.__setattr__(self, "_f_asleep", method == "sleep")
            _log(op=method, tags=list(tags))
            return [None] * self._f_tp
        (handles,) = args
        if handles is None:
            self._f_reweigh()
            _log(op="update_weights", final=True)
            return [None] * self._f_tp
        expect = {get_device_uuid(i) for i in range(self._f_tp)}
        if set(handles) != expect:
            raise ValueError(f"Device UUID set {sorted(handles)} != workers {sorted(expect)}")
        names = [n for n, _ in handles[get_device_uuid(0)]]
        if os.environ.get("FAKE_TRTLLM_FAIL") in names:
            raise RuntimeError(f"reload failed on {os.environ['FAKE_TRTLLM_FAIL']}")
        for name, (fn, fargs) in handles[get_device_uuid(0)]:
            fargs = list(fargs)
            fargs[6] = 0  # the worker's own device id, as rlhf_utils does
            t = fn(*fargs)
            if name in self._f_weights:  # TRT-LLM skips unknown names silently
                self._f_weights[name] = t.clone()
        _log(op="update_weights", names=names, devices=sorted(handles))
        return [None] * self._f_tp

    def shutdown(self):
        _log(op="shutdown")


def install() -> None:
    """Put the fake package into sys.modules with exactly the recorded module attributes."""
    objs = {"LLM": LLM, "SamplingParams": SamplingParams, "KvCacheConfig": KvCacheConfig,
            "SchedulerConfig": SchedulerConfig, "CapacitySchedulerPolicy": CapacitySchedulerPolicy,
            "get_device_uuid": get_device_uuid, "__version__": "fake-" + SNAPSHOT["version"]["release_tag_nearest"]}
    for mod, names in SNAPSHOT["modules"].items():
        m = types.ModuleType(mod)
        for n in names:
            setattr(m, n, objs[n])
        sys.modules[mod] = m
    sys.modules.setdefault("tensorrt_llm._torch", types.ModuleType("tensorrt_llm._torch"))
    for parent, child in (("tensorrt_llm", "llmapi"), ("tensorrt_llm", "_torch"), ("tensorrt_llm._torch", "utils")):
        sys.modules.setdefault(parent, types.ModuleType(parent))
        setattr(sys.modules[parent], child, sys.modules[f"{parent}.{child}"])
    import torch.multiprocessing.reductions as red
    red.reduce_tensor = fake_reduce_tensor  # CPU tensors stand in for CUDA ones in this process only


def make_engine(model_dir, **options):
    install()
    from nemo_dapo.engines.trtllm import TRTLLMEngine
    options.setdefault("devices", ["cpu"])
    return TRTLLMEngine(model_dir, **options)
