"""vLLM as a rollout engine: ``VLLMEngine`` steps vLLM's in-process ``LLMEngine`` (facts from vLLM 0.32's source).

* In-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, forced): ``step()`` is one schedule + forward; no ``__main__``
  guard. vLLM's CPU worker then binds no threads and forbids ``torch.set_num_threads`` later: pass ``num_threads``.
  Tensor parallel (``tensor_parallel_size=2, distributed_executor_backend="mp"``; on CPU one core per worker by
  ``VLLM_CPU_OMP_THREADS_BIND="0|1"``) spawns the workers; the weight group then has a rank per worker, each
  answering for its own broadcast and shard (tests/engines/test_vllm_tp2.py).
* Token ids only (``skip_tokenizer_init``; never downloads); config.json's EOS ids join every request's stop ids.
  Sample k of request ``id`` is vLLM request ``"id#k"`` (n=1, DELTA outputs, seed ``seed * 1_000_003 + k``): greedy
  n > 1 works, aborts keep partial tokens. Log-probs: ``logprobs=0``, ``logprobs_mode="processed_logprobs"``.
* Weights: vLLM's layerwise reload (as in its IPC / NCCL weight-transfer engines). The first ``load_weights`` opens
  an update (layers sit on the meta device until complete: ``step()`` is refused until ``finish_weights``, which
  re-runs vLLM's post-processing, e.g. CPU weight packing (CPU MoE experts: repacked here, vLLM 0.32 skips them),
  and resets the prefix cache, recomputing running KV).
  Names and shapes are checked against the checkpoint's safetensors headers. A module an update touches must get
  all its tensors (q, k, v; weight, bias), else ``finish_weights`` raises and the engine refuses further work (vLLM
  would compute with uninitialised memory). Tied embeddings: vLLM's CPU lm_head keeps its own packed copy, so
  ``lm_head.weight`` and ``model.embed_tokens.weight`` are always loaded together. The collective transport
  (weight_group.py) is received by the workers themselves (``_rpc_group`` through ``collective_rpc``).
* CPU: chunked prefill is off (a split prefill of a seeded request fails in vLLM 0.32's CPU sampler).
* Sleep: vLLM's CPU worker ignores it: sleep pauses the scheduler and drops the prefix cache but frees nothing
  (``info()["sleep_frees_memory"]``); on GPU pass ``enable_sleep_mode=True``.
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterable, Optional, Sequence

import torch

from .base import (HF_EMBED, HF_HEAD, Completion, EngineError, EngineWeightError, Request, Sample, check_usable,
                   check_weight, read_checkpoint)

_FINISH = {"stop": "stop", "length": "length", "abort": "aborted"}
SEED_STRIDE = 1_000_003
_QUIET = "vllm.model_executor.model_loader.reload.layerwise"  # warns once per untouched layer on every update


def _rpc_reload(worker, phase: str, weights=None):
    """Runs on vLLM's worker (collective_rpc): one phase of a layerwise weight reload."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import reload
    model = worker.model_runner.model
    with set_current_vllm_config(worker.vllm_config):
        if phase == "packed":
            return dict(getattr(model, "packed_modules_mapping", None) or {})
        if phase == "start":
            return reload.initialize_layerwise_reload(model)
        if phase == "load":
            return len(model.load_weights(weights) or ())
        quiet = logging.getLogger(_QUIET)
        quiet.disabled, was = True, quiet.disabled
        try:
            reload.finalize_layerwise_reload(model, worker.model_runner.model_config)
        finally:
            quiet.disabled = was
        _repack_cpu_experts(model)


