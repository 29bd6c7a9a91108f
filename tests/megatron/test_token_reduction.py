"""Exact token-level reduction under megatron's schedules: the scale arithmetic, and gradients equal to one process.

The slow test runs tests/megatron/workers/reduction_worker.py once (2 ranks, gloo) for every layout; see its
docstring for the cases.
"""
import json
from pathlib import Path

import pytest
import torch

from nemo_dapo.megatron import reduction
from nemo_dapo.megatron.reduction import DPReducer, schedule_loss_scale
from tests.support.megatron_reduction import global_token_count
from tests.support.dist import run_torchrun

WORKER = Path(__file__).parent / "workers" / "reduction_worker.py"
GRAD_TOL = 2e-6  # relative to the largest reference gradient; fp32, different summation orders


def simulate(scale, n_microbatches, dp, cp, multiplies_by_cp):
    """What megatron does to a 2-tuple loss c * scale: schedule (x cp in newer releases, / num_microbatches),
    then DDP's average over dp * cp ranks. Returns the factor left on each contribution."""
    v = scale * (cp if multiplies_by_cp else 1) / n_microbatches
    return v / (dp * cp)


@pytest.mark.parametrize("multiplies_by_cp", [False, True])
@pytest.mark.parametrize("n,dp,cp", [(1, 1, 1), (4, 1, 1), (2, 2, 1), (3, 4, 2), (8, 16, 4)])
def test_scale_cancels_schedule_and_ddp_averaging(n, dp, cp, multiplies_by_cp):
    scale = schedule_loss_scale(n, dp, cp, multiplies_by_cp=multiplies_by_cp)
    assert simulate(scale, n, dp, cp, multiplies_by_cp) == pytest.approx(1.0, rel=1e-15)


def test_scale_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_microbatches"):
        schedule_loss_scale(0, 1)
    with pytest.raises(ValueError, match="dp_size"):
        schedule_loss_scale(2, 0)


def test_cp_behaviour_detected_for_installed_version():
    """0.10.0 divides a 2-tuple loss by num_microbatches only; releases with cp_group_size (0.16.1) also
    multiply by the CP size. The detection must agree with the installed source."""
    import megatron.core
    from megatron.core.pipeline_parallel import schedules
    major_minor = tuple(int(x) for x in megatron.core.__version__.split(".")[:2])
    detected = reduction.schedule_multiplies_by_cp()
    if major_minor == (0, 10):
        assert detected is False
    elif major_minor >= (0, 16):
        assert detected is True
    assert detected == ("cp_group_size" in Path(schedules.__file__).read_text())


def test_global_token_count_single_process_sums_masks():
    masks = [torch.tensor([[1.0, 1.0, 0.0]]), torch.zeros(2, 3), torch.tensor([[1, 0, 1], [1, 1, 1]])]
    assert global_token_count(masks) == 2 + 0 + 5


def test_reducer_refuses_without_parallel_state():
    with pytest.raises(RuntimeError, match="initialize_parallel"):
        DPReducer()


@pytest.fixture(scope="module")
def worker_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("reduction")
    run_torchrun(WORKER, nproc=2, out_dir=out)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


CASES = ["dp1_4mb", "dp2_2mb", "pp2_4mb", "tp2_4mb", "dp2_per_token"]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_gradients_equal_single_process_reference(worker_results, case):
    for rank, res in enumerate(worker_results):
        got = res[case]
        assert got["params_compared"] == got["local_params"] > 0, (rank, got)
        assert got["grad_rel_err"] < GRAD_TOL, (case, rank, got)


@pytest.mark.slow
def test_layouts_cover_the_batch_and_a_fully_masked_rank(worker_results):
    r0, r1 = worker_results
    n = r0["reference"]["num_tokens"]
    assert n > 0
    # DP=2: rank 1 holds only masked rows; its loss share is exactly 0 and the global loss is rank 0's share
    assert r1["dp2_2mb"]["local_tokens"] == 0.0 and r1["dp2_2mb"]["local_loss"] == 0.0
    assert r0["dp2_2mb"]["local_tokens"] == n
    assert r0["dp2_2mb"]["num_microbatches"] == 2 and r0["dp1_4mb"]["num_microbatches"] == 4
    ref_loss = r0["reference"]["loss"]
    for case in ("dp1_4mb", "tp2_4mb"):
        assert r0[case]["local_loss"] == pytest.approx(ref_loss, rel=1e-5, abs=1e-8)
    # PP: only the last stage sees the loss
    assert r1["pp2_4mb"]["local_loss"] == pytest.approx(ref_loss, rel=1e-5, abs=1e-8)
    assert r0["pp2_4mb"]["local_loss"] == 0.0


@pytest.mark.slow
def test_unscaled_two_tuple_is_detectably_wrong(worker_results):
    """Without the scale, megatron's averaging leaves 1 / (num_microbatches * DP) = 1/4 of the gradient."""
    for res in worker_results:
        assert res["dp2_naive"]["grad_rel_err"] == pytest.approx(0.75, abs=1e-3)
