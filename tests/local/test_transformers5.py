"""The local KV-cached decoders (``LocalSampler``, ``LocalEngine``; their cache is ``nemo_dapo.models.kv_cache``) under
transformers 5.x, whose ``Cache`` is a container of per-layer ``CacheLayerMixin`` objects.

This venv has transformers 4.x, so the checks run in ``transformers5_worker.py`` under the vLLM venv's interpreter
(transformers 5.x; made by ``bash scripts/install.sh .venv-vllm engine-vllm``, or ``$NEMO_DAPO_VLLM_PYTHON``);
skipped when there is none. The worker compares greedy tokens and log-probs with a cache-free reference for a tiny
Llama and a tiny Qwen2 (see its docstring) and prints a JSON report.
"""
import os
from pathlib import Path

import pytest

from tests.support.json_worker import run_json_worker

ROOT = Path(__file__).resolve().parents[2]
PYTHON = os.environ.get("NEMO_DAPO_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")


@pytest.mark.skipif(not (os.path.isfile(PYTHON) and os.access(PYTHON, os.X_OK)),
                    reason=f"no transformers-5 interpreter at {PYTHON}: make the vLLM venv with `bash "
                           "scripts/install.sh .venv-vllm engine-vllm` or set NEMO_DAPO_VLLM_PYTHON")
def test_local_sampler_and_engine_under_transformers5():
    report, proc = run_json_worker(PYTHON, "tests/local/transformers5_worker.py", timeout=300)
    if int(report["transformers"].split(".")[0]) < 5:
        pytest.skip(f"{PYTHON} has transformers {report['transformers']}, not 5.x")
    assert report["layered_cache"], "transformers 5.x but kv_cache did not detect the per-layer Cache API"
    assert report["ok"] and proc.returncode == 0, report["failures"]
    assert all(report["checks"].values()), [k for k, v in report["checks"].items() if not v]
    for arch in ("llama", "qwen2"):
        for part in ("sampler", "engine"):
            assert report["checks"][f"{arch}_{part}_greedy_tokens"]
            assert report["max_abs_diff"][f"{arch}_{part}_greedy_logp"] <= 1e-5, report["max_abs_diff"]
            assert report["max_abs_diff"][f"{arch}_{part}_sampled_logp"] <= 1e-5, report["max_abs_diff"]
        assert report["checks"][f"{arch}_engine_window_moved"]
