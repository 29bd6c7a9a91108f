"""Runs inside TensorRT-LLM's Ray GPU workers: the collective weight transport (weight_group.py) received by each
worker itself, so a bucket never passes through the engine server (as vLLM's workers do, engines/vllm.py).

``GroupWorkerExtension`` is what ``engines/trtllm.py`` passes as ``ray_worker_extension_cls``: the release's RL hook
(``rlhf_utils.WorkerExtension``, whose ``update_weights`` the shared-memory path and the finalize call use) plus two
methods. TensorRT-LLM v1.3.0rc1 resolves the class by its import path in each worker and mixes it into
``RayGPUWorker`` (``RayWorkerWrapper._inject_worker_extension``: an attribute the worker already has is an error,
hence the ``nemo_dapo_`` prefix), so ``self`` is the worker: ``self.engine`` the PyExecutor, ``self.global_rank``
its rank in the engine's own world, ``self.device_id`` its GPU. ``LLM._collective_rpc(name, args)`` calls a method
by name on every worker and returns their answers in rank order.

* ``nemo_dapo_join(host, port, first_rank, world_size, timeout_s, backend)``: the worker joins the trainer's group
  as rank ``first_rank + global_rank`` (a new group replaces the old one); over nccl a bucket lands on its GPU.
* ``nemo_dapo_receive(specs, size, dtype, ready, skip)``: one broadcast bucket. Tensors named in ``skip`` are
  dropped (a tied ``lm_head``), the others cast to ``dtype`` on the worker's GPU and held; the held ones named in
  ``ready`` are loaded as the release's ``update_weights`` loads a bucket: every module's ``pre_reload_weights`` before
  the first one of an update, then ``model_loader.reload(model, weights, allow_partial_loading=True)``. The adapter
  decides ``ready`` (the parts of a fused module wait for the rest, as on the shared-memory path); the finalize is
  the release's own ``update_weights(None)``. The answer is plain data, as an exception may not cross the Ray
  worker intact: None, ("broken", why) when the broadcast failed, ("nan", name) for a non-finite tensor (nothing of
  the bucket loaded).

Both methods run under the release's ``control_action_decorator`` (no request is running while the worker joins a
communicator or swaps weights). The class is built on first access (PEP 562 ``__getattr__``) because it subclasses
TensorRT-LLM's: importing this module elsewhere (the layering probe, the trainer) imports no engine.
"""
from __future__ import annotations

import functools

import torch

EXTENSION = "nemo_dapo.engines.trtllm_worker.GroupWorkerExtension"
FIRST_FLAG = "first_pre_reload_weights"  # the release's marker of an update in progress (rlhf_utils.py)


def _join(worker, host: str, port: int, first_rank: int, world_size: int, timeout_s: float,
          backend: str = "gloo") -> None:
    from nemo_dapo.engines.weight_group import GroupMember
    worker.nemo_dapo_group = None  # a new group replaces the old one
    device = _device(worker) if backend == "nccl" else None
    worker.nemo_dapo_group = GroupMember(host, port, first_rank + int(worker.global_rank), world_size, timeout_s,
                                         backend, device)


def _device(worker) -> torch.device:
    return torch.device("cuda", int(worker.device_id)) if torch.cuda.is_available() else torch.device("cpu")


def _receive(worker, specs: list, size: int, dtype: str, ready: list, skip: list):
    from nemo_dapo.engines.base import EngineWeightError, check_finite
    from nemo_dapo.engines.weight_group import GroupBroken
    try:
        named = worker.nemo_dapo_group.receive(specs, size)
    except GroupBroken as e:
        return ("broken", str(e))
    skip = set(skip)
    named = [(n, t) for n, t in named if n not in skip]
    device, cast = _device(worker), getattr(torch, dtype)
    for name, t in named:
        try:
            check_finite(name, t, "trtllm", into=cast)
        except EngineWeightError:
            return ("nan", name)
    held = worker.__dict__.setdefault("nemo_dapo_held", {})
    held.update({n: t.to(device=device, dtype=cast, copy=True) for n, t in named})
    weights = {n: held.pop(n) for n in ready}
    if weights:
        load(worker, weights)
    return None


def load(worker, weights: dict) -> None:
    """One bucket into the worker's model, the release's ``update_weights`` way (module docstring)."""
    model_engine = worker.engine.model_engine
    model = model_engine.model
    if not getattr(model, FIRST_FLAG, False):  # the release removes the flag at the finalize (delattr)
        for module in model.modules():
            if hasattr(module, "pre_reload_weights") and not getattr(module, "_weights_removed", False):
                module.pre_reload_weights()
        setattr(model, FIRST_FLAG, True)
    model_engine.model_loader.reload(model, weights, allow_partial_loading=True)


@functools.lru_cache(maxsize=1)
def _extension_class():
    from tensorrt_llm._ray_utils import control_action_decorator
    from tensorrt_llm.llmapi.rlhf_utils import WorkerExtension
    return type("GroupWorkerExtension", (WorkerExtension,), {
        "__module__": __name__, "__doc__": "TensorRT-LLM's RL worker extension plus the weight group's receive.",
        "nemo_dapo_join": control_action_decorator(_join),
        "nemo_dapo_receive": control_action_decorator(_receive)})


def __getattr__(name: str):
    if name == "GroupWorkerExtension":
        return _extension_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
