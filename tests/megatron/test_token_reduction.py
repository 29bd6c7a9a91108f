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


# ---- the parallel-state readers, in one process (another rank simulated by a fake collective) ----------------------

@pytest.mark.parametrize("multiplies_by_cp", [False, True])
@pytest.mark.parametrize("n,dp,cp", [(3, 2, 1), (2, 4, 2), (5, 1, 4)])
def test_megatron_loss_scale_reads_dp_and_cp_as_megatron_counts_them(monkeypatch, n, dp, cp, multiplies_by_cp):
    """megatron's ``get_data_parallel_world_size()`` is the DP size WITHOUT CP (``with_context_parallel=True``
    gives DP x CP); the scale must cancel the schedule and DDP's average over DP x CP ranks at every CP size."""
    from megatron.core import parallel_state

    monkeypatch.setattr(parallel_state, "get_data_parallel_world_size",
                        lambda with_context_parallel=False, **_: dp * cp if with_context_parallel else dp)
    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: cp)
    monkeypatch.setattr(reduction, "schedule_multiplies_by_cp", lambda: multiplies_by_cp)
    assert simulate(reduction.megatron_loss_scale(n), n, dp, cp, multiplies_by_cp) == pytest.approx(1.0, rel=1e-15)


class OtherRank:
    """``dist.all_reduce`` over a group of this process and one other rank whose tensor is ``other``."""

    def __init__(self, other):
        self.other, self.calls = other, []

    def __call__(self, t, op=None, group=None):
        import torch.distributed as dist

        self.calls.append(op)
        other = torch.as_tensor(self.other).to(t.dtype).reshape(t.shape)
        if op in (None, dist.ReduceOp.SUM):
            t.add_(other)
        elif op == dist.ReduceOp.MAX:
            torch.maximum(t, other, out=t)
        else:
            raise AssertionError(f"unexpected op {op}")


def test_sum_grads_over_tp_leaves_the_sum_of_every_rank_in_each_gradient(monkeypatch):
    """QK-norm weights are whole on every TP rank but each rank's gradient covers its own heads only: after the
    call each gradient (several shapes, one coalesced collective) is the sum over the TP ranks."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    mine = [torch.arange(4.0), torch.full((2, 3), 0.5)]
    theirs = [torch.tensor([10.0, 20.0, 30.0, 40.0]), torch.arange(6.0).reshape(2, 3)]
    other = OtherRank(torch.cat([t.flatten() for t in theirs]))
    monkeypatch.setattr(dist, "all_reduce", other)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_group", lambda: None)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 2)
    grads = [t.clone() for t in mine]
    reduction.sum_grads_over_tp(grads)
    assert len(other.calls) == 1
    for g, a, b in zip(grads, mine, theirs):
        assert torch.equal(g, a + b)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 1)
    reduction.sum_grads_over_tp(grads)  # TP = 1: nothing to sum, no collective
    assert len(other.calls) == 1


@pytest.mark.parametrize("op,mine,theirs,want", [
    ("sum", torch.tensor(2 ** 40 + 1), torch.tensor(2 ** 40), torch.tensor(2 ** 41 + 1)),  # int64: exact
    ("max", torch.tensor([3, 9]), torch.tensor([7, 2]), torch.tensor([7, 9])),
    ("sum", torch.tensor([0.25, -1.5]), torch.tensor([1.0, 2.0]), torch.tensor([1.25, 0.5])),
    ("max", torch.tensor(True), torch.tensor(False), torch.tensor(True)),  # gloo has no bool reduction
])
def test_dp_reducer_reduces_over_its_ranks_in_the_input_dtype(monkeypatch, op, mine, theirs, want):
    import torch.distributed as dist

    other = OtherRank(theirs)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", other)
    reducer = DPReducer(group=object())
    before = mine.clone()
    got = getattr(reducer, op)(mine)
    assert got.dtype == mine.dtype and torch.equal(got, want), (got, want)
    assert torch.equal(mine, before)  # the input is left alone, as with one rank (int64 needs no conversion)
