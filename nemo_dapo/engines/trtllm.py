"""TensorRT-LLM as a rollout engine: ``TRTLLMEngine`` drives ``tensorrt_llm.LLM(backend="pytorch")`` (in-flight batching).

Written against ONE release, the one ``containers/Dockerfile.engine`` pins (TensorRT-LLM v1.3.0rc1): every name used
here is recorded, with the file of that release it comes from, in ``trtllm_api_snapshot.json`` (next to this file);
``trtllm_check`` verifies the installed package against it when the image is built, and the contract tests run this
adapter against a fake shaped like that release (tests/engines/fake_trtllm.py).

* Async engine, single-threaded server: ``LLM.generate_async`` returns a ``RequestOutput`` whose ``aresult()`` is
  awaitable only when created inside an event loop. The adapter runs one asyncio loop in a helper thread: ``add``
  submits there (and waits for the submission, so a rejected request fails in ``add``), a coroutine per sample
  awaits the result and puts it on a queue, and ``step()`` drains that queue, waiting at most ``poll_s`` for the
  first item (non-blocking for the server loop).
* Sample k of request ``id`` is one TRT-LLM request (n=1, seed ``seed * 1_000_003 + k``): per-sample aborts, and the
  seed is passed, but the release's PyTorch sampler (TorchSampler) draws every request from one engine-wide generator
  (per-request seeds came later, PR #17172), so a TensorRT-LLM run does not repeat sample for sample;
  ``enable_block_reuse`` lets a prompt's KV blocks be reused once stored.
* Tokens only (``skip_tokenizer_init``): ``end_id`` is config.json's first EOS, every EOS also a stop token, with
  ``include_stop_str_in_output`` so a stop token stays in ``token_ids`` (``executor/result.py`` cuts it otherwise).
  The PyTorch sampler appends the sampled token before checking ``end_id``, so an EOS end is kept too; a "stop"
  sample that does not end in one of its stop tokens is reported as an error, never silently passed on.
* Log-probs: ``logprobs=0`` (the sampled token only) with ``logprobs_mode="processed"``: log-probabilities after
  temperature / top-k / top-p (``sampling_params.LogprobMode.PROCESSED``), our convention (``base.py``).
* Weights: TensorRT-LLM's RL hook ``rlhf_utils.WorkerExtension.update_weights`` through ``LLM._collective_rpc`` (Ray
  orchestrator). The release's cycle: the first ``update_weights(handles)`` runs every module's
  ``pre_reload_weights`` (PR #10456), each bucket is loaded with ``model_loader.reload(...,
  allow_partial_loading=True)`` (PR #9224), and ``finish_weights`` sends ``update_weights(None)``:
  ``process_weights_after_loading`` / ``post_load_weights`` per module, MoE load-balancer finalisation,
  ``reset_prefix_cache``. ``handles`` maps each engine GPU's UUID to CUDA IPC handles (``reduce_tensor``); with
  ``refit_copy="shared"`` (default) a bucket is copied to the engine's first GPU ONCE and every rank opens that copy
  (each rank's loader reads its own slice over the GPUs' peer link), so the host-to-device bytes of a refit are the
  model's size, not TP times it; ``"per_rank"`` copies it to every GPU. TRT-LLM skips unknown names silently, so
  names and shapes are checked against the checkpoint's safetensors headers first, and the parts of a fused module
  (q/k/v, gate/up, an expert's w1/w3) are held back on the GPU until the bucket that completes them.
* The collective weight transport (weight_group.py): each Ray worker receives the trainer's broadcast itself
  through our extension of that hook (``trtllm_worker.GroupWorkerExtension``, ``join_weight_group`` /
  ``receive_weights`` here), one group rank per worker; the finalize is the same ``update_weights(None)``.
* CUDA graphs are off (``cuda_graph_config=None``): at this release ``pre_reload_weights`` is incompatible with CUDA
  graphs when a module rebuilds its tensors (PR #10456; the release's sleep test builds its LLM the same way; the
  graph-safe reload, PR #11267, is later).
* Several TP engines in one run: ``allreduce_strategy="NCCL"`` (``nemo_dapo.cluster.engine_options`` sets it), the
  workaround TensorRT-LLM's own ``AsyncLLM`` (llmapi/async_llm.py) and verl apply: the default AllReduce gave wrong
  log-probs at large batch with several rollout instances (nvbugs/5727691).
* Sleep, this release's API: ``enable_sleep=True`` at construction, then ``_collective_rpc("sleep", (tags,))`` /
  ``("wakeup", (tags,))`` (executor/ray_gpu_worker.py; no ``SleepConfig`` / ``LLM.release()`` yet); level 1 frees
  the KV cache, level 2 the model memory too (tags configurable). The KV pool is allocated without restore
  (``RestoreMode.NONE``) and ``wakeup`` leaves the prefix-reuse tree alone; only the update's finalize resets it. So
  with block reuse a KV cache released by ``sleep`` serves no request until a weight update has finished (every
  sleep of the training loop is followed by a refit); generating before that is refused, not read from zeroed blocks.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import queue
import threading
from typing import Iterable, Optional, Sequence

import torch

from .base import (HF_HEAD, Completion, EngineError, EngineWeightError, Request, Sample, check_usable, check_weight,
                   read_checkpoint)
from .trtllm_worker import EXTENSION as WORKER_EXTENSION  # the release's RL hook plus the group receive

SEED_STRIDE = 1_000_003
DAPO_PROMPT_BUDGET, DAPO_RESPONSE_BUDGET = 2048, 20480
_FINISH = {"stop": "stop", "length": "length", "cancelled": "aborted", "timeout": "aborted"}
_FUSED = ({"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"}, {"w1", "w3"})
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def fused_group(name: str) -> Optional[tuple]:
    """'model.layers.0.self_attn.k_proj.bias' -> ('model.layers.0.self_attn', frozenset(q,k,v), 'bias'), else None."""
    parts = name.split(".")
    if len(parts) < 3:
        return None
    for group in _FUSED:
        if parts[-2] in group:
            return ".".join(parts[:-2]), frozenset(group), parts[-1]
    return None


class TRTLLMEngine:
    """EngineAdapter over TensorRT-LLM's PyTorch-backend ``LLM``. ``model_dir``: a local HF checkpoint.

    ``prompt_budget`` + ``response_budget`` = ``max_seq_len`` (DAPO: 2,048 + 20,480); ``max_input_len`` defaults to
    the prompt budget (TRT-LLM's own default is 1,024). ``devices``: the engine's GPUs, one per TP rank.
    ``allreduce_strategy``: passed to ``LLM`` when set ("NCCL" for several TP engines in a run). ``refit_copy``:
    "shared" (one device copy of a bucket for all ranks) or "per_rank". ``llm_kwargs``: further ``LLM`` arguments
    (checked against the recorded API)."""

    def __init__(self, model_dir, *, prompt_budget: int = DAPO_PROMPT_BUDGET,
                 response_budget: int = DAPO_RESPONSE_BUDGET, max_input_len: Optional[int] = None,
                 max_batch_size: int = 512, max_num_tokens: int = 16384, free_gpu_memory_fraction: float = 0.85,
                 enable_block_reuse: bool = True, capacity_scheduler: str = "max_utilization",
                 tensor_parallel_size: int = 1, moe_expert_parallel_size: int = 1,
                 dtype: str = "auto", enable_sleep: bool = True, sleep_tags: Optional[dict] = None,
                 allreduce_strategy: Optional[str] = None, refit_copy: str = "shared",
                 devices: Optional[Sequence[str]] = None, poll_s: float = 0.002, abort_wait_s: float = 2.0,
                 submit_timeout_s: float = 60.0, llm_kwargs: Optional[dict] = None, name: str = "trtllm",
                 **unknown):
        self.name, self.model_dir = name, os.fspath(model_dir)
        if unknown:
            known = sorted(set(inspect.signature(TRTLLMEngine).parameters) - {"model_dir", "unknown"})
            raise EngineError(f"engine {name!r}: unknown option(s) {sorted(unknown)}; the options are {known} "
                              "(other LLM arguments go in llm_kwargs)")
        if min(prompt_budget, response_budget, max_batch_size, max_num_tokens) < 1:
            raise EngineError(f"engine {name!r}: prompt_budget, response_budget, max_batch_size and max_num_tokens "
                              "must be >= 1")
        self._read_model(dtype)
        # max_utilization admits a request at its current context and pauses one if KV blocks run out;
        # TRT-LLM's default (guaranteed_no_evict) reserves KV up to max_tokens for every request, so with a 20k cap
        # and a ~6k mean length about 3x fewer requests run at once (`nemo-dapo plan` prints the difference).
        policy = str(capacity_scheduler).upper()
        if policy not in ("MAX_UTILIZATION", "GUARANTEED_NO_EVICT"):
            raise EngineError(f"engine {name!r}: capacity_scheduler={capacity_scheduler!r}; use max_utilization or "
                              "guaranteed_no_evict")
        self._max_seq_len, self._max_batch_size = int(prompt_budget + response_budget), int(max_batch_size)
        self._max_input_len = int(max_input_len or prompt_budget)
        self._devices = list(devices or [f"cuda:{i}" for i in range(int(tensor_parallel_size))])
        if refit_copy not in ("shared", "per_rank"):
            raise EngineError(f"engine {name!r}: refit_copy={refit_copy!r}; use shared or per_rank")
        if len(self._devices) != int(tensor_parallel_size):
            raise EngineError(f"engine {name!r}: {len(self._devices)} devices for tensor_parallel_size="
                              f"{tensor_parallel_size}; give one device per TP rank")
        self._refit_copy = refit_copy
        self._sleep_tags = {1: ["kv_cache"], 2: ["kv_cache", "model"], **{int(k): list(v) for k, v in
                                                                            (sleep_tags or {}).items()}}
        self._poll_s, self._abort_wait_s, self._submit_timeout_s = poll_s, abort_wait_s, submit_timeout_s
        args = dict(model=self.model_dir, backend="pytorch", skip_tokenizer_init=True, dtype=dtype,
                    tensor_parallel_size=int(tensor_parallel_size),
                    moe_expert_parallel_size=int(moe_expert_parallel_size),
                    max_seq_len=self._max_seq_len, max_input_len=self._max_input_len,
                    max_batch_size=self._max_batch_size, max_num_tokens=int(max_num_tokens),
                    orchestrator_type="ray", ray_worker_extension_cls=WORKER_EXTENSION, cuda_graph_config=None)
        if enable_sleep:
            args["enable_sleep"] = True
        if allreduce_strategy is not None:
            args["allreduce_strategy"] = str(allreduce_strategy)
        self._llm = self._start_llm(args, policy, float(free_gpu_memory_fraction), bool(enable_block_reuse),
                                    llm_kwargs or {})
        self._done: queue.Queue = queue.Queue()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="trtllm-results")
        self._thread.start()
        self._live: dict = {}  # id -> {"handles": [RequestOutput], "samples": [Sample | None], "stops", "logprobs"}
        self._pending: dict = {}  # fused group -> {name: device tensors}, waiting for the rest of the group
        self._received: set = set()
        self._updating, self._broken, self._asleep = False, None, False
        self._block_reuse = bool(enable_block_reuse)
        self._kv_stale = False  # the KV cache was released by a sleep and no update's finalize has run since

    def _read_model(self, dtype: str) -> None:
        """The checkpoint's config, tensor shapes and EOS ids, and the weights' dtype (``dtype`` or config.json's)."""
        name = self.name
        ckpt = read_checkpoint(self.model_dir, name)
        self._config, self._shapes, self._eos, self._tied = ckpt.config, ckpt.shapes, ckpt.eos_ids, ckpt.tied
        if not self._eos:
            raise EngineError(f"engine {name!r}: config.json of {self.model_dir!r} has no eos_token_id; TensorRT-LLM "
                              "needs an end id when it runs without a tokenizer")
        cfg_dtype = self._config.get("torch_dtype") or self._config.get("dtype") or "bfloat16"
        self._dtype = _DTYPES.get(cfg_dtype if dtype == "auto" else dtype)
        if self._dtype is None:
            raise EngineError(f"engine {name!r}: dtype {dtype!r} (config: {cfg_dtype!r}); use one of {sorted(_DTYPES)}")

    def _start_llm(self, args: dict, policy: str, kv_fraction: float, block_reuse: bool, llm_kwargs: dict):
        """``LLM(**args, kv_cache_config=..., scheduler_config=..., **llm_kwargs)``; its errors as EngineError."""
        name = self.name
        try:
            import tensorrt_llm
            from tensorrt_llm import LLM, SamplingParams
            from tensorrt_llm.llmapi import CapacitySchedulerPolicy, KvCacheConfig, SchedulerConfig
        except ImportError as e:
            raise EngineError(f"engine {name!r}: tensorrt_llm is not importable ({e}); run the engine server in the "
                              "TensorRT-LLM release container") from e
        self._version, self._SamplingParams = getattr(tensorrt_llm, "__version__", "?"), SamplingParams
        kv = KvCacheConfig(free_gpu_memory_fraction=kv_fraction, enable_block_reuse=block_reuse)
        scheduler = SchedulerConfig(capacity_scheduler_policy=getattr(CapacitySchedulerPolicy, policy))
        args = dict(args, kv_cache_config=kv, scheduler_config=scheduler)
        clash = sorted(set(llm_kwargs) & set(args))
        if clash:
            raise EngineError(f"engine {name!r}: llm_kwargs {clash} are set by the adapter; use its own options")
        try:
            return LLM(**args, **llm_kwargs)
        except (TypeError, ValueError) as e:
            raise EngineError(f"engine {name!r}: TensorRT-LLM {self._version} rejected the LLM arguments: {e}") from e
        except ImportError as e:  # ray (optional in TensorRT-LLM) is imported when the Ray executor starts
            raise EngineError(f"engine {name!r}: a TensorRT-LLM dependency is not importable ({e}); the engine image "
                              "must provide it (containers/Dockerfile.engine installs and checks ray)") from e

    def info(self) -> dict:
        return {"engine": "trtllm", "name": self.name, "model": self.model_dir, "trtllm_version": self._version,
                "vocab_size": int(self._config["vocab_size"]), "max_seq_len": self._max_seq_len,
                "max_input_len": self._max_input_len, "max_batch_size": self._max_batch_size,
                "dtype": str(self._dtype).replace("torch.", ""), "devices": self._devices, "sleep_frees_memory": True,
                "refit_copy": self._refit_copy, "sleep_releases": self._sleep_releases(),
                "wake_tags": ["weights", "kv_cache"], "weight_group_ranks": len(self._devices)}

    def _sleep_releases(self) -> dict:
        """What each sleep level frees in the protocol's words: the KV cache, and "weights" for any other memory tag
        (the model's and the executor's buffers, woken together before a refit)."""
        return {str(level): (["kv_cache"] if "kv_cache" in tags else []) + (["weights"] if set(tags) - {"kv_cache"}
                                                                              else [])
                for level, tags in self._sleep_tags.items()}

    # ---- generation -----------------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self._check_alive(stepping=True)
        if self._kv_stale:
            raise EngineError(f"engine {self.name!r}: its KV cache was released by a sleep and woken without a weight "
                              "update since; at this release only the update's finalize resets the prefix cache that "
                              "still points into the released blocks, so a request now could read zeroed KV. Send a "
                              "weight update (the same weights will do) before generating")
        if request.id in self._live:
            raise EngineError(f"engine {self.name!r}: request {request.id!r} is already running")
        if len(request.prompt_ids) > self._max_input_len or \
                len(request.prompt_ids) + request.max_new_tokens > self._max_seq_len:
            raise EngineError(f"engine {self.name!r}: request {request.id!r} needs {len(request.prompt_ids)} prompt + "
                              f"{request.max_new_tokens} new tokens; the engine holds max_input_len="
                              f"{self._max_input_len}, max_seq_len={self._max_seq_len} (raise prompt_budget / "
                              "response_budget)")
        # ignore_eos as TRT-LLM means it (end_id -1): EOS does not end a sample; the request's stop tokens still do
        stops = list(dict.fromkeys(list(request.stop_token_ids) + ([] if request.ignore_eos else self._eos)))
        entry = {"handles": [], "samples": [None] * request.n, "stops": set(stops), "logprobs": request.logprobs}
        try:
            for k in range(request.n):
                seed = None if request.seed is None else (int(request.seed) * SEED_STRIDE + k) % (1 << 63)
                params = self._SamplingParams(
                    max_tokens=request.max_new_tokens, temperature=request.temperature, top_p=request.top_p,
                    top_k=request.top_k, seed=seed, end_id=self._eos[0], pad_id=self._eos[0],
                    stop_token_ids=stops or None, include_stop_str_in_output=True, ignore_eos=request.ignore_eos,
                    detokenize=False, logprobs=0 if request.logprobs else None, logprobs_mode="processed")
                fut = asyncio.run_coroutine_threadsafe(self._submit(request.id, k, list(request.prompt_ids), params),
                                                       self._loop)
                entry["handles"].append(fut.result(timeout=self._submit_timeout_s))
        except Exception as e:
            for h in entry["handles"]:
                self._loop.call_soon_threadsafe(h.abort)
            raise EngineError(f"engine {self.name!r}: TensorRT-LLM rejected request {request.id!r}: {e}") from e
        self._live[request.id] = entry

    async def _submit(self, rid: str, k: int, prompt: list, params):
        handle = self._llm.generate_async(prompt, sampling_params=params)
        asyncio.ensure_future(self._await(rid, k, handle))
        return handle

    async def _await(self, rid: str, k: int, handle) -> None:
        try:
            await handle.aresult()
            self._done.put((rid, k, handle, None))
        except Exception as e:  # noqa: BLE001 - handed to step() in the server's thread
            self._done.put((rid, k, handle, e))

    def _collect(self, rid: str, k: int, handle, error) -> None:
        entry = self._live.get(rid)
        if entry is None or entry["handles"][k] is not handle or entry["samples"][k] is not None:
            return  # an aborted request's late result
        if error is not None:
            raise EngineError(f"engine {self.name!r}: sample {k} of {rid!r} failed in TensorRT-LLM: {error!r}")
        out = handle.outputs[0]
        tokens = [int(t) for t in out.token_ids]
        finish = _FINISH.get(out.finish_reason)
        if finish is None:
            raise EngineError(f"engine {self.name!r}: sample {k} of {rid!r} ended with {out.finish_reason!r}")
        logprobs = None
        if entry["logprobs"]:
            raw = list(out.logprobs or ())
            if finish == "aborted" and len(raw) != len(tokens):
                # a cancel can split a token from its log-prob either way (releases differ, and result.py trims a
                # surplus of log-probs only for requests not cancelled): keep the tokens that have one
                n = min(len(raw), len(tokens))
                tokens, raw = tokens[:n], raw[:n]
            if len(raw) != len(tokens):
                raise EngineError(f"engine {self.name!r}: sample {k} of {rid!r} has {len(tokens)} tokens but "
                                  f"{len(raw)} log-probs (finish {out.finish_reason!r})")
            # pytorch backend: one {token: Logprob} per token (TokenLogprobs), or a bare float list
            logprobs = [float(p[t].logprob) if isinstance(p, dict) else float(p) for t, p in zip(tokens, raw)]
        if finish == "stop" and (not tokens or tokens[-1] not in entry["stops"]):
            raise EngineError(f"engine {self.name!r}: sample {k} of {rid!r} stopped without its stop token "
                              f"(last {tokens[-1:]}, stops {sorted(entry['stops'])}): the EOS-kept convention broke")
        entry["samples"][k] = Sample(tokens, logprobs, finish)

    def step(self) -> list:
        self._check_alive(stepping=True)
        touched = set()
        try:
            item = self._done.get(timeout=self._poll_s)
        except queue.Empty:
            return []
        while item is not None:
            self._collect(*item)
            touched.add(item[0])
            try:
                item = self._done.get_nowait()
            except queue.Empty:
                item = None
        return [self._complete(r) for r in sorted(touched)
                if r in self._live and all(s is not None for s in self._live[r]["samples"])]

    def has_work(self) -> bool:
        return bool(self._live)

    def abort(self, ids: Sequence[str]) -> list:
        """Aborted samples come back with the tokens TensorRT-LLM reports for them within ``abort_wait_s``."""
        targets = [r for r in ids if r in self._live]
        for rid in targets:
            for k, h in enumerate(self._live[rid]["handles"]):
                if self._live[rid]["samples"][k] is None:
                    self._loop.call_soon_threadsafe(h.abort)
        wait = [(r, k) for r in targets for k, s in enumerate(self._live[r]["samples"]) if s is None]
        deadline = self._abort_wait_s
        while wait and deadline > 0:
            with contextlib.suppress(queue.Empty):
                rid, k, handle, error = self._done.get(timeout=0.01)
                with contextlib.suppress(EngineError):
                    self._collect(rid, k, handle, error)
                wait = [(r, j) for r, j in wait if self._live[r]["samples"][j] is None]
            deadline -= 0.01
        for rid in targets:
            entry = self._live[rid]
            entry["samples"] = [s or Sample([], [] if entry["logprobs"] else None, "aborted") for s in entry["samples"]]
        return [self._complete(r) for r in targets]

    def _complete(self, rid: str) -> Completion:
        return Completion(rid, list(self._live.pop(rid)["samples"]))

    # ---- weights --------------------------------------------------------------------------------------------------
    def load_weights(self, named: Iterable[tuple]) -> None:
        self._check_alive()
        ready = []
        try:
            for name, tensor in named:
                if self._tied and name == HF_HEAD:
                    continue  # tied: TensorRT-LLM's HF mapper skips lm_head and shares the embedding
                self._checked(name, tensor)
                targets = self._devices[:1] if self._refit_copy == "shared" else self._devices
                ready += self._hold(name, [tensor.detach().to(device=d, dtype=self._dtype, copy=True)
                                           for d in targets])
        except EngineWeightError:
            if not self._updating:  # a refused first bucket: nothing of it may complete a fused module later
                self._pending = {}
            raise
        self._updating = True
        if ready:
            self._send(ready)
            self._received.update(n for n, _ in ready)

    def _hold(self, name: str, value) -> list:
        """[(name, value)] that may be loaded now: ``name`` alone, or nothing while it is part of a fused module
        whose other parts are still to come, or all of that module's parts once this one completes it."""
        group = fused_group(name)
        if group is None:
            return [(name, value)]
        held = self._pending.setdefault(group, {})
        held[name] = value
        prefix, parts, leaf = group
        need = {f"{prefix}.{p}.{leaf}" for p in parts} & set(self._shapes)
        return list(self._pending.pop(group).items()) if need <= set(held) else []

    # ---- the collective weight transport, received in the Ray workers (trtllm_worker.py) ----------------------------
    def join_weight_group(self, host: str, port: int, rank: int, world_size: int, timeout_s: float,
                          backend: str = "gloo") -> None:
        """Every worker joins the trainer's weight group (weight_group.py), as ranks ``rank`` onwards; over nccl
        each on its own GPU."""
        self._check_alive()
        self._llm._collective_rpc("nemo_dapo_join", args=(host, port, rank, world_size, timeout_s, backend))

    def check_weight_specs(self, specs: list) -> None:
        """Names, shapes and dtypes of a broadcast bucket, checked from its specs before the server agrees to receive
        it (as ``load_weights`` checks tensors): a refused bucket is refused before anyone enters the broadcast."""
        from .protocol import dtype_of
        self._check_alive()
        for spec in specs:
            if not (self._tied and spec["name"] == HF_HEAD):  # dropped in the workers, as load_weights drops it
                self._checked(spec["name"], torch.empty(spec["shape"], dtype=dtype_of(spec["dtype"]), device="meta"))

    def _checked(self, name: str, tensor: torch.Tensor) -> None:
        """``check_weight`` against the checkpoint's shape; a refusal after part of an update breaks the engine."""
        shape = self._shapes.get(name)
        try:
            check_weight(name, tensor, None if shape is None else torch.empty(shape, device="meta"), self.name,
                         into=self._dtype)
        except EngineWeightError:
            if self._updating:
                self._broken = f"a weight update was interrupted by the rejected tensor {name!r}"
            raise

    def receive_weights(self, specs: list, size: int) -> None:
        """One broadcast bucket (checked by ``check_weight_specs``), received and loaded by the workers; the parts of
        a fused module are held there until their module is complete. A failed broadcast raises ``GroupBroken``
        (the update stays open: the next full update completes it)."""
        from .weight_group import GroupBroken, workers_failure
        skip = [HF_HEAD] if self._tied else []  # tied: TensorRT-LLM's HF mapper shares the embedding
        first = not self._updating  # nothing of this update is in the model yet
        ready = [n for s in specs if s["name"] not in skip for n, _ in self._hold(s["name"], None)]
        self._updating = True
        dtype = str(self._dtype).replace("torch.", "")
        try:
            answers = self._llm._collective_rpc("nemo_dapo_receive", args=(specs, size, dtype, ready, skip))
        except Exception as e:  # a failed load leaves the model half-updated
            self._broken = f"TensorRT-LLM failed to load a broadcast bucket ({type(e).__name__}: {e})"
            raise EngineWeightError(f"engine {self.name!r}: {self._broken}", specs[0]["name"] if specs else "") from e
        bad = workers_failure(answers)
        if bad is not None and bad[0] == "broken":
            raise GroupBroken(bad[1])
        if bad is not None:  # nothing of the bucket loaded: as the server's own check on the shm path
            if first:
                self._updating, self._pending = False, {}
            else:
                self._broken = f"a weight update was interrupted by the rejected tensor {bad[1]!r}"
            raise EngineWeightError(f"engine {self.name!r}: weight {bad[1]!r} holds NaN or inf values, or values "
                                    "beyond the engine's dtype; refusing it", bad[1])
        self._received.update(ready)

    def _send(self, ready: list) -> None:
        from tensorrt_llm._torch.utils import get_device_uuid
        from torch.multiprocessing.reductions import reduce_tensor
        handles = {}
        shared = [(n, reduce_tensor(copies[0])) for n, copies in ready] if self._refit_copy == "shared" else None
        for i, device in enumerate(self._devices):
            # a device's UUID by its index among the engine's GPUs (the Ray workers see all of them)
            uuid = get_device_uuid(i if torch.device(device).index is None else torch.device(device).index)
            handles[uuid] = shared if shared is not None else [(n, reduce_tensor(copies[i])) for n, copies in ready]
        for _, copies in ready:
            for c in copies:
                if c.is_cuda:
                    torch.cuda.synchronize(c.device)  # the copies must exist before another process maps them
        self._rpc("update_weights", handles, first=ready[0][0])

    def _rpc(self, method: str, arg, first: str = "") -> None:
        try:
            self._llm._collective_rpc(method, args=(arg,))
        except Exception as e:  # a failed call leaves the model half-updated
            self._broken = f"TensorRT-LLM failed in {method}({'None' if arg is None else '...'}): {e!r}"
            raise EngineWeightError(f"engine {self.name!r}: {self._broken}", first) from e

    def finish_weights(self) -> None:
        self._check_alive()
        if self._pending:
            missing = sorted(f"{p}.{part}.{leaf}" for (p, parts, leaf), held in self._pending.items()
                             for part in parts if f"{p}.{part}.{leaf}" in self._shapes
                             and f"{p}.{part}.{leaf}" not in held)
            self._pending.clear()
            self._broken = (f"the update sent only part of fused module(s) (missing {missing[:4]}"
                            f"{' ...' * (len(missing) > 4)}): the model is inconsistent")
            raise EngineWeightError(f"engine {self.name!r}: {self._broken}; restart the engine", missing[0])
        if self._asleep and "kv_cache" in self._asleep:
            # The finalize call post-processes the weights and resets the prefix cache; whether the latter is safe
            # on a released KV pool is not stated at the pinned release, so the KV cache is woken first. The refit's
            # buckets are gone by now: the peak is the generating phase's (weights + KV), never refit + KV.
            self.wake(["kv_cache"])
        self._rpc("update_weights", None)
        self._updating, self._received, self._kv_stale = False, set(), False

    # ---- memory -----------------------------------------------------------------------------------------------------
    def sleep(self, level: int) -> None:
        self._check_alive()
        if level not in self._sleep_tags or self._live or self._updating:
            raise EngineError(f"engine {self.name!r}: sleep({level}) needs a level of {sorted(self._sleep_tags)}, "
                              "no requests, no update")
        self._llm._collective_rpc("sleep", args=(self._sleep_tags[level],))
        self._asleep = list(self._sleep_tags[level])
        self._kv_stale = self._kv_stale or (self._block_reuse and "kv_cache" in self._asleep)

    def wake(self, tags=None) -> None:
        """``tags``: ["weights"] wakes every memory tag but the KV cache (a refit then loads into resident weights),
        ["kv_cache"] the KV cache, None whatever is still asleep."""
        if not self._asleep:
            return
        want = set(tags or ("weights", "kv_cache"))
        wake = [t for t in self._asleep if ("kv_cache" if t == "kv_cache" else "weights") in want]
        if wake:
            self._llm._collective_rpc("wakeup", args=(wake,))
        self._asleep = [t for t in self._asleep if t not in wake] or False

    def close(self) -> None:
        with contextlib.suppress(Exception):  # best effort at teardown (also when already closed)
            self._llm.shutdown()
        with contextlib.suppress(Exception):
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._llm = None

    def _check_alive(self, stepping: bool = False) -> None:
        check_usable(self.name, closed=self._llm is None, broken=self._broken, updating=self._updating,
                     asleep=self._asleep, stepping=stepping)
