"""Runs a worker script under another interpreter (e.g. the vLLM venv's) and returns its last JSON line."""
import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_json_worker(python: str, script: str, *, timeout: float) -> tuple:
    """``python ROOT/script`` with one thread, offline, the repo on the path. Returns (report dict, CompletedProcess);
    fails the test, with the worker's output, when it printed no JSON line."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([python, str(ROOT / script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"worker printed no JSON (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1]), proc
