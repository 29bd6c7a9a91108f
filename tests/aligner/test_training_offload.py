"""The whole training state (weights, main grads, optimizer states) leaves the device while the engine generates and
comes back bit for bit (nemo_dapo/megatron/state_offload.py, aligner/training_offload.py).

On the CPU the storages are freed and restored in place (CPU -> CPU copies), so this checks what the round trip
does to every tensor and to the next update; the device memory drop is checked by the CUDA variant below."""
import json

import pytest
import torch

from tests.aligner.conftest import needs_nemo
from tests.support.dist import ROOT, run_torchrun

WORKER = ROOT / "tests/aligner/workers/training_offload_worker.py"


def run_case(tmp_path, case, device="cpu", nproc=2):
    run_torchrun(WORKER, nproc=nproc, out_dir=tmp_path, timeout=600, env={"CASE": case, "DEVICE": device})
    return [json.loads((tmp_path / f"{case}_rank{r}.json").read_text()) for r in range(nproc)]


def check(ranks):
    for r in ranks:
        assert all(v == 0 for v in r["left_bytes"].values()), r["left_bytes"]  # every storage freed
        assert r["reported"] == r["want_bytes"] > 0  # the bytes reported are the bytes the tensors held
        assert r["weights_after_stage1"] > 0  # the refit's gather still has the weights after the first stage
        assert r["stage_bytes"][2] == 0 and r["onload_again"] == 0  # a second offload / onload moves nothing
        assert r["bit_identical"] and r["same_objects"]  # views into the DDP buffers stay valid
        assert r["steps_a"] == r["steps_b"] and r["final_equal"] and r["moved"]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["mcore", pytest.param("nemo", marks=needs_nemo)])
def test_offload_round_trip_leaves_training_unchanged(tmp_path, case):
    check(run_case(tmp_path, case))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["mcore"])
def test_offload_frees_the_device_memory(tmp_path, case):
    """One rank per GPU, two at most (one GPU: DP=1, the whole optimizer state on the one rank)."""
    nproc = min(2, torch.cuda.device_count())
    ranks = run_case(tmp_path, case, device="cuda", nproc=nproc)
    for r in ranks:
        print(f"RESULT training_offload_cuda ranks={nproc} state_bytes={r['want_bytes']} "
              f"allocated_drop={r['allocated_drop']} storages={r['storages']}")
    check(ranks)
    assert all(r["allocated_drop"] >= r["want_bytes"] for r in ranks)


def test_a_rollout_steps_offload_metrics_are_seconds_and_gigabytes():
    from nemo_dapo.aligner.training_offload import pop_metrics

    class Moves:
        def pop_stats(self):
            return {"offload_s": 1.5, "onload_s": 0.25, "offloaded_bytes": 3 * 10 ** 9}

    assert pop_metrics(Moves()) == {"timing/offload_s": 1.5, "timing/onload_s": 0.25, "memory/offloaded_gb": 3.0}
    assert pop_metrics(None) == {}  # no offload configured: no metrics
