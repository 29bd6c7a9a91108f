"""megatron_grad_norm: the norm megatron-core's optimizer steps with, read before the step, so that a non-finite
gradient skips the update (megatron-core 0.10's bf16 step would apply it). Runs tests/megatron/workers/
grad_norm_worker.py on 2 ranks (gloo, DP = 2; EP = 2 for MoE): a dense model and an MoE model (chained optimizers,
wrapped in NeMo's McoreDistributedOptimizer)."""
import json
import math

import pytest

from tests.support.dist import ROOT, run_torchrun

WORKER = ROOT / "tests/megatron/workers/grad_norm_worker.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("grad_norm")
    run_torchrun(WORKER, nproc=2, out_dir=out, timeout=300)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("case,optimizer", [("dense", "DistributedOptimizer"), ("moe", "ChainedOptimizer")])
def test_the_norm_before_the_step_is_the_one_the_step_clips_with(ranks, case, optimizer):
    for r in ranks:
        c = r[case]
        assert c["optimizer"] == optimizer
        assert c["ours"] > 0 and math.isfinite(c["ours"])
        assert c["ours"] == pytest.approx(c["megatrons"], rel=1e-6)  # megatron-core's own step, right after
        assert c["ours"] == pytest.approx(c["independent"], rel=1e-5)  # the test support's sum over the gradients
        assert c["ours_again"] == c["ours"]
    assert ranks[0][case]["ours"] == ranks[1][case]["ours"]  # global: the same on every rank
    c = ranks[0][case]
    print(f"{case}: norm {c['ours']:.10f}, megatron's step {c['megatrons']:.10f}, independent {c['independent']:.10f} "
          f"(rel. {abs(c['ours'] - c['independent']) / c['independent']:.1e})")  # pytest -s shows what is measured


@pytest.mark.parametrize("case", ["dense", "moe"])
def test_a_nan_gradient_on_one_rank_skips_the_update_on_every_rank(ranks, case):
    for r in ranks:
        c = r[case]
        assert not c["nan_norm_finite"] and c["nan_skipped"]
        # why it must be read before: megatron-core's bf16 step applies it (no loss scaler, no check)
        assert not c["weights_finite_after_megatrons_step"]
