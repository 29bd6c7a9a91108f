"""A fake ``tensorrt_llm`` shaped like the pinned release (``nemo_dapo/engines/trtllm_api_snapshot.json``): the same
modules, classes, fields, enum members, method signatures and RPC cycle, and nothing more (an unrecorded keyword is a
TypeError / ValueError, an unrecorded attribute an AttributeError). It proves our side of the contract only.

Its API is declared here, not read from the snapshot: ``nemo_dapo.engines.trtllm_check`` run against this fake
(tests/engines/test_trtllm_check.py) is what keeps the snapshot, the fake and the checker from drifting apart.

What it enforces from the release: ``LLM(**kw)`` validates ``TorchLlmArgs`` (extra keys refused, as llm.py does);
``update_weights`` (rlhf_utils.WorkerExtension) runs ``pre_reload_weights`` before the first bucket, reloads with
``allow_partial_loading=True``, and ``update_weights(None)`` runs ``process_weights_after_loading`` /
``post_load_weights`` / ``reset_prefix_cache``; a reload with CUDA graphs on is refused (PR #10456); sleep needs
``enable_sleep`` and known memory tags; ``TLLM_RAY_FORCE_LOCAL_CLUSTER`` selects the Ray cluster; an abort goes
``GenerationResult.abort`` -> ``RayExecutor.abort_request`` (leader only) -> ``BaseWorker.abort_request`` ->
``PyExecutor.cancel_request``, and the running request is finished as CANCELLED with what it generated so far.

The toy model: sample token t of a request is ``(seed + 3 t + prompt[-1] + W) % vocab`` with W the rounded sum of
``model.norm.weight`` (so a weight update changes the outputs); log-prob ``-0.1 (t + 1)``. The toy reads the request's
seed so that the tests can tell samples apart; the release's TorchSampler does not (one engine-wide generator). Calls
are appended as JSON lines to ``$FAKE_TRTLLM_LOG``; ``$FAKE_TRTLLM_FAIL`` names a weight whose bucket makes
``update_weights`` raise. Use ``make_engine`` as the server's ``--engine tests.engines.fake_trtllm:make_engine``;
``write_package(dir)`` puts an importable ``tensorrt_llm`` package (re-exporting this module) under ``dir``.
"""
from __future__ import annotations

import asyncio
import dataclasses
import enum
import functools
import json
import os
import sys
import types
from pathlib import Path
from typing import Literal, NamedTuple, Optional

import torch
from pydantic import BaseModel, ConfigDict

__version__ = "1.3.0rc1"
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))


def _log(**event):
    path = os.environ.get("FAKE_TRTLLM_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(event) + "\n")


# ---- tensorrt_llm/llmapi/llm_args.py ---------------------------------------------------------------------------
class CapacitySchedulerPolicy(str, enum.Enum):
    MAX_UTILIZATION = "MAX_UTILIZATION"
    GUARANTEED_NO_EVICT = "GUARANTEED_NO_EVICT"
    STATIC_BATCH = "STATIC_BATCH"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)


class KvCacheConfig(_Strict):
    free_gpu_memory_fraction: Optional[float] = None
    enable_block_reuse: bool = True
    max_tokens: Optional[int] = None


class SchedulerConfig(_Strict):
    capacity_scheduler_policy: CapacitySchedulerPolicy = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT


class TorchLlmArgs(_Strict):
    model: str
    skip_tokenizer_init: bool = False
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    moe_expert_parallel_size: Optional[int] = None
    enable_attention_dp: bool = False
    trust_remote_code: bool = False
    max_seq_len: Optional[int] = None
    max_input_len: int = 1024
    max_batch_size: int = 2048
    max_num_tokens: int = 8192
    kv_cache_config: KvCacheConfig = KvCacheConfig()
    scheduler_config: SchedulerConfig = SchedulerConfig()
    orchestrator_type: Optional[Literal["rpc", "ray"]] = None
    ray_worker_extension_cls: Optional[str] = None
    enable_sleep: bool = False
    cuda_graph_config: Optional[dict] = {}  # the release's default is CudaGraphConfig(): graphs on
    allreduce_strategy: Optional[Literal["AUTO", "NCCL", "UB", "MINLATENCY", "ONESHOT", "TWOSHOT", "LOWPRECISION",
                                         "MNNVL", "NCCL_SYMMETRIC"]] = "AUTO"
    disable_overlap_scheduler: bool = False


