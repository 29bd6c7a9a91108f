"""MegatronPolicy (tests/support/megatron_policy.py: a bare GPTModel through megatron/step.py) against a
single-rank reference under TP=2, PP=2 and EP=2 (slow: tests/megatron/workers/policy_worker.py), plus two DAPO loop
steps on it (tests/megatron/workers/policy_loop_worker.py)."""
import json
from pathlib import Path

import pytest

from nemo_dapo.core.types import Policy
from tests.support.dist import run_torchrun
from tests.support.megatron_policy import MegatronPolicy

WORKERS = Path(__file__).parent / "workers"
LOGP_TOL = 5e-6  # fp32; the reference runs each row unpadded through full logits
UPDATE_TOL = 2e-6  # relative to the largest reference weight change


def test_policy_class_satisfies_protocol_surface():
    for name in ("logprobs", "train_step", "state_dict", "load_state_dict"):
        assert callable(getattr(MegatronPolicy, name))
    assert issubclass(MegatronPolicy, Policy)  # runtime_checkable: method names only


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    out = tmp_path_factory.mktemp("policy")
    # level 4: megatron's optimizer insists on 'torch.cuda.FloatTensor' grads (tp2_megatron_opt)
    run_torchrun(WORKERS / "policy_worker.py", nproc=2, out_dir=out, env={"SHIM_LEVEL": "4"})
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["tp2", "pp2", "pp2_tied", "ep2", "tp2_megatron_opt", "tp2_valid_vocab"])
def test_logprobs_and_update_equal_reference(parity, case):
    for rank, res in enumerate(parity):
        r = res[case]
        assert r["logp_shape"] == [r["rows"], 7]
        assert r["logp_err"] < LOGP_TOL and r["ent_err"] < LOGP_TOL, (case, rank, r)
        assert r["skipped"] == 0.0
        assert r["grad_norm"] == pytest.approx(r["ref_norm"], rel=1e-5), (case, rank)
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5), (case, rank)
        assert r["delta_rel_err"] < UPDATE_TOL, (case, rank, r)
    if case == "ep2":  # DP = 2 over EP: 5 + 3 rows (rank 1 runs a blank micro-batch to match rank 0's count)
        assert [res[case]["rows"] for res in parity] == [5, 3]


@pytest.mark.slow
def test_non_finite_loss_skips_update(parity):
    for res in parity:
        r = res["tp2_skip"]
        assert r["skipped"] == 1.0 and r["unchanged"] and r["next_skipped"] == 0.0


@pytest.mark.slow
def test_state_dict_round_trip(parity):
    for res in parity:
        r = res["tp2_state"]
        assert r["moved"] and r["restored"] and r["refused_other_layout"]


@pytest.fixture(scope="module")
def loop_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("policy_loop")
    run_torchrun(WORKERS / "policy_loop_worker.py", nproc=2, out_dir=out)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "ep2"])
def test_two_loop_steps_on_megatron_policy(loop_runs, layout):
    runs = [res[layout] for res in loop_runs]
    for run in runs:
        assert len(run["metrics"]) == 2 and run["finite"]
        last = run["metrics"][-1]
        assert last["counters/rollout_steps"] == 2.0
        assert last["counters/optimizer_steps"] >= 1.0 and last["counters/skipped_updates"] == 0.0
        assert run["params_changed"] == run["params"] > 0  # AdamW touched every local parameter
    assert [run["dp"] for run in runs] == ([1, 1] if layout == "tp2" else [2, 2])

    def untimed(m):
        return {k: v for k, v in m.items() if not k.startswith(("timing/", "perf/"))}

    # TP ranks hold one replica and DP ranks share every reduced number: the logs agree everywhere
    assert [untimed(m) for m in runs[0]["metrics"]] == [untimed(m) for m in runs[1]["metrics"]]
