"""VLLMEngine (engines/vllm.py) against transformers, in vLLM's own venv.

vLLM needs torch / transformers versions of its own, so the checks run in ``vllm_engine_worker.py`` under the
interpreter of the venv made by ``bash scripts/install.sh .venv-vllm engine-vllm`` (or ``$NEMO_DAPO_VLLM_PYTHON``);
skipped when there is none. This test saves a tied-embedding checkpoint with THIS venv's transformers, so the
worker also proves that a model saved by the trainer's transformers loads in vLLM and takes its weight updates.
"""
import json
import os
import subprocess
from pathlib import Path

import pytest

from nemo_dapo.models.decoder import build_model, save_model

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = os.environ.get("NEMO_DAPO_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
TIED = dict(arch="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)  # head_dim 32


@pytest.mark.slow
@pytest.mark.skipif(not (os.path.isfile(VLLM_PYTHON) and os.access(VLLM_PYTHON, os.X_OK)),
                    reason=f"no vLLM interpreter at {VLLM_PYTHON}: make one with `bash scripts/install.sh "
                           ".venv-vllm engine-vllm` or set NEMO_DAPO_VLLM_PYTHON")
def test_vllm_engine_matches_transformers_and_takes_weight_updates(tmp_path):
    save_model(build_model(TIED, vocab_size=64, pad_id=0, bos_id=1, eos_id=2, seed=3), tmp_path / "tied")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([VLLM_PYTHON, str(ROOT / "tests/engines/vllm_engine_worker.py"),
                           "--tied-model", str(tmp_path / "tied")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"worker printed no JSON (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    report = json.loads(lines[-1])
    assert report["ok"] and proc.returncode == 0, report["failures"]
    assert all(report["checks"].values()), [k for k, v in report["checks"].items() if not v]
    for key in ("sampled_tokens", "fixed_after_update_vs_new", "sampled_after_update", "tied_sampled",
                "tied_after_update"):
        assert report["max_abs_diff"][key] < report["tolerance"], (key, report["max_abs_diff"])
    assert report["max_abs_diff"]["fixed_after_update_vs_old"] > 0.01  # the update reached the running model
    assert {"stop", "length"} <= set(report["finish_reasons"]) and report["eos_ended_samples"] > 0
