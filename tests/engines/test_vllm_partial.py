"""VLLMEngine's partial output and its continuation (what partial rollouts resubmit), in vLLM's own venv
(``vllm_partial_worker.py``; skipped without the vLLM interpreter, as test_vllm_engine.py)."""
import json
import os
import subprocess

import pytest

from tests.engines.test_vllm_engine import ROOT, VLLM_PYTHON


@pytest.mark.slow
@pytest.mark.skipif(not (os.path.isfile(VLLM_PYTHON) and os.access(VLLM_PYTHON, os.X_OK)),
                    reason=f"no vLLM interpreter at {VLLM_PYTHON}: make one with `bash scripts/install.sh "
                           ".venv-vllm engine-vllm` or set NEMO_DAPO_VLLM_PYTHON")
def test_vllm_abort_reports_the_prefix_and_prompt_plus_partial_continues_it():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([VLLM_PYTHON, str(ROOT / "tests/engines/vllm_partial_worker.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"worker printed no JSON (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    report = json.loads(lines[-1])
    assert report["ok"] and proc.returncode == 0, report["failures"]
    assert len(report["checks"]) >= 9 and all(report["checks"].values())
