"""Build-time contract check: does the installed ``tensorrt_llm`` have every item the adapter relies on?

    python -m nemo_dapo.engines.trtllm_check [--snapshot PATH]

Reads ``trtllm_api_snapshot.json`` (next to this file by default: the record of the pinned release), introspects the
installed package (``SamplingParams`` / ``TorchLlmArgs`` / ``KvCacheConfig`` fields, ``LogprobMode`` and scheduler
members, ``WorkerExtension.update_weights``'s signature and source markers, our worker extension's base, decorator
and mixing-in, the abort path down to the executor's cancel, the sleep RPCs and memory tags, the registered model
architectures) and ``import ray``, and prints EVERY mismatch, one per line. Exit status: 0 when all items match, 1
when any does not, 2 when the snapshot cannot be read. ``containers/Dockerfile.engine`` runs it, so an image whose
TensorRT-LLM differs from the record fails to build; CI runs it against ``tests/engines/fake_trtllm.py``.

Which snapshot keys are checked is declared in :data:`CHECKED` (item -> the sub-keys whose values are compared) and
:data:`DOC_KEYS` (sub-keys that only document); a test fails if the snapshot holds a key in neither.
"""
from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib
import inspect
import json
import sys
from pathlib import Path
from typing import Callable

SNAPSHOT = Path(__file__).with_name("trtllm_api_snapshot.json")
# sub-keys that document an item (where it was read, why); never compared
DOC_KEYS = frozenset({"file", "notes", "field_notes", "source", "why_this_release", "tag_commit_evidence",
                      "image_naming", "how_read", "repository", "tag", "commit", "image", "api", "adapter_rule",
                      "decorator", "ipc_handles", "returns", "kwarg_notes"})
# top-level keys that only document (no installed object to compare with)
DOC_ITEMS = frozenset({"_about", "reduce_tensor"})


def _obj(path: str):
    """'pkg.mod.Name' or 'pkg.mod' -> the object (ImportError / AttributeError propagate)."""
    try:
        return importlib.import_module(path)
    except ImportError:
        mod, _, name = path.rpartition(".")
        if not mod:
            raise
        return getattr(importlib.import_module(mod), name)


def _fields(cls) -> set:
    """Field names of a pydantic model, a dataclass (slots or not), else the constructor's parameter names."""
    if hasattr(cls, "model_fields"):
        return set(cls.model_fields)
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(inspect.signature(cls).parameters)


def _params(fn) -> list:
    return list(inspect.signature(inspect.unwrap(fn)).parameters)


def _source(obj) -> str:
    try:
        return inspect.getsource(inspect.unwrap(obj) if callable(obj) and not inspect.isclass(obj) else obj)
    except (OSError, TypeError):
        return ""


def _has_attribute(cls, name: str) -> bool:
    """A class attribute / property / method in the MRO, or an instance attribute assigned in the MRO's source."""
    return any(name in vars(k) or f"self.{name} =" in _source(k) or f"self.{name}:" in _source(k)
               for k in inspect.getmro(cls))


class Check:
    """Collects mismatches as 'item.key: what' lines."""

    def __init__(self):
        self.problems: list = []

    def need(self, ok: bool, where: str, what: str) -> bool:
        if not ok:
            self.problems.append(f"{where}: {what}")
        return ok

    def subset(self, want, have, where: str, kind: str) -> None:
        missing = sorted(set(want) - set(have))
        self.need(not missing, where, f"the installed package lacks {kind} {missing}")

    def load(self, path: str, where: str):
        try:
            return _obj(path)
        except Exception as e:  # noqa: BLE001 - any import failure is a mismatch to report, not a crash
            self.need(False, where, f"cannot import {path}: {type(e).__name__}: {e}")
            return None


def _release(c: Check, item: dict, _snap) -> None:
    trt = c.load("tensorrt_llm", "release.version")
    if trt is not None:
        got = str(getattr(trt, "__version__", "?"))
        c.need(got == item["version"], "release.version", f"installed tensorrt_llm {got}, recorded {item['version']}")


def _modules(c: Check, item: dict, _snap) -> None:
    for mod, names in item.items():
        if mod in DOC_KEYS:
            continue
        m = c.load(mod, f"modules.{mod}")
        if m is not None:
            c.subset(names, [n for n in names if hasattr(m, n)], f"modules.{mod}", "names")


def _fields_item(name: str) -> Callable:
    def check(c: Check, item: dict, _snap) -> None:
        cls = c.load(f"{item['module']}.{name}", f"{name}.module")
        if cls is not None:
            c.subset(item["fields"], _fields(cls), f"{name}.fields", "fields")
    return check


