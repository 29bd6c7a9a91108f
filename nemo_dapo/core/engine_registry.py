"""Every rollout engine, one row each: what builds it, how the cluster config maps to its options, whether the
engine server runs it, how ``nemo-dapo plan`` models its generation, and how to install it.

The config validators (``cluster/config_validate.py``, ``local/config_schema.py``), the option mapper
(``cluster/engine_options.py``), the engine server (``engines/server.py``), the planner (``cluster/plan*.py``) and the
trainers (``aligner/engine_generation.py``, ``local/run_engine.py``) read engine names from here and nowhere else:
a new engine (SGLang, say) is an adapter, one row of ``ENGINES`` and their tests.

Stdlib only, on purpose: the cluster tooling reads this on a login node without torch, and the engine server in an
engine's own environment. Class paths are ``"package.module:attr[.attr]"`` strings, imported only by :func:`load`,
called by the layer that runs them (the server builds an adapter, the cluster tooling calls a mapper).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Optional

# nemo-dapo plan's generation models an engine can select (cluster/plan_generation.py MODEL_LABELS)
PLAN_MODELS = ("static", "inflight")
# How a trainer's weights reach its engine servers: shared memory, or a broadcast over a gloo (CPU tensors) or NCCL
# (GPU to GPU) process group (engines/weight_group.py); the generator's check reads this, the CPU config the first two.
WEIGHT_TRANSPORTS = ("shm", "gloo", "nccl")
CPU_WEIGHT_TRANSPORTS = WEIGHT_TRANSPORTS[:2]


@dataclass(frozen=True)
class EngineSpec:
    """One engine. ``adapter``: ``factory(model_dir, **options)`` returning an ``EngineAdapter``
    (engines/base.py), built by the engine server; None: the engine runs inside the trainer, not served.
    ``options``: ``mapper(settings) -> options`` from the strict ``trainer.dapo.engine_server`` settings
    (cluster/engine_options.py ``read_server``, plus ``num_engines``); None: the cluster launcher has none.
    ``plan``: one of ``PLAN_MODELS``; None: ``nemo-dapo plan`` does not size it. ``install``: the fix named when the
    engine cannot start. ``cpu``: a ``rollout.engine`` of the CPU job. ``engine_seed``: the adapter takes an
    engine-wide ``seed`` option (the CPU job passes its run seed). ``cuda_graphs``: on GPUs the engine decodes with
    CUDA graphs (``nemo-dapo plan`` hides the host's kernel launches); False: its adapter runs the model eagerly."""

    name: str
    adapter: Optional[str]
    options: Optional[str]
    plan: Optional[str]
    install: str
    cpu: bool = False
    engine_seed: bool = False
    cuda_graphs: bool = True

    def __post_init__(self):
        if not self.name.isidentifier():
            raise ValueError(f"engine name {self.name!r} must be an identifier (letters, digits, '_')")
        for key in ("adapter", "options"):
            path = getattr(self, key)
            if path is not None and (path.count(":") != 1 or not all(path.split(":"))):
                raise ValueError(f"engine {self.name!r}: {key}={path!r} must look like 'package.module:attr'")
        if self.plan not in PLAN_MODELS + (None,):
            raise ValueError(f"engine {self.name!r}: plan={self.plan!r} must be one of {PLAN_MODELS} or None")
        if self.options is not None and self.adapter is None:
            raise ValueError(f"engine {self.name!r}: an option mapper without an adapter maps options for nothing")

    @property
    def served(self) -> bool:
        """Run by ``python -m nemo_dapo.engines.server`` (trainer.dapo.engine_server configures it)."""
        return self.adapter is not None


ENGINES = {spec.name: spec for spec in (
    # NeMo-Aligner's static TensorRT-LLM engine inside the trainer (dense models only; DESIGN.md decision 8)
    EngineSpec("legacy", adapter=None, options=None, plan="static",
               install="run the trainer in the NeMo container (NeMo-Aligner's TensorRT-LLM export)"),
    # cuda_graphs: the pinned release cannot refit a graph-captured model (engines/trtllm.py, cuda_graph_config=None)
    EngineSpec("trtllm", adapter="nemo_dapo.engines.trtllm:TRTLLMEngine",
               options="nemo_dapo.cluster.engine_options:trtllm_options", plan="inflight",
               install="run the server in the engine image built from containers/Dockerfile.engine",
               cuda_graphs=False),
    # cuda_graphs: vLLM as the planner's calibration runs used it (benchmarks/calibration/); our adapter's own
    # enforce_eager defaults to True (it serves the CPU job), so a GPU run of it passes enforce_eager=False (vLLM
    # 0.32's layerwise reload, which the adapter refits with, copies into the original storage: captured graphs stay
    # valid, model_loader/reload/layerwise.py)
    EngineSpec("vllm", adapter="nemo_dapo.engines.vllm:VLLMEngine",
               options="nemo_dapo.cluster.engine_options:vllm_options", plan="inflight",
               install="run the server with the python of the venv made by `bash scripts/install.sh VENV engine-vllm`",
               cpu=True, engine_seed=True),
    # the project's own small-model engine: CPU or one GPU, not sized by the planner
    EngineSpec("local", adapter="nemo_dapo.engines.local:LocalEngine.from_path",
               options="nemo_dapo.cluster.engine_options:local_options", plan=None,
               install="install nemo_dapo with its dependencies (bash scripts/install.sh VENV core)", cpu=True),
)}


def rollout_engines() -> tuple:
    """Every ``trainer.dapo.rollout_engine`` value."""
    return tuple(ENGINES)


def served_engines() -> tuple:
    """The engines ``nemo_dapo.engines.server --engine`` builds."""
    return tuple(name for name, spec in ENGINES.items() if spec.served)


def cpu_engines() -> tuple:
    """The engine servers of the CPU job's ``rollout.engine``."""
    return tuple(name for name, spec in ENGINES.items() if spec.cpu)


def planned_engines() -> tuple:
    """The engines ``nemo-dapo plan`` sizes."""
    return tuple(name for name, spec in ENGINES.items() if spec.plan is not None)


def is_served(name) -> bool:
    """``name`` (any config value) is a served engine of the registry."""
    return isinstance(name, str) and name in ENGINES and ENGINES[name].served


def install_hint(name: str) -> str:
    """How to get the environment an engine (a registry name, or a ``module:factory`` of one's own) starts in."""
    spec = ENGINES.get(name)
    return spec.install if spec else f"install what {name.partition(':')[0]!r} needs into the engine's environment"


def load(path: str):
    """The object a ``"package.module:attr[.attr]"`` path names (ImportError / AttributeError as Python raises
    them: the caller knows which fix to name)."""
    module, _, attr = path.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj
