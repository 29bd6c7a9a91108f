"""Device test: the real TensorRT-LLM engine of NeMo-Aligner 0.7.0 behind nemo_dapo's TRTLLMGenerator.

Needs one GPU and the trainer image (containers/Dockerfile: NeMo-Aligner 0.7.0's stack, TensorRT-LLM 0.13 with its
patch, Transformer Engine, apex); skipped elsewhere. Inside the container, from the repository root:

    pip install --no-deps -e . && pytest tests/gpu/test_aligner_trtllm.py -m gpu -v

The worker (aligner_trtllm_worker.py) runs in its own process: TensorRT-LLM initialises MPI and CUDA state that
must not leak into the test session. What is checked: the engine is built once and refit (not rebuilt) after a
weight update; greedy tokens are Megatron's argmax under teacher forcing (the engine and the trainer compute the
same distribution), before and after the refit; seeded sampling is reproducible; after the first refit the engine's
log-probs of its sampled tokens equal the actor's recomputed ones within the worker's LOGPROB_* tolerances (the
worker exits non-zero on a mismatch); the model has Qwen2's QKV bias, which the engine must carry.
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.support.dist import ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.nemo, pytest.mark.slow]
HAVE_STACK = all(importlib.util.find_spec(m) is not None for m in ("tensorrt_llm", "nemo_aligner", "megatron.core"))


@pytest.mark.skipif(not HAVE_STACK, reason="needs the trainer image (NeMo-Aligner 0.7.0 and TensorRT-LLM)")
def test_trtllm_engine_build_refit_and_agreement_with_megatron(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "tests/gpu/aligner_trtllm_worker.py")], cwd=ROOT,
                          env={**os.environ, "OUT_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    report = json.loads((tmp_path / "trtllm.json").read_text())
    assert report["calls"] == {"build": 1, "refit": 1}, report["calls"]  # one build, one refit after the update
    for phase in ("greedy", "after_refit"):
        r = report[phase]
        assert r["tokens"] > 0
        # fp32 on both sides: the engine's greedy token is Megatron's argmax (a rare near-tie may flip)
        assert r["argmax_agreement"] >= 0.97, (phase, r)
        assert r["max_logprob_gap"] < 0.05, (phase, r)
    assert report["refit_changed_output"], "after the weight update the engine still produced the old tokens"
    assert report["sampling_reproducible"] and report["sampling_seed_changes_output"]
    lp = report["logprob_after_refit"]
    assert lp["tokens"] > 0, lp
    assert lp["max_abs_diff"] <= lp["tolerance"]["max_abs"] and lp["mean_abs_diff"] <= lp["tolerance"]["mean_abs"], lp
    assert all(1 <= n <= 16 for n in report["response_lengths"])