def _rpc_group(worker, op: str, args):
    """Runs on vLLM's worker (collective_rpc): the collective weight transport (weight_group.py) received by the
    worker itself, one rank per worker (``base + worker.rank``), so a bucket never passes through the server.
    "receive" answers in plain data (an exception may not cross a worker process intact): ("broken", why) when the
    broadcast failed, ("nan", name) for a non-finite tensor (nothing of the bucket loaded), else None."""
    from nemo_dapo.engines.base import EngineWeightError, check_finite
    from nemo_dapo.engines.weight_group import GroupBroken, GroupMember
    if op == "join":
        host, port, base, world, timeout_s, backend = args
        worker.nemo_dapo_weight_group = None  # a new group replaces the old one
        device = worker.device if backend == "nccl" else None  # vLLM's GPU worker: cuda:local_rank
        worker.nemo_dapo_weight_group = GroupMember(host, port, base + worker.rank, world, timeout_s, backend, device)
        return None
    specs, size, dtype, tied = args
    try:
        named = worker.nemo_dapo_weight_group.receive(specs, size)
    except GroupBroken as e:
        return ("broken", str(e))
    for name, t in named:
        try:
            check_finite(name, t, "vllm", into=getattr(torch, dtype))
        except EngineWeightError:
            return ("nan", name)
    batch = {name: t.to(dtype=getattr(torch, dtype), copy=True) for name, t in named}
    for name, alias in tied.items():
        if name in batch and alias not in batch:
            batch[alias] = batch[name]
    if batch:
        _rpc_reload(worker, "load", list(batch.items()))
    return None


def _repack_cpu_experts(model) -> None:
    """Re-run the CPU MoE experts' own weight preparation after an update. vLLM 0.32 runs it on the first load
    only (``UnquantizedFusedMoEMethod._setup_kernel`` in fused_moe/unquantized_fused_moe_method.py skips
    ``fused_experts.process_weights_after_loading`` once its kernel exists); on CPU that step is the grouped-GEMM
    prepack of ``w13`` / ``w2`` (fused_moe/experts/cpu_moe.py), so updated experts would otherwise be read unpacked
    (measured: log-probs off by ~2 on a tiny Mixtral / Qwen3-MoE). Experts whose intermediate size the CPU kernel
    pads (not a multiple of 32) fail earlier, in vLLM's own reload copy."""
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if type(experts).__name__ == "CPUUnquantizedExperts":
            experts.process_weights_after_loading(module)


