"""The GPU tests (tests/gpu/) and the benchmarks never run in CI, so a changed signature in nemo_dapo would break them
unseen until a GPU session: every call they make to a nemo_dapo callable is bound here against its current signature
(positional count and keyword names; the values are not checked)."""
import ast
import importlib
import inspect
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _resolve(module: str, name: str = ""):
    try:
        obj = importlib.import_module(module)
    except Exception:  # noqa: BLE001 - a module this environment cannot import (the engines' own) is not checked
        return None
    return getattr(obj, name, None) if name else obj


def _imported(tree: ast.AST) -> dict:
    """Local name -> nemo_dapo object, from ``from nemo_dapo... import x [as y]`` and ``import nemo_dapo... as y``."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nemo_dapo"):
            for a in node.names:
                obj = _resolve(node.module, a.name)
                names[a.asname or a.name] = obj if obj is not None else _resolve(f"{node.module}.{a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("nemo_dapo") and a.asname:
                    names[a.asname] = _resolve(a.name)
    return {k: v for k, v in names.items() if v is not None}


def stale_calls(source: str, where: str) -> list:
    """``where:line: callable: why`` for each call of an imported nemo_dapo callable that does not bind."""
    tree = ast.parse(source)
    names, out = _imported(tree), []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or any(isinstance(a, ast.Starred) for a in node.args) or any(
                k.arg is None for k in node.keywords):
            continue
        f, obj = node.func, None
        if isinstance(f, ast.Name):
            obj = names.get(f.id)
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in names:
            obj = getattr(names[f.value.id], f.attr, None)
        if obj is None or inspect.ismodule(obj) or not callable(obj):
            continue
        try:
            sig = inspect.signature(obj)
        except (TypeError, ValueError):  # a builtin without a signature
            continue
        try:
            sig.bind(*([None] * len(node.args)), **{k.arg: None for k in node.keywords})
        except TypeError as e:
            out.append(f"{where}:{node.lineno}: {getattr(obj, '__qualname__', obj)}: {e}")
    return out


def test_a_call_with_a_removed_keyword_is_found():
    source = ("from nemo_dapo.engines import weight_group as WG\n"
              "from nemo_dapo.core.collective import cpu_wait_group\n"
              "WG.update_over_group([], [], timeout_s=300)\n"
              "cpu_wait_group(None, None, None, None)\n"
              "WG.update_over_group([], [], backend='gloo')\n")
    found = stale_calls(source, "example.py")
    assert len(found) == 2
    assert "example.py:3: update_over_group: got an unexpected keyword argument 'timeout_s'" in found
    assert found[1].startswith("example.py:4: cpu_wait_group: too many positional arguments")


def test_every_call_in_the_device_only_tests_and_the_benchmarks_binds():
    files = sorted((ROOT / "tests" / "gpu").glob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py"))
    assert len(files) > 10
    stale = [s for f in files for s in stale_calls(f.read_text(), str(f.relative_to(ROOT)))]
    assert stale == []