# ---- tensorrt_llm/sampling_params.py ---------------------------------------------------------------------------
class LogprobMode(str, enum.Enum):
    RAW = "raw"
    PROCESSED = "processed"


@dataclasses.dataclass(slots=True, kw_only=True)
class SamplingParams:
    max_tokens: int = 32
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    seed: Optional[int] = None
    end_id: Optional[int] = None
    pad_id: Optional[int] = None
    stop_token_ids: Optional[list] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    detokenize: bool = True
    logprobs: Optional[int] = None
    logprobs_mode: LogprobMode = LogprobMode.RAW
    n: int = 1

    def __post_init__(self):
        self.logprobs_mode = LogprobMode(self.logprobs_mode)  # ValueError for a mode the release lacks
        _log(op="SamplingParams", **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                                     if f.name != "logprobs_mode"}, logprobs_mode=self.logprobs_mode.value)


# ---- tensorrt_llm/executor/result.py + llmapi/llm.py -----------------------------------------------------------
class Logprob(NamedTuple):
    logprob: float
    rank: Optional[int] = None


@dataclasses.dataclass(slots=True)
class CompletionOutput:
    index: int = 0
    token_ids: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Optional[int] = None


class FinishReason(enum.Enum):  # tensorrt_llm.bindings.executor.FinishReason (the members the fake uses)
    NOT_FINISHED = 0
    CANCELLED = 5


class GenerationResultBase:
    __slots__ = ()

    @staticmethod
    def _f_finish(out: CompletionOutput, reason: str, stop=None) -> None:
        assert reason in ("stop", "length", "timeout", "cancelled")  # result.py's finish reasons
        out.finish_reason, out.stop_reason = reason, stop

    def _handle_sequence(self, finish_reasons, response_tensors, sequence_index):
        """One response of the executor: the new tokens and their log-probs are appended to what came before
        (a cancelled request keeps them); CANCELLED becomes 'cancelled'."""
        output = self.outputs[sequence_index]
        output.token_ids.extend(response_tensors["output_token_ids"])
        output.logprobs.extend(response_tensors["log_probs"])
        if finish_reasons[sequence_index] == FinishReason.CANCELLED:
            self._f_finish(output, 'cancelled')


class GenerationResult(GenerationResultBase):
    __slots__ = ()

    def abort(self) -> None:
        self._executor().abort_request(self.request_id)
        self._aborted = True


class RequestOutput(GenerationResult):
    __slots__ = ("request_id", "sampling_params", "outputs", "finished", "_executor", "_aborted", "_f_cancel",
                 "_f_event", "_f_task")

    def __init__(self, llm, rid, prompt, params):
        import weakref
        self.request_id = rid
        self.sampling_params = params
        self.outputs = [CompletionOutput()]
        self.finished = False
        self._executor, self._aborted = weakref.ref(llm._f_executor), False
        self._f_cancel, self._f_event = False, asyncio.Event()
        self._f_task = asyncio.ensure_future(self._f_run(llm, prompt, params))

    def finish_by_reason(self, reason) -> None:  # LlmRequest.finish_by_reason, reached by PyExecutor
        self._f_cancel = reason == FinishReason.CANCELLED

    async def _f_run(self, llm, prompt, p):
        out, w = self.outputs[0], llm._f_w
        stops = set(p.stop_token_ids or ())
        executor = llm._f_workers[0].engine  # the leader's PyExecutor
        executor._f_active[self.request_id] = self
        for t in range(p.max_tokens):
            await asyncio.sleep(0.002)
            executor._handle_canceled_requests()
            if self._f_cancel:
                self._handle_sequence([FinishReason.CANCELLED], {"output_token_ids": [], "log_probs": []}, 0)
                break
            tok = ((p.seed or 0) + 3 * t + prompt[-1] + w) % llm._f_vocab
            self._handle_sequence([FinishReason.NOT_FINISHED], {
                "output_token_ids": [tok], "log_probs": [{tok: Logprob(-0.1 * (t + 1), 1)}] if p.logprobs == 0 else []},
                0)
            if (tok == p.end_id and not p.ignore_eos) or tok in stops:
                self._f_finish(out, "stop", None if tok == p.end_id else tok)
                if tok in stops and not p.include_stop_str_in_output:  # what result.py does
                    out.token_ids.pop()
                    out.logprobs and out.logprobs.pop()
                break
        else:
            self._f_finish(out, "length")
        executor._f_active.pop(self.request_id, None)
        self.finished = True
        self._f_event.set()

    async def aresult(self):
        await self._f_event.wait()
        return self