class VLLMEngine:
    """EngineAdapter. ``model_dir``: a local HF checkpoint (config.json + safetensors). ``kv_cache_gb``: vLLM's KV
    cache; on CPU ``VLLM_CPU_KVCACHE_SPACE`` or 1 GiB (vLLM: 92% of RAM). ``engine_kwargs``: EngineArgs."""

    def __init__(self, model_dir, *, max_batch_size: int = 256, max_seq_len: Optional[int] = None,
                 dtype: str = "float32", seed: int = 0, kv_cache_gb: Optional[float] = None,
                 gpu_memory_utilization: float = 0.9, enforce_eager: bool = True,
                 num_threads: Optional[int] = None, name: str = "vllm", **engine_kwargs):
        self.name, self.model_dir = name, os.fspath(model_dir)
        ckpt = read_checkpoint(self.model_dir, name)
        self._config, self._shapes, self._eos = ckpt.config, ckpt.shapes, ckpt.eos_ids
        self._tied = {HF_EMBED: HF_HEAD, HF_HEAD: HF_EMBED} if ckpt.tied else {}
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        if num_threads:
            torch.set_num_threads(int(num_threads))
        try:
            from vllm import EngineArgs, LLMEngine, SamplingParams, TokensPrompt, __version__
            from vllm.platforms import current_platform
            from vllm.sampling_params import RequestOutputKind
            from vllm.usage.usage_lib import UsageContext
        except ImportError as e:
            raise EngineError(f"engine {name!r}: vllm is not importable ({e}); run the engine in the venv made by "
                              "`bash scripts/install.sh VENV engine-vllm`") from e
        self._version, self._cpu = __version__, current_platform.is_cpu()
        self._SamplingParams, self._TokensPrompt, self._DELTA = SamplingParams, TokensPrompt, RequestOutputKind.DELTA
        kv_gb = kv_cache_gb
        if kv_gb is None and self._cpu and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            kv_gb = 1.0
        args = dict(model=self.model_dir, skip_tokenizer_init=True, dtype=dtype, seed=seed,
                    max_num_seqs=max_batch_size, max_model_len=max_seq_len, enforce_eager=enforce_eager,
                    logprobs_mode="processed_logprobs", gpu_memory_utilization=gpu_memory_utilization,
                    disable_log_stats=True, kv_cache_memory_bytes=kv_gb and int(kv_gb * (1 << 30)))
        if self._cpu:
            # vLLM 0.32 rewinds a seeded request's generator when its prefill is split over steps, which a CPU
            # generator cannot do ("CPU Generator does not use offset", gpu_model_runner._bookkeeping_sync): on CPU
            # no prefill is split (a step's prefills beyond the token budget wait for the next step)
            longest = max_seq_len or int(self._config.get("max_position_embeddings") or 0)
            args.update(enable_chunked_prefill=False, max_num_batched_tokens=max(4096, longest))
        self._engine = LLMEngine.from_engine_args(EngineArgs(**{**args, **engine_kwargs}),
                                                  usage_context=UsageContext.LLM_CLASS)
        self._dtype, self._max_batch_size = self._engine.model_config.dtype, max_batch_size
        self._fused = {part: whole for whole, parts in self._reload("packed").items() for part in parts}
        self._live: dict = {}  # id -> (tokens per sample, log-probs per sample or None, finish per sample)
        self._updating, self._received, self._broken, self._asleep = False, set(), None, False

    def info(self) -> dict:
        return {"engine": "vllm", "name": self.name, "model": self.model_dir, "vllm_version": self._version,
                "vocab_size": int(self._config["vocab_size"]), "max_seq_len": self._engine.model_config.max_model_len,
                "max_batch_size": self._max_batch_size, "dtype": str(self._dtype).replace("torch.", ""),
                "weight_group_ranks": self._engine.vllm_config.parallel_config.world_size,
                "device": "cpu" if self._cpu else "cuda", "sleep_frees_memory": not self._cpu,
                # GPU sleep level 1 offloads the weights to CPU and drops the KV cache, level 2 drops both
                # (vllm/v1/worker/gpu_worker.py sleep / wake_up(tags)); the CPU worker frees nothing, so it says
                # nothing and is woken whole
                **({} if self._cpu else {"sleep_releases": {"1": ["kv_cache", "weights"],
                                                            "2": ["kv_cache", "weights"]},
                                         "wake_tags": ["weights", "kv_cache"]})}

    def add(self, request: Request) -> None:
        self._check_alive()
        if request.id in self._live:
            raise EngineError(f"engine {self.name!r}: request {request.id!r} is already running")
        # ignore_eos as vLLM means it: the model's EOS does not end a sample, the request's stop tokens still do
        stops = list(dict.fromkeys(list(request.stop_token_ids) + ([] if request.ignore_eos else self._eos)))
        prompt, added = self._TokensPrompt(prompt_token_ids=list(request.prompt_ids)), []
        try:
            for k in range(request.n):
                seed = None if request.seed is None else (int(request.seed) * SEED_STRIDE + k) % (1 << 63)
                params = self._SamplingParams(
                    n=1, temperature=request.temperature, top_p=request.top_p, top_k=request.top_k, seed=seed,
                    max_tokens=request.max_new_tokens, stop_token_ids=stops, ignore_eos=request.ignore_eos,
                    detokenize=False,
                    logprobs=0 if request.logprobs else None, output_kind=self._DELTA)
                self._engine.add_request(f"{request.id}#{k}", prompt, params)
                added.append(f"{request.id}#{k}")
        except Exception as e:
            self._engine.abort_request(added)
            raise EngineError(f"engine {self.name!r}: vLLM rejected request {request.id!r}: {e}") from e
        self._live[request.id] = ([[] for _ in added], [[] for _ in added] if request.logprobs else None,
                                  [None] * len(added))

    def step(self) -> list:
        self._check_alive(stepping=True)
        done = []
        for out in self._engine.step():
            rid, _, k = out.request_id.rpartition("#")
            if rid not in self._live:
                continue
            (tokens, logprobs, finish), k = self._live[rid], int(k)
            for c in out.outputs:
                tokens[k].extend(ids := [int(t) for t in c.token_ids])
                if logprobs is not None:
                    logprobs[k].extend(float(pos[t].logprob) for t, pos in zip(ids, c.logprobs or ()))
                if c.finish_reason is not None and c.finish_reason not in _FINISH:
                    raise EngineError(f"engine {self.name!r}: sample {k} of {rid!r} ended with {c.finish_reason!r}")
                if c.finish_reason is not None:
                    finish[k] = _FINISH[c.finish_reason]
            if all(finish):
                done.append(self._complete(rid))
        return done

    def has_work(self) -> bool:
        return bool(self._live)

    def abort(self, ids: Sequence[str]) -> list:
        out = []
        for rid in (i for i in ids if i in self._live):
            finish = self._live[rid][2]
            self._engine.abort_request([f"{rid}#{k}" for k, f in enumerate(finish) if f is None])
            finish[:] = [f or "aborted" for f in finish]
            out.append(self._complete(rid))
        return out

    def _complete(self, rid: str) -> Completion:
        tokens, logprobs, finish = self._live.pop(rid)
        return Completion(rid, [Sample(t, None if logprobs is None else logprobs[k], finish[k])
                                for k, t in enumerate(tokens)])

    def _group(self, name: str) -> str:
        """The vLLM module a HF tensor lands in: 'layers.0.self_attn.k_proj.bias' -> 'layers.0.self_attn.qkv_proj'."""
        parts = name.split(".")
        return name if len(parts) < 2 else ".".join(parts[:-2] + [self._fused.get(parts[-2], parts[-2])])

    def load_weights(self, named: Iterable[tuple]) -> None:
        self._check_alive()
        batch = {}
        for name, tensor in named:  # copies: vLLM buffers tensors until their module is complete
            shape = self._shapes[name] if name in self._shapes else self._shapes.get(self._tied.get(name))
            self._checked(name, tensor, shape)
            batch[name] = tensor.detach().to(dtype=self._dtype, copy=True)
        for name, alias in self._tied.items():  # tied: vLLM's CPU lm_head keeps its own packed copy: load both
            if name in batch and alias not in batch:
                batch[alias] = batch[name]
        if not batch:
            return
        if not self._updating:
            self._reload("start")
            self._updating, self._received = True, set()
        self._reload("load", list(batch.items()))
        self._received.update(batch)

    def join_weight_group(self, host: str, port: int, rank: int, world_size: int, timeout_s: float,
                          backend: str = "gloo") -> None:
        """Every worker joins the trainer's weight group (weight_group.py), as ranks ``rank`` onwards; over nccl
        each on its own GPU."""
        self._check_alive()
        self._engine.collective_rpc(_rpc_group, args=("join", (host, port, rank, world_size, timeout_s, backend)))

    def check_weight_specs(self, specs: list) -> None:
        """Names, shapes and dtypes of a broadcast bucket, checked from its specs before the server agrees to receive
        it (as ``load_weights`` checks tensors): a refused bucket is refused before anyone enters the broadcast."""
        from .protocol import dtype_of
        self._check_alive()
        for spec in specs:
            name = spec["name"]
            shape = self._shapes[name] if name in self._shapes else self._shapes.get(self._tied.get(name))
            self._checked(name, torch.empty(spec["shape"], dtype=dtype_of(spec["dtype"]), device="meta"), shape)

    def receive_weights(self, specs: list, size: int) -> None:
        """One broadcast bucket (checked by ``check_weight_specs``), received and loaded by the workers. A failed
        broadcast raises ``GroupBroken`` and leaves the update open (the next full update completes it)."""
        from .weight_group import GroupBroken, workers_failure
        if specs and not self._updating:  # an empty bucket is still read: every rank takes every broadcast
            self._reload("start")
            self._updating, self._received = True, set()
        dtype = str(self._dtype).replace("torch.", "")
        try:
            answers = self._engine.collective_rpc(_rpc_group, args=("receive", (specs, size, dtype, self._tied)))
        except Exception as e:  # a failed load leaves the model half-updated
            self._broken = f"vLLM failed to load a broadcast bucket ({type(e).__name__}: {e})"
            raise EngineWeightError(f"engine {self.name!r}: {self._broken}", specs[0]["name"] if specs else "") from e
        bad = workers_failure(answers)
        if bad is not None and bad[0] == "broken":
            raise GroupBroken(bad[1])
        if bad is not None:  # nothing of the bucket loaded: as the server's own check on the shm path
            raise EngineWeightError(f"engine {self.name!r}: weight {bad[1]!r} holds NaN or inf values, or values "
                                    "beyond the engine's dtype; refusing it", bad[1])
        names = {s["name"] for s in specs}
        self._received.update(names | {self._tied[n] for n in names if n in self._tied})

    def _reload(self, phase: str, batch=None):
        try:
            return self._engine.collective_rpc(_rpc_reload, args=(phase, batch))[0]
        except Exception as e:  # a failed phase leaves the model half-updated
            self._broken = f"vLLM failed in weight-update phase {phase!r} ({type(e).__name__}: {e})"
            raise EngineWeightError(f"engine {self.name!r}: {self._broken}", batch[0][0] if batch else "") from e

    def _checked(self, name: str, tensor: torch.Tensor, shape) -> None:
        try:
            check_weight(name, tensor, None if shape is None else torch.empty(shape, device="meta"), self.name,
                         into=self._dtype)
        except EngineWeightError:
            if self._updating:  # earlier buckets of this update are in: the model is half-updated
                self._broken = f"a weight update was interrupted by the rejected tensor {name!r}"
            raise

    def finish_weights(self) -> None:
        self._check_alive()
        if self._updating:
            touched = {self._group(n) for n in self._received}
            missing = sorted(n for n in self._shapes if self._group(n) in touched and n not in self._received)
            self._reload("finish")
            self._updating = False
            if missing:
                self._broken = (f"the update sent part of module(s) {sorted({self._group(n) for n in missing})}"
                                f" (missing {missing[:4]}{' ...' * (len(missing) > 4)}): the model is inconsistent")
                raise EngineWeightError(f"engine {self.name!r}: {self._broken}; restart the engine", missing[0])
        self._engine.reset_prefix_cache(reset_running_requests=True)

    def sleep(self, level: int) -> None:
        self._check_alive()
        if level not in (1, 2) or self._live or self._updating:
            raise EngineError(f"engine {self.name!r}: sleep({level}) needs level 1 or 2, no requests, no update")
        self._engine.sleep(level=level, mode="abort")
        self._asleep = True

    def wake(self, tags=None) -> None:
        if self._asleep:
            # vLLM's own tags are ours ("weights", "kv_cache"); True once nothing is left asleep
            fully_awake = self._engine.wake_up(tags=list(tags) if tags else None)
            self._asleep = not (tags is None or fully_awake)

    def close(self) -> None:
        with contextlib.suppress(Exception):  # best effort at teardown (also when already closed)
            self._engine.engine_core.shutdown()
        self._engine = None

    def _check_alive(self, stepping: bool = False) -> None:
        check_usable(self.name, closed=self._engine is None, broken=self._broken, updating=self._updating,
                     asleep=self._asleep, stepping=stepping)
