"""Layers point inward: importing a lower layer in a fresh interpreter pulls in nothing from the layers above it, and
no module of a layer names an outer layer in any import statement, those inside functions included (an import that
runs only when a function is called is invisible to the first check)."""
import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("nemo", "nemo_aligner", "megatron", "tensorrt_llm", "tensorrt", "apex", "transformer_engine", "omegaconf",
         "hydra", "ray", "lightning", "pytorch_lightning")

# module -> top-level packages it must not load
FORBIDDEN = {
    "nemo_dapo.core": HEAVY + ("numpy", "transformers", "tokenizers", "nemo_dapo.local", "nemo_dapo.data",
                               "nemo_dapo.megatron", "nemo_dapo.aligner", "nemo_dapo.cluster", "nemo_dapo.engines",
                               "nemo_dapo.models"),
    # Small Hugging Face decoders and their KV cache, below both the CPU backend and the local engine.
    "nemo_dapo.models": HEAVY + ("nemo_dapo.local", "nemo_dapo.engines", "nemo_dapo.data", "nemo_dapo.megatron",
                                 "nemo_dapo.aligner", "nemo_dapo.cluster"),
    "nemo_dapo.data": HEAVY + ("nemo_dapo.local", "nemo_dapo.megatron", "nemo_dapo.aligner"),
    "nemo_dapo.local": HEAVY + ("nemo_dapo.megatron", "nemo_dapo.aligner"),
    # The engine server runs in an engine's own environment: torch + stdlib + the engine (imported lazily).
    "nemo_dapo.engines": HEAVY + ("nemo_dapo.megatron", "nemo_dapo.aligner", "nemo_dapo.local", "nemo_dapo.cluster",
                                  "nemo_dapo.data", "vllm"),
    "nemo_dapo.megatron": tuple(m for m in HEAVY if m != "megatron") + ("nemo_dapo.local", "nemo_dapo.aligner"),
    # The cluster path's tooling runs on a login node and in the launch script: omegaconf, never the NeMo runtime.
    "nemo_dapo.cluster": tuple(m for m in HEAVY if m not in ("omegaconf", "hydra"))
    + ("nemo_dapo.local", "nemo_dapo.megatron", "nemo_dapo.aligner"),
}

# (module file, imported package) -> why that forbidden import is legitimate there. Each runs inside a function, in
# the environment the function is meant for, never when the layer is imported (the probe below proves that part).
ALLOWED = {
    ("nemo_dapo/engines/vllm.py", "vllm"): "the vLLM adapter imports its engine in the vLLM engine's environment",
    ("nemo_dapo/engines/trtllm.py", "tensorrt_llm"): "the TensorRT-LLM adapter imports its engine in the engine image",
    ("nemo_dapo/engines/trtllm_worker.py", "tensorrt_llm"): "our worker extension subclasses the release's RL hook, "
                                                            "built on first use inside the engine's Ray workers",
    # (engines/trtllm_check.py reads the installed TensorRT-LLM by importlib, from names in its API snapshot: no
    # import statement to allow)
    ("nemo_dapo/local/config.py", "omegaconf"): "the CPU job's configs are YAML read with omegaconf when one is "
                                                "loaded; the schema and validation import without it",
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


def _is_under(name: str, packages) -> list:
    return [p for p in packages if name == p or name.startswith(p + ".")]


def imported_names(source: str, module: str, is_package: bool = False) -> list:
    """(line, dotted name) of every import statement in ``source`` (module ``module``), wherever it sits: top level,
    functions, classes, ``try`` / ``if`` blocks. ``from a import b`` gives ``a`` and ``a.b``; relative imports are
    resolved against ``module``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")[: len(module.split(".")) - node.level + int(is_package)]
                base = ".".join(parent + ([base] if base else []))
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names if a.name != "*"]
    return out


def forbidden_imports(source: str, module: str, forbidden, allowed=(), is_package: bool = False) -> list:
    """``"module:line imports name"`` for each import of a forbidden package not in ``allowed`` (package names)."""
    bad = {}
    for line, name in imported_names(source, module, is_package):  # the shortest forbidden name of each statement
        hit = [f for f in _is_under(name, forbidden) if f not in allowed]
        if hit and not any(_is_under(name, (seen,)) for seen in bad.get(line, ())):
            bad.setdefault(line, []).append(name)
    return [f"{module}:{line} imports {name}" for line in sorted(bad) for name in bad[line]]


def layer_files(package: str) -> list:
    return sorted((ROOT / package.replace(".", "/")).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layer_imports_nothing_from_outer_layers(package):
    mods = loaded_modules(package)
    bad = sorted(m for m in mods for f in FORBIDDEN[package] if m == f or m.startswith(f + "."))
    assert not bad, f"importing every module of {package} loaded forbidden modules: {bad[:20]}"


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_module_of_a_layer_names_an_outer_layer_even_lazily(package):
    bad = []
    for path in layer_files(package):
        rel = path.relative_to(ROOT).as_posix()
        module = rel[:-3].replace("/", ".").removesuffix(".__init__")
        allowed = {pkg for (file, pkg) in ALLOWED if file == rel}
        bad += forbidden_imports(path.read_text(), module, FORBIDDEN[package], allowed, path.name == "__init__.py")
    assert not bad, f"{package} imports outer layers (lazily or not): {bad[:20]}"


def test_every_allowed_lazy_import_is_still_there():
    # an allowance whose import is gone would silently admit the next one
    for (file, pkg), why in ALLOWED.items():
        names = [n for _, n in imported_names((ROOT / file).read_text(), file[:-3].replace("/", "."))]
        assert any(_is_under(n, (pkg,)) for n in names), f"{file} no longer imports {pkg} ({why}): drop the entry"


def test_the_static_check_sees_lazy_and_relative_imports():
    # The check must be able to fail: an import inside a function, a relative one and an allowed one.
    source = ("import torch\n"
              "def build():\n"
              "    from nemo_dapo.local.model import load_model\n"
              "    import vllm\n"
              "    from ..local import sampler\n"
              "    return load_model\n")
    assert forbidden_imports(source, "nemo_dapo.engines.local", FORBIDDEN["nemo_dapo.engines"]) == [
        "nemo_dapo.engines.local:3 imports nemo_dapo.local.model", "nemo_dapo.engines.local:4 imports vllm",
        "nemo_dapo.engines.local:5 imports nemo_dapo.local"]
    assert forbidden_imports(source, "nemo_dapo.engines.local", FORBIDDEN["nemo_dapo.engines"],
                             allowed=("vllm", "nemo_dapo.local")) == []
    assert forbidden_imports("from . import base\n", "nemo_dapo.engines", FORBIDDEN["nemo_dapo.engines"],
                             is_package=True) == []


def test_probe_sees_transitive_imports():
    # The check must be able to fail: the probe reports what a layer pulls in indirectly (the decoders' KV cache is
    # built on transformers' Cache, so its import must show up; through nemo_dapo.models, what local imports too).
    assert "transformers" in loaded_modules("nemo_dapo.models")
    assert "nemo_dapo.models.decoder" in loaded_modules("nemo_dapo.local")