# ---- tensorrt_llm/_torch/utils.py, virtual_memory.py, models ---------------------------------------------------
def get_device_uuid(device_id: int) -> str:
    return f"GPU-fake-{int(device_id)}"


class ExecutorMemoryType(str, enum.Enum):
    SAMPLER = "sampler"
    DRAFTER = "drafter"
    GUIDED_DECODER = "guided_decoder"
    SPEC_RESOURCES = "spec_resource_manager"
    MODEL_EXTRA = "model_extra"
    EXTRA_RESOURCES = "executor_extra"
    KV_CACHE = "kv_cache"
    MODEL_ENGINE_MAIN = "model"
    MODEL_ENGINE_DRAFT = "draft_model"


MODEL_CLASS_MAPPING = {a: object for a in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM",
                                           "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")}
REDUCED: list = []  # bytes of every tensor the adapter handed to reduce_tensor (one entry per device copy)


def fake_reduce_tensor(t: torch.Tensor):
    """Shaped like torch's CUDA reduction: (rebuild_fn, args) with the device index at args[6]."""
    REDUCED.append(t.numel() * t.element_size())
    return (lambda tensor, *rest: tensor), (t, None, None, None, None, None, t.device.index or 0)


# ---- the model a worker holds -------------------------------------------------------------------------------------
class _Module:
    """A fused module (q/k/v, gate/up, an expert's w1/w3): its parts must all arrive between pre_reload and finalize."""

    def __init__(self, parts):
        self.parts, self.got = set(parts), set()

    def pre_reload_weights(self):
        self.got = set()

    def process_weights_after_loading(self):
        if self.got and self.got != self.parts:
            raise RuntimeError(f"fused module got only {sorted(self.got)} of {sorted(self.parts)}")

    def post_load_weights(self):
        pass


class _Model:
    def __init__(self, weights: dict):
        self.weights = weights
        groups: dict = {}
        for name in weights:
            p = name.split(".")
            for g in FUSED:
                if len(p) >= 3 and p[-2] in g:
                    groups.setdefault((".".join(p[:-2]), g, p[-1]), set()).add(name)
        self._modules = {key: _Module(names) for key, names in groups.items()}
        self.first_pre_reload_weights = False

    def modules(self):
        return list(self._modules.values())

    def module_of(self, name):
        return next((m for m in self._modules.values() if name in m.parts), None)


class _Loader:
    def reload(self, model: _Model, weights: dict, allow_partial_loading: bool = False):
        if not allow_partial_loading and set(weights) != set(model.weights):
            raise ValueError("reload without allow_partial_loading needs every weight")
        if os.environ.get("FAKE_TRTLLM_FAIL") in weights:
            raise RuntimeError(f"reload failed on {os.environ['FAKE_TRTLLM_FAIL']}")
        _log(op="reload", names=sorted(weights), shapes=[list(weights[n].shape) for n in sorted(weights)])
        for name, t in weights.items():
            if name in model.weights:  # TRT-LLM skips unknown names silently
                model.weights[name] = t.clone()
                if model.module_of(name):
                    model.module_of(name).got.add(name)


class _RequestQueue:  # _torch/pyexecutor/executor_request_queue.py
    def __init__(self):
        self.canceled_req_ids = set()

    def enqueue_cancel_request(self, req_id) -> None:
        self.canceled_req_ids.add(req_id)


class PyExecutor:  # _torch/pyexecutor/py_executor.py: a cancel is queued, then the running request is finished
    def cancel_request(self, id) -> None:
        self.executor_request_queue.enqueue_cancel_request(id)
        _log(op="cancel_request", id=id)

    def _handle_canceled_requests(self) -> None:
        for req_id in list(self.executor_request_queue.canceled_req_ids):
            request = self._f_active.get(req_id)
            if request is not None:  # finished, not dropped: its final response carries what it generated
                request.finish_by_reason(FinishReason.CANCELLED)
            self.executor_request_queue.canceled_req_ids.discard(req_id)