def _torch_llm_args(c: Check, item: dict, snap) -> None:
    _fields_item("TorchLlmArgs")(c, item, snap)


def _annotation(c: Check, snap: dict, field: str, where: str) -> str:
    cls = c.load(f"{snap['TorchLlmArgs']['module']}.TorchLlmArgs", where)
    if cls is None or not c.need(field in _fields(cls), where, f"TorchLlmArgs has no field {field!r}"):
        return ""
    info = getattr(cls, "model_fields", {}).get(field)
    return str(getattr(info, "annotation", ""))


def _allreduce(c: Check, item: dict, snap) -> None:
    ann = _annotation(c, snap, item["field"], "allreduce.field")
    if ann:
        c.subset(item["required_values"], [v for v in item["required_values"] if repr(v) in ann or v in ann],
                 "allreduce.required_values", f"{item['field']} values (annotation {ann})")


def _cuda_graphs(c: Check, item: dict, snap) -> None:
    ann = _annotation(c, snap, item["field"], "cuda_graphs.field")
    value = item["adapter_value"]
    if ann:
        ok = ("None" in ann or "Optional" in ann) if value is None else repr(value) in ann
        c.need(ok, "cuda_graphs.adapter_value", f"{item['field']} does not accept {value!r} (annotation {ann})")


def _members(c: Check, item: dict, where: str, cls) -> None:
    members = {m.name: m.value for m in cls} if isinstance(cls, enum.EnumMeta) else {}
    want = item["members"]
    if isinstance(want, dict):
        bad = sorted(k for k, v in want.items() if members.get(k) != v)
        c.need(not bad, f"{where}.members", f"members {bad} missing or with other values (installed {members})")
    else:
        c.subset(want, members, f"{where}.members", "members")


def _logprob_mode(c: Check, item: dict, _snap) -> None:
    cls = c.load(f"{item['module']}.LogprobMode", "LogprobMode.module")
    if cls is not None:
        _members(c, item, "LogprobMode", cls)
        c.need(item["adapter_value"] in {m.value for m in cls}, "LogprobMode.adapter_value",
               f"{item['adapter_value']!r} is not a LogprobMode value")


def _policy(c: Check, item: dict, _snap) -> None:
    cls = c.load(f"{item['module']}.CapacitySchedulerPolicy", "CapacitySchedulerPolicy.module")
    if cls is not None:
        _members(c, item, "CapacitySchedulerPolicy", cls)


def _methods(c: Check, cls, methods: dict, where: str) -> None:
    for name, spec in methods.items():
        fn = getattr(cls, name, None)
        if not c.need(callable(fn), f"{where}.methods.{name}", f"{cls.__name__}.{name} is missing"):
            continue
        want = spec["params"] if isinstance(spec, dict) else spec
        got = _params(fn)
        c.need(got[:len(want)] == list(want), f"{where}.methods.{name}.params",
               f"{cls.__name__}.{name} takes {got}, recorded {list(want)} first")
        markers = spec.get("source_markers", {}) if isinstance(spec, dict) else {}
        src = _source(fn)
        c.subset(markers, [m for m in markers if m in src], f"{where}.methods.{name}.source_markers",
                 f"source markers (in {cls.__name__}.{name})")


def _llm(c: Check, item: dict, snap) -> None:
    cls = c.load(f"{item['module']}.LLM", "LLM.module")
    if cls is None:
        return
    _methods(c, cls, item["methods"], "LLM")
    kinds = {p.kind for p in inspect.signature(cls).parameters.values()}
    c.need(inspect.Parameter.VAR_KEYWORD in kinds, "LLM.kwargs_besides_fields", "LLM() takes no **kwargs")
    src = "".join(_source(k) for k in inspect.getmro(cls))
    c.subset(item["kwargs_besides_fields"], [k for k in item["kwargs_besides_fields"] if k in src],
             "LLM.kwargs_besides_fields", "keywords handled by LLM")


def _attributes_item(module: str, name: str) -> Callable:
    def check(c: Check, item: dict, _snap) -> None:
        cls = c.load(f"{module}.{name}", f"{name}.attributes")
        if cls is None:
            return
        c.subset(item["attributes"], [a for a in item["attributes"] if _has_attribute(cls, a)],
                 f"{name}.attributes", "attributes")
        c.subset(item.get("methods", []), [m for m in item.get("methods", []) if callable(getattr(cls, m, None))],
                 f"{name}.methods", "methods")
        if "finish_reasons" in item:
            owner = c.load(item["finish_reasons_in"], f"{name}.finish_reasons_in")
            src = _source(owner) if owner is not None else ""
            c.subset(item["finish_reasons"], [r for r in item["finish_reasons"] if f"'{r}'" in src or f'"{r}"' in src],
                     f"{name}.finish_reasons", f"finish reasons (in {item['finish_reasons_in']})")
    return check


