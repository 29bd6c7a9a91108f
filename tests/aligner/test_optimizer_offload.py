"""The optimizer states leave the GPU while the engine generates (aligner/engine_generation.offload_optimizer_states,
NeMo-Aligner 0.7's ``offload_adam_states`` / ``onload_adam_states``), and come back unchanged.

Contract test: apex's DistributedFusedAdam cannot run without CUDA, so the worker drives NeMo-Aligner's real helper
on an optimizer with apex's state-bucket layout (tests/aligner/workers/offload_worker.py). On the CPU the move is
CPU -> CPU, so this checks what the round trip does to the states and the next update; the device move itself is
checked by the GPU variant.
"""
import json
import subprocess
import sys

import pytest
import torch

from tests.aligner.conftest import needs_nemo
from tests.support.dist import ROOT


def run_worker(tmp_path, device):
    env = {"OUT_DIR": str(tmp_path), "DEVICE": device, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests/aligner/workers/offload_worker.py")], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp_path / "offload.json").read_text())


def check_round_trip(out):
    assert out["inherited"]  # the DAPO actor uses NeMo-Aligner's methods unchanged
    assert out["manager_entered"]
    assert out["states_equal"] == [True] * 3  # master shard, exp_avg, exp_avg_sq bit for bit after each round trip
    assert out["same_buckets"] == [True] * 3  # the optimizer's own bucket objects, not copies, were moved
    assert out["params_moved"] and out["params_equal"]  # the updates after it equal those without any offload


@needs_nemo
@pytest.mark.nemo
@pytest.mark.slow  # a fresh NeMo import: 1-5 min on 2 shared cores
def test_offload_onload_keeps_the_states_and_the_next_update(tmp_path):
    out = run_worker(tmp_path, "cpu")
    check_round_trip(out)
    assert out["devices_onloaded"] == ["cpu"]


@needs_nemo
@pytest.mark.nemo
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_offload_moves_the_states_to_the_cpu_and_back(tmp_path):
    out = run_worker(tmp_path, "cuda")
    check_round_trip(out)
    assert out["devices_offloaded"] == ["cpu"] and out["devices_onloaded"] == ["cuda"]