class _Engine(PyExecutor):
    def __init__(self, llm, weights):
        self.model_engine = types.SimpleNamespace(model=_Model(weights), model_loader=_Loader())
        self.llm = llm
        self.executor_request_queue, self._f_active = _RequestQueue(), {}

    def reset_prefix_cache(self):
        _log(op="reset_prefix_cache")

    def control_action(self):
        import contextlib
        return contextlib.nullcontext()


def control_action_decorator(f):
    @functools.wraps(f)
    def wrapper(self, *args, **kwargs):
        with self.engine.control_action():
            return f(self, *args, **kwargs)
    return wrapper


# ---- tensorrt_llm/llmapi/rlhf_utils.py --------------------------------------------------------------------------
class WorkerExtension:
    @control_action_decorator
    def update_weights(self, ipc_handles: Optional[dict] = None):
        if self.llm_args.cuda_graph_config is not None:
            raise RuntimeError("pre_reload_weights is incompatible with CUDA graphs (PR #10456)")
        model = self.engine.model_engine.model
        if not model.first_pre_reload_weights:
            for module in model.modules():
                if not getattr(module, "_weights_removed", False):
                    module.pre_reload_weights()
            model.first_pre_reload_weights = True
        if ipc_handles is not None:
            device_uuid = get_device_uuid(self.device_id)
            if device_uuid not in ipc_handles:
                raise ValueError(f"Device UUID {device_uuid} not found in ipc_handles")
            weights = {}
            for name, (func, args) in ipc_handles[device_uuid]:
                list_args = list(args)
                list_args[6] = self.device_id
                weights[name] = func(*list_args)
            self.engine.model_engine.model_loader.reload(model, weights, allow_partial_loading=True)
            _log(op="update_weights", rank=self.device_id, names=sorted(weights))
        else:
            for module in model.modules():
                module.process_weights_after_loading()
                module.post_load_weights()
            self.engine.reset_prefix_cache()
            model.first_pre_reload_weights = False
            _log(op="update_weights", rank=self.device_id, final=True)

    def check_weights_updated(self) -> bool:
        return all(bool((t == 0).all()) for t in self.engine.model_engine.model.weights.values())


# ---- tensorrt_llm/executor/ray_gpu_worker.py, ray_executor.py ---------------------------------------------------
class RayGPUWorker:
    def __init__(self, device_id: int, llm_args):
        self.device_id, self.global_rank, self.llm_args = device_id, device_id, llm_args  # one node: rank = GPU

    @control_action_decorator
    def sleep(self, sleep_tags: list):
        self._f_memory(sleep_tags, asleep=True)

    @control_action_decorator
    def wakeup(self, wakeup_tags: list):
        self._f_memory(wakeup_tags, asleep=False)

    def _f_memory(self, tags, asleep):
        if not self.llm_args.enable_sleep:
            raise ValueError("Sleep feature is not enabled, please set enable_sleep=True in the LLM arguments.")
        [ExecutorMemoryType(t) for t in tags]  # ValueError for an unknown tag
        self.engine.llm._f_asleep = asleep
        if self.device_id == 0:
            _log(op="sleep" if asleep else "wakeup", tags=list(tags))


class RayExecutor:
    def __init__(self, world_size: int):
        local = os.environ.get("TLLM_RAY_FORCE_LOCAL_CLUSTER", "0") == "1"
        self.address = "local" if local else "auto"  # "auto" attaches to a Ray cluster already on the node
        self._f_workers = []
        _log(op="ray_init", address=self.address, world_size=world_size)

    def abort_request(self, request_id: int) -> None:
        self.call_all_ray_workers("abort_request", leader_only=True, async_call=False, request_id=request_id)

    def call_all_ray_workers(self, func: str, leader_only: bool, async_call: bool, *args, **kwargs):
        workers = self._f_workers[:1] if leader_only else self._f_workers
        return [getattr(w, func)(*args, **kwargs) for w in workers]


class BaseWorker:  # executor/base_worker.py
    def abort_request(self, client_id: int) -> None:
        request_id = self._client_id_to_request_id.get(client_id)
        if request_id is None:  # already finished: the release logs a warning and sends nothing
            return
        self.engine.cancel_request(request_id)