def _cancel(c: Check, item: dict, snap) -> None:
    for path, methods in item["classes"].items():
        cls = c.load(path, f"cancel.classes.{path}")
        if cls is not None:
            _methods(c, cls, methods, f"cancel.{path.rpartition('.')[2]}")
    c.need(item["finish_reason"] in snap["CompletionOutput"]["finish_reasons"], "cancel.finish_reason",
           f"{item['finish_reason']!r} is not among CompletionOutput.finish_reasons")


def _worker_extension(c: Check, item: dict, _snap) -> None:
    cls = c.load(item["class_path"], "WorkerExtension.class_path")
    c.need(item["class_path"].rpartition(".")[0] == item["module"], "WorkerExtension.module",
           f"class_path {item['class_path']} is not in module {item['module']}")
    if cls is not None:
        _methods(c, cls, item["methods"], "WorkerExtension")


def _group_extension(c: Check, item: dict, snap) -> None:
    """Our worker extension (engines/trtllm_worker.py) against the release: the decorator it applies, the
    wrapper that mixes it in by import path, the worker attributes it reads and no name the worker already has."""
    where = "group_worker_extension"
    c.load(item["decorator_path"], f"{where}.decorator_path")
    wrapper = c.load(f"{item['wrapper_module']}.{item['wrapper_class']}", f"{where}.wrapper_class")
    if wrapper is not None:
        src = "".join(_source(k) for k in inspect.getmro(wrapper))
        c.subset(item["wrapper_markers"], [m for m in item["wrapper_markers"] if m in src],
                 f"{where}.wrapper_markers", f"source markers (in {wrapper.__name__})")
    worker = c.load(f"{snap['sleep']['worker_module']}.{snap['sleep']['worker_class']}", f"{where}.worker_markers")
    if worker is not None:
        src = "".join(_source(k) for k in inspect.getmro(worker))
        c.subset(item["worker_markers"], [m for m in item["worker_markers"] if m in src], f"{where}.worker_markers",
                 f"source markers (in {worker.__name__})")
        clash = sorted(m for m in item["methods"] if hasattr(worker, m))
        c.need(not clash, f"{where}.methods", f"{worker.__name__} already has {clash} (the release refuses a clash)")
    ext = c.load(item["class_path"], f"{where}.class_path")
    hook = c.load(snap["WorkerExtension"]["class_path"], f"{where}.class_path")
    if ext is not None and hook is not None:
        c.need(issubclass(ext, hook), f"{where}.class_path", f"{ext.__name__} does not extend {hook.__name__}")
        c.subset(item["methods"], [m for m in item["methods"] if callable(getattr(ext, m, None))],
                 f"{where}.methods", f"methods of {item['class_path']}")


def _sleep(c: Check, item: dict, snap) -> None:
    worker = c.load(f"{item['worker_module']}.{item['worker_class']}", "sleep.worker_class")
    if worker is not None:
        _methods(c, worker, item["rpc_methods"], "sleep.rpc")
    tags = c.load(f"{item['tags_module']}.{item['tags_enum']}", "sleep.tags_enum")
    if tags is not None:
        c.subset(item["tags"], {m.value for m in tags}, "sleep.tags", "memory tags")
    used = {t for ts in item["adapter_tags"].values() for t in ts}
    c.subset(used, item["tags"], "sleep.adapter_tags", "recorded tags for the adapter's")
    c.need("enable_sleep" in snap["TorchLlmArgs"]["fields"], "sleep.api", "TorchLlmArgs.fields lacks enable_sleep")


def _ray(c: Check, item: dict, _snap) -> None:
    c.load(item["import"], "ray.import")
    ex = c.load(item["executor_class"], "ray.executor_class")
    if ex is not None:
        c.need(item["force_local_cluster_env"] in _source(ex), "ray.force_local_cluster_env",
               f"{item['executor_class']} does not read {item['force_local_cluster_env']}")


