"""Layers point inward: importing a lower layer in a fresh interpreter pulls in nothing from the layers above it."""
import json
import subprocess
import sys

import pytest

HEAVY = ("nemo", "nemo_aligner", "megatron", "tensorrt_llm", "tensorrt", "apex", "transformer_engine", "omegaconf",
         "hydra", "ray", "lightning", "pytorch_lightning")

# module -> top-level packages it must not load
FORBIDDEN = {
    "nemo_dapo.core": HEAVY + ("numpy", "transformers", "tokenizers", "nemo_dapo.local", "nemo_dapo.data",
                               "nemo_dapo.megatron", "nemo_dapo.aligner", "nemo_dapo.cluster"),
    "nemo_dapo.data": HEAVY + ("nemo_dapo.local", "nemo_dapo.megatron", "nemo_dapo.aligner"),
    "nemo_dapo.local": HEAVY + ("nemo_dapo.megatron", "nemo_dapo.aligner"),
    # The engine server runs in an engine's own environment: torch + stdlib + the engine (imported lazily).
    "nemo_dapo.engines": HEAVY + ("nemo_dapo.megatron", "nemo_dapo.aligner", "vllm"),
    "nemo_dapo.megatron": tuple(m for m in HEAVY if m != "megatron") + ("nemo_dapo.local", "nemo_dapo.aligner"),
    # The cluster path's tooling runs on a login node and in the launch script: omegaconf, never the NeMo runtime.
    "nemo_dapo.cluster": tuple(m for m in HEAVY if m not in ("omegaconf", "hydra"))
    + ("nemo_dapo.local", "nemo_dapo.megatron", "nemo_dapo.aligner"),
}

# Whatever a bare `import torch` loads (numpy, when installed) is the floor every layer stands on; the probe reports
# only what importing the layer adds on top of it.
PROBE = """
import importlib, json, pkgutil, sys
import torch
base = set(sys.modules)
pkg = importlib.import_module(sys.argv[1])
for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
    importlib.import_module(m.name)
print(json.dumps(sorted(set(sys.modules) - base)))
"""


def loaded_modules(package: str) -> set:
    out = subprocess.run([sys.executable, "-c", PROBE, package], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layer_imports_nothing_from_outer_layers(package):
    mods = loaded_modules(package)
    bad = sorted(m for m in mods for f in FORBIDDEN[package] if m == f or m.startswith(f + "."))
    assert not bad, f"importing every module of {package} loaded forbidden modules: {bad[:20]}"


def test_probe_sees_transitive_imports():
    # The check must be able to fail: the probe reports what a layer pulls in indirectly (the local backend is
    # built on transformers, so its import must show up).
    assert "transformers" in loaded_modules("nemo_dapo.local")