class _Worker(RayGPUWorker, BaseWorker):  # RayGPUWorker; ray_worker_extension_cls is mixed in by RayWorkerWrapper
    def __init__(self, llm, rank, weights, llm_args):
        RayGPUWorker.__init__(self, rank, llm_args)
        self.engine = _Engine(llm, weights)
        self._client_id_to_request_id = {}

    def abort_request(self, request_id: int) -> None:  # ray_gpu_worker.RayWorkerWrapper forwards to BaseWorker
        BaseWorker.abort_request(self, request_id)


def resolve_obj_by_qualname(qualname: str):
    import importlib
    module, _, attr = qualname.rpartition(".")
    return getattr(importlib.import_module(module), attr)


class RayWorkerWrapper:
    @staticmethod
    def _inject_worker_extension(worker_class: type, qualname: str) -> type:
        """The extension resolved by its import path, an attribute the worker already has refused, then a subclass
        with the worker first in the MRO."""
        try:
            ext = resolve_obj_by_qualname(qualname)
        except Exception as e:
            raise RuntimeError(f"Failed to load worker extension {qualname}") from e
        for name in dir(ext):
            if not name.startswith("__") and hasattr(worker_class, name):
                raise ValueError(f"Worker class {worker_class.__name__} already has an attribute {name}, which "
                                 f"conflicts with the worker extension {ext.__name__}")
        return type(f"{worker_class.__name__}With{ext.__name__}", (worker_class, ext),
                    {"__module__": worker_class.__module__})


# ---- tensorrt_llm/llmapi/llm.py -----------------------------------------------------------------------------------
class LLM:
    def __init__(self, model, **kwargs):
        backend = kwargs.pop("backend", "pytorch")  # _TorchLLM pops backend before building TorchLlmArgs
        try:
            args = TorchLlmArgs(model=model, **kwargs)
        except Exception as e:  # pydantic's ValidationError; llm.py raises ValueError "got invalid argument"
            raise ValueError(f"got invalid argument: {e}") from None
        if backend != "pytorch" or args.orchestrator_type != "ray" or not args.ray_worker_extension_cls:
            raise ValueError("the fake models the PyTorch backend with a Ray worker extension only")
        worker_cls = RayWorkerWrapper._inject_worker_extension(_Worker, args.ray_worker_extension_cls)
        if not issubclass(worker_cls, WorkerExtension):
            raise ValueError("the fake's workers need the release's RL hook (rlhf_utils.WorkerExtension)")
        config = json.load(open(os.path.join(model, "config.json")))
        from safetensors.torch import load_file
        weights = {}
        for f in sorted(os.listdir(model)):
            if f.endswith(".safetensors"):
                weights.update(load_file(os.path.join(model, f)))
        self._f_vocab, self._f_asleep, self._f_n, self._f_args = int(config["vocab_size"]), False, 0, args
        self._f_executor = RayExecutor(args.tensor_parallel_size)
        self._f_workers = [worker_cls(self, r, dict(weights), args) for r in range(args.tensor_parallel_size)]
        self._f_executor._f_workers = self._f_workers
        self._f_reweigh()
        dumped = args.model_dump(exclude_unset=True, exclude={"kv_cache_config", "scheduler_config"})
        _log(op="LLM", backend=backend, **dumped,
             kv_cache_config=args.kv_cache_config.model_dump(exclude_unset=True),
             scheduler_config={k: getattr(v, "value", v)
                               for k, v in args.scheduler_config.model_dump(exclude_unset=True).items()}
             if "scheduler_config" in kwargs else None)

    def _f_reweigh(self):
        w = self._f_workers[0].engine.model_engine.model.weights["model.norm.weight"]
        self._f_w = int(round(float(w.sum())))

    def generate_async(self, inputs, sampling_params=None, streaming: bool = False):
        asyncio.get_running_loop()  # RequestOutput.aresult needs the loop it was made in (result.py)
        if self._f_asleep:
            raise RuntimeError("engine is asleep")
        if any(w.engine.model_engine.model.first_pre_reload_weights for w in self._f_workers):
            raise RuntimeError("generation during an unfinished weight update")
        self._f_n += 1
        self._f_workers[0]._client_id_to_request_id[self._f_n] = self._f_n
        return RequestOutput(self, self._f_n, list(inputs), sampling_params)

    def _collective_rpc(self, method, args=(), kwargs=None, non_block=False, unique_reply_rank=None,
                        target_ranks=None):
        public = {n for n in dir(type(self._f_workers[0])) if not n.startswith("_")}
        if method not in public:
            raise AttributeError(f"worker has no RPC method {method!r}")
        if method == "update_weights" and args[0] is not None:
            expect = {get_device_uuid(w.device_id) for w in self._f_workers}
            if set(args[0]) != expect:
                raise ValueError(f"Device UUID set {sorted(args[0])} != workers {sorted(expect)}")
        out = _on_every_worker(self._f_workers, method, args, kwargs or {})
        if method == "update_weights" and args[0] is None:
            self._f_reweigh()
        return out

    def shutdown(self):
        _log(op="shutdown")