def _architectures(c: Check, item: dict, _snap) -> None:
    archs = [k for k in item if k.endswith("ForCausalLM")]
    mapping = c.load("tensorrt_llm._torch.models.modeling_utils.MODEL_CLASS_MAPPING", "hf_weight_names")
    if mapping is not None:
        c.load("tensorrt_llm._torch.models", "hf_weight_names")  # importing the package registers the models
        c.subset(archs, set(mapping), "hf_weight_names", "registered model architectures")


# item -> (checker, the sub-keys it compares, fnmatch patterns); a sub-key in neither this nor DOC_KEYS fails a test
CHECKED = {
    "release": (_release, {"version"}),
    "modules": (_modules, {"tensorrt_llm", "tensorrt_llm.llmapi", "tensorrt_llm._torch.utils"}),
    "TorchLlmArgs": (_torch_llm_args, {"module", "fields"}),
    "allreduce": (_allreduce, {"field", "required_values"}),
    "cuda_graphs": (_cuda_graphs, {"field", "adapter_value"}),
    "SamplingParams": (_fields_item("SamplingParams"), {"module", "fields"}),
    "LogprobMode": (_logprob_mode, {"module", "members", "adapter_value"}),
    "KvCacheConfig": (_fields_item("KvCacheConfig"), {"module", "fields"}),
    "SchedulerConfig": (_fields_item("SchedulerConfig"), {"module", "fields"}),
    "CapacitySchedulerPolicy": (_policy, {"module", "members"}),
    "LLM": (_llm, {"module", "methods", "kwargs_besides_fields"}),
    "RequestOutput": (_attributes_item("tensorrt_llm.llmapi.llm", "RequestOutput"), {"attributes", "methods"}),
    "CompletionOutput": (_attributes_item("tensorrt_llm.executor.result", "CompletionOutput"),
                         {"attributes", "finish_reasons", "finish_reasons_in"}),
    "Logprob": (_attributes_item("tensorrt_llm.executor.result", "Logprob"), {"attributes"}),
    "cancel": (_cancel, {"classes", "finish_reason"}),
    "WorkerExtension": (_worker_extension, {"module", "class_path", "methods"}),
    "group_worker_extension": (_group_extension, {"class_path", "decorator_path", "wrapper_module", "wrapper_class",
                                                  "wrapper_markers", "worker_markers", "methods"}),
    "sleep": (_sleep, {"worker_module", "worker_class", "rpc_methods", "tags_module", "tags_enum", "tags",
                       "adapter_tags"}),
    "ray": (_ray, {"import", "executor_class", "force_local_cluster_env"}),
    "hf_weight_names": (_architectures, {"*ForCausalLM"}),
}
# hf_weight_names' name lists are the loaders' contract with our converter (checked on CPU by the vLLM second loader
# and tests/megatron/test_refit_hf.py); here only the architectures' registration is compared
DOC_KEYS_OF = {"hf_weight_names": frozenset({"_about", "fused_moe_loader", "advice_for_senders"})}


def check(snapshot: dict) -> list:
    """Every mismatch between ``snapshot`` and the installed ``tensorrt_llm`` (empty: all match)."""
    c = Check()
    for key in sorted(set(snapshot) - set(CHECKED) - DOC_ITEMS):
        c.need(False, key, "the snapshot records an item this checker does not check")
    for key, (fn, _) in CHECKED.items():
        if key not in snapshot:
            c.need(False, key, "missing from the snapshot")
            continue
        try:
            fn(c, snapshot[key], snapshot)
        except Exception as e:  # noqa: BLE001 - one broken item must not hide the others
            c.need(False, key, f"check failed: {type(e).__name__}: {e}")
    return c.problems


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m nemo_dapo.engines.trtllm_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--snapshot", default=str(SNAPSHOT), help="the recorded API (default: %(default)s)")
    args = p.parse_args(argv)
    try:
        snapshot = json.loads(Path(args.snapshot).read_text())
    except (OSError, ValueError) as e:
        print(f"trtllm_check: error: cannot read the snapshot {args.snapshot!r}: {e}", file=sys.stderr)
        return 2
    problems = check(snapshot)
    tag = snapshot.get("release", {}).get("tag", "?")
    for line in problems:
        print(f"trtllm_check: MISMATCH {line}", file=sys.stderr)
    if problems:
        print(f"trtllm_check: {len(problems)} mismatch(es) with the record of TensorRT-LLM {tag} ({args.snapshot}); "
              "fix: build FROM the image the snapshot names, or re-record the snapshot from the new release",
              file=sys.stderr)
        return 1
    print(f"trtllm_check: the installed tensorrt_llm matches the record of {tag} ({len(CHECKED)} items)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
