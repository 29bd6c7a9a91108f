"""VLLMEngine's partial output and its continuation (what partial rollouts resubmit), in vLLM's own venv
(``vllm_partial_worker.py``; skipped without the vLLM interpreter, as test_vllm_engine.py)."""
import os

import pytest

from tests.engines.test_vllm_engine import VLLM_PYTHON
from tests.support.json_worker import run_json_worker


@pytest.mark.slow
@pytest.mark.skipif(not (os.path.isfile(VLLM_PYTHON) and os.access(VLLM_PYTHON, os.X_OK)),
                    reason=f"no vLLM interpreter at {VLLM_PYTHON}: make one with `bash scripts/install.sh "
                           ".venv-vllm engine-vllm` or set NEMO_DAPO_VLLM_PYTHON")
def test_vllm_abort_reports_the_prefix_and_prompt_plus_partial_continues_it():
    report, proc = run_json_worker(VLLM_PYTHON, "tests/engines/vllm_partial_worker.py", timeout=600)
    assert report["ok"] and proc.returncode == 0, report["failures"]
    assert len(report["checks"]) >= 10 and all(report["checks"].values())