def _on_every_worker(workers, method, args, kwargs) -> list:
    """Ray runs a collective RPC on every worker at once (a collective inside one must not wait for the next
    worker's call): one thread per worker here; answers in rank order, the first error raised."""
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(len(workers)) as pool:
        futures = [pool.submit(getattr(w, method), *args, **kwargs) for w in workers]
        return [f.result() for f in futures]


# ---- the package -------------------------------------------------------------------------------------------------
MODULES = {
    "tensorrt_llm": ["LLM", "SamplingParams", "__version__"],
    "tensorrt_llm.llmapi": ["LLM", "SamplingParams", "KvCacheConfig", "SchedulerConfig", "CapacitySchedulerPolicy"],
    "tensorrt_llm.llmapi.llm_args": ["TorchLlmArgs", "KvCacheConfig", "SchedulerConfig", "CapacitySchedulerPolicy"],
    "tensorrt_llm.llmapi.llm": ["LLM", "RequestOutput"],
    "tensorrt_llm.llmapi.rlhf_utils": ["WorkerExtension"],
    "tensorrt_llm._ray_utils": ["control_action_decorator"],
    "tensorrt_llm.sampling_params": ["SamplingParams", "LogprobMode"],
    "tensorrt_llm.executor": [],
    "tensorrt_llm.executor.result": ["CompletionOutput", "Logprob", "GenerationResultBase", "GenerationResult"],
    "tensorrt_llm.executor.ray_executor": ["RayExecutor"],
    "tensorrt_llm.executor.base_worker": ["BaseWorker"],
    "tensorrt_llm.executor.ray_gpu_worker": ["RayGPUWorker", "RayWorkerWrapper"],
    "tensorrt_llm._torch": [],
    "tensorrt_llm._torch.utils": ["get_device_uuid"],
    "tensorrt_llm._torch.pyexecutor": [],
    "tensorrt_llm._torch.pyexecutor.py_executor": ["PyExecutor"],
    "tensorrt_llm._torch.virtual_memory": ["ExecutorMemoryType"],
    "tensorrt_llm._torch.models": [],
    "tensorrt_llm._torch.models.modeling_utils": ["MODEL_CLASS_MAPPING"],
}


def install() -> None:
    """Put the fake package into sys.modules (this process only)."""
    me = sys.modules[__name__]
    for name, names in MODULES.items():
        m = types.ModuleType(name)
        m.__path__ = []  # a package, so that submodules resolve
        for n in names:
            setattr(m, n, getattr(me, n))
        sys.modules[name] = m
    for name in MODULES:
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, sys.modules[name])
    import torch.multiprocessing.reductions as red
    red.reduce_tensor = fake_reduce_tensor  # CPU tensors stand in for CUDA ones in this process only


def write_package(root) -> Path:
    """An importable ``tensorrt_llm`` under ``root`` whose modules re-export this fake (for a subprocess)."""
    root = Path(root)
    for name, names in MODULES.items():
        d = root.joinpath(*name.split("."))
        d.mkdir(parents=True, exist_ok=True)
        text = f"from {__name__} import {', '.join(names)}  # noqa: F401\n" if names else ""
        (d / "__init__.py").write_text(text)
    return root


def make_engine(model_dir, **options):
    install()
    from nemo_dapo.engines.trtllm import TRTLLMEngine
    options.setdefault("devices", ["cpu"] * int(options.get("tensor_parallel_size", 1)))
    return TRTLLMEngine(model_dir, **options)
