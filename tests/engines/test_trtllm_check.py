"""The build-time contract checker (nemo_dapo.engines.trtllm_check) run against the fake TensorRT-LLM, so that the
snapshot, the fake and the checker cannot drift apart: the fake (tests/engines/fake_trtllm.py) declares its API
itself, the checker must find every recorded item in it, every item the snapshot holds must be one the checker
compares (or a declared documentation key), and a changed item must produce a mismatch naming it.

``ray`` is not installed here: a stand-in module named ``ray`` sits beside the fake package (the image imports the
real one; containers/Dockerfile.engine installs and imports it)."""
import copy
import fnmatch
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from nemo_dapo.engines import trtllm_check as C
from tests.engines import fake_trtllm as F

ROOT = Path(__file__).resolve().parents[2]
SNAP = json.loads(C.SNAPSHOT.read_text())
BOGUS = "__bogus__"


@pytest.fixture
def fake_package(tmp_path):
    """The fake installed as an importable ``tensorrt_llm`` (plus a stand-in ``ray``) under a sys.path entry."""
    F.write_package(tmp_path / "site")
    (tmp_path / "site" / "ray.py").write_text("__version__ = 'stand-in'\n")
    return tmp_path / "site"


def run_checker(site, *args):
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{ROOT}" if site else str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "nemo_dapo.engines.trtllm_check", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_the_fake_package_passes_the_checker_from_the_command_line(fake_package):
    out = run_checker(fake_package, "--snapshot", str(C.SNAPSHOT))
    assert out.returncode == 0, out.stderr
    assert f"matches the record of {SNAP['release']['tag']}" in out.stdout


def test_every_mismatch_is_listed_and_the_exit_status_says_so(fake_package, tmp_path):
    bad = copy.deepcopy(SNAP)
    bad["SamplingParams"]["fields"].append("beam_width_array")
    bad["LogprobMode"]["members"]["PROCESSED_LOGITS"] = "processed_logits"
    bad["WorkerExtension"]["methods"]["update_weights"]["source_markers"]["finalize_update"] = "a later API"
    bad["TorchLlmArgs"]["fields"].append("sleep_config")
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    out = run_checker(fake_package, "--snapshot", str(path))
    assert out.returncode == 1
    lines = [ln for ln in out.stderr.splitlines() if "MISMATCH" in ln]
    assert len(lines) == 4, out.stderr
    for word in ("beam_width_array", "PROCESSED_LOGITS", "finalize_update", "sleep_config"):
        assert sum(word in ln for ln in lines) == 1, word
    assert "4 mismatch(es)" in out.stderr


def test_without_tensorrt_llm_or_ray_each_item_fails_and_a_bad_snapshot_is_exit_2(tmp_path):
    out = run_checker(None)
    assert out.returncode == 1 and "No module named 'tensorrt_llm'" in out.stderr
    assert "ray.import: cannot import ray" in out.stderr
    assert len([ln for ln in out.stderr.splitlines() if "MISMATCH" in ln]) >= len(C.CHECKED)
    out = run_checker(None, "--snapshot", str(tmp_path / "none.json"))
    assert out.returncode == 2 and "cannot read the snapshot" in out.stderr


def _sub_keys_of(key, item):
    return [k for k in item] if isinstance(item, dict) else []


def _checked(key, sub):
    return any(fnmatch.fnmatch(sub, pat) for pat in C.CHECKED[key][1])


def test_every_snapshot_entry_is_checked_or_declared_documentation():
    unchecked = []
    for key, item in SNAP.items():
        if key in C.DOC_ITEMS:
            continue
        if key not in C.CHECKED:
            unchecked.append(key)
            continue
        for sub in _sub_keys_of(key, item):
            if not (_checked(key, sub) or sub in C.DOC_KEYS or sub in C.DOC_KEYS_OF.get(key, ())):
                unchecked.append(f"{key}.{sub}")
    assert unchecked == []
    # and the checker itself refuses a snapshot item it has no check for
    assert "extra: the snapshot records an item this checker does not check" in C.check({**SNAP, "extra": {}})


def _mutations():
    """(item, sub-key, mutated snapshot) for every compared entry: a value the installed package cannot have."""
    for key, (_, subs) in C.CHECKED.items():
        for sub in sorted(subs):
            snap = copy.deepcopy(SNAP)
            item = snap[key]
            if "*" in sub:  # a pattern: a new entry that matches it
                item[sub.replace("*", "Bogus")] = {}
                yield key, sub, snap
                continue
            value = item[sub]
            if isinstance(value, list):
                value.append(BOGUS)
            elif isinstance(value, dict):
                value[BOGUS] = [BOGUS]
            else:
                item[sub] = BOGUS
            yield key, sub, snap


@pytest.fixture
def fake_in_process(monkeypatch):
    F.install()
    monkeypatch.setitem(sys.modules, "ray", types.ModuleType("ray"))


def test_the_fake_in_process_matches_and_every_compared_entry_is_really_compared(fake_in_process):
    assert C.check(SNAP) == []
    silent = []
    for key, sub, snap in _mutations():
        problems = C.check(snap)
        if not any(p.startswith(key) for p in problems):
            silent.append(f"{key}.{sub}")
    assert silent == []


def test_the_fake_accepts_exactly_the_recorded_fields(fake_in_process):
    """The fake is no looser than the record: a keyword the snapshot lacks is refused by the fake too."""
    assert C._fields(F.SamplingParams) == set(SNAP["SamplingParams"]["fields"])
    assert C._fields(F.TorchLlmArgs) == set(SNAP["TorchLlmArgs"]["fields"])
    assert C._fields(F.KvCacheConfig) == set(SNAP["KvCacheConfig"]["fields"])
    assert C._fields(F.SchedulerConfig) == set(SNAP["SchedulerConfig"]["fields"])
    assert {m.name for m in F.CapacitySchedulerPolicy} == set(SNAP["CapacitySchedulerPolicy"]["members"])
    assert {m.name: m.value for m in F.LogprobMode} == SNAP["LogprobMode"]["members"]
    assert {m.value for m in F.ExecutorMemoryType} == set(SNAP["sleep"]["tags"])
    rpc = {n for k in (F.WorkerExtension, F.RayGPUWorker) for n in vars(k) if not n.startswith("_")}
    assert rpc == set(SNAP["WorkerExtension"]["methods"]) | set(SNAP["sleep"]["rpc_methods"])
    assert F.__version__ == SNAP["release"]["version"]


def _dockerfile():
    text = (ROOT / "containers" / "Dockerfile.engine").read_text()
    return re.sub(r"\\\n", " ", "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#")))


def test_the_engine_image_is_the_recorded_release_and_runs_the_checker_and_ray():
    text = _dockerfile()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.M).group(1)
    assert base == SNAP["release"]["image"] == f"nvcr.io/nvidia/tensorrt-llm/release:{SNAP['release']['version']}"
    assert SNAP["release"]["tag"] == "v" + SNAP["release"]["version"]
    runs = [ln for ln in text.splitlines() if ln.startswith("RUN ")]
    check = next(ln for ln in runs if "nemo_dapo.engines.trtllm_check" in ln)
    snapshot = re.search(r"--snapshot (\S+)", check).group(1)
    assert snapshot == "/opt/nemo_dapo/" + str(C.SNAPSHOT.relative_to(ROOT))  # COPY . /opt/nemo_dapo
    assert any('python -c "import ray;' in ln for ln in runs)
    assert runs.index(check) > max(i for i, ln in enumerate(runs) if "ray" in ln and "trtllm_check" not in ln)
