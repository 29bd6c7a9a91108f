"""The DAPO trainer end to end on CPU with the real NeMo / NeMo-Aligner stack (2 data-parallel ranks, gloo).

Run 1 trains two rollout steps (debug sampler, rule-based reward, dynamic sampling, validation and a checkpoint
after every step). Run 2 is a fresh launch resumed from run 1's step-1 checkpoint; it must continue with exactly the
metrics run 1 logged for step 2 (training and validation), which needs the optimizer and LR schedule, the prompt
sampler position and the dynamic-sampling filler's carried groups all restored from the checkpoint.

Run 3 resumes from run 1's step-1 checkpoint too and hits the run's time limit after the first generation batch of
step 2: the trainer saves that partial step (the groups generated so far travel in the checkpoint) and stops; run 4
resumes from it and trains step 2 exactly as run 1 did.

The last test repeats runs 1 and 2 with the MoE recipes' optimizer, megatron-core's distributed Adam.
"""
import json

import pytest
import torch

from tests.aligner.conftest import needs_nemo
from tests.support.dist import ROOT, run_torchrun

pytestmark = [needs_nemo, pytest.mark.nemo, pytest.mark.slow]
WORKER = ROOT / "tests/aligner/workers/trainer_worker.py"
VOLATILE = ("timing/", "timers/", "perf/", "val/seconds")  # wall-clock numbers differ between runs


def _records(path, step):
    return [r for r in json.loads(path.read_text())["records"] if r.get("step") == step]


def _stable(record):
    return {k: v for k, v in record.items() if not k.startswith(VOLATILE)}


def _checkpoints(run_dir):
    return sorted(p for p in (run_dir / "run/checkpoints").iterdir()
                  if p.is_dir() and not p.name.endswith(("unfinished", "-last")))


@pytest.fixture(scope="module")
def full_run(tok_dir, tmp_path_factory):
    full = tmp_path_factory.mktemp("full")
    run_torchrun(WORKER, nproc=2, out_dir=full, env={"TOK_DIR": tok_dir, "PHASE": "full", "MAX_STEPS": "2"})
    return full


def test_two_steps_save_resume_identical(full_run, tok_dir, tmp_path):
    full, resumed = full_run, tmp_path / "resumed"
    resumed.mkdir()
    ckpts = _checkpoints(full)
    assert [p.name.split("-")[1] for p in ckpts] == ["step=1", "step=2"], ckpts
    # the trainer state travels inside the checkpoint (common state), not in its file name
    from nemo_dapo.aligner.compat import CHECKPOINT_KEY, unpack_state

    common = torch.load(ckpts[0] / "common.pt", map_location="cpu", weights_only=False)
    saved = unpack_state(common[CHECKPOINT_KEY])
    assert saved["step"] == 1 and saved["loop"]["counters"]["rollout_steps"] == 1
    assert saved["loop"]["filler"]["groups"], "step 1 should carry surplus groups over (see the worker's settings)"
    assert {"generate", "update"} <= set(saved["time_budget"]) and min(saved["time_budget"].values()) > 0

    run_torchrun(WORKER, nproc=2, out_dir=resumed,
                 env={"TOK_DIR": tok_dir, "PHASE": "resume", "MAX_STEPS": "2", "RESUME_FROM": str(ckpts[0])})

    for rank in (0, 1):
        a, b = full / f"full_rank{rank}.json", resumed / f"resume_rank{rank}.json"
        assert json.loads(a.read_text())["start_step"] == 0 and json.loads(b.read_text())["start_step"] == 1
        # NeMo's checkpoint IO writes in the rank's process (the worker forbids os.fork during fit)
        assert json.loads(a.read_text())["checkpoint_writer"] == "InProcessTorchDistSave"
        assert json.loads(a.read_text())["writer_cases"] == {  # NeMo's other settings: kept, or wrapped as NeMo does
            "async": "kept: async_save=True, format torch_dist", "zarr": "kept: async_save=False, format zarr",
            "parallel": "FullyParallelSaveStrategyWrapper(InProcessTorchDistSave)", "parallel_threads": 3,
            "torch": "kept: checkpoint IO NoneType"}
        assert json.loads(a.read_text())["decoder_problems"] == []  # NeMo's AutoTokenizer: fast path, same texts
        step2_full, step2_resumed = _records(a, 2), _records(b, 2)
        assert len(step2_full) == 2 and len(step2_resumed) == 2  # training + validation records
        for x, y in zip(step2_full, step2_resumed):
            assert _stable(x) == _stable(y)
        train1, train2 = _records(a, 1)[0], step2_full[0]
        # step 2 both drew new prompts and trained on a group carried over from step 1 (through the checkpoint)
        assert train2["filter/carried_in"] > 0 and train2["filter/num_gen_batches"] >= 1
        # counters: consumed_samples counts prompts drawn (responses = prompts x group_size), 2 updates per step
        state = json.loads(b.read_text())["state"]
        assert state["consumed_samples"] * 4 == train2["counters/consumed_samples"]
        assert state["dapo_optimization_step"] == 4 and state["step"] == 2
        # training really happened: gradients, a warming-up LR schedule, mixed rewards, validation
        assert train1["actor/grad_norm"] > 0 and train2["actor/lr"] > train1["actor/lr"]
        assert 0 < train1["train/batch_acc"] < 1
        assert "val/accuracy" in step2_full[1]
        assert step2_full[1]["val/generations"] == 6 * 2  # 6 validation problems x n_samples=2
    # both data-parallel ranks log the same (globally reduced) metrics
    assert [_stable(r) for r in _records(full / "full_rank0.json", 2)] == \
        [_stable(r) for r in _records(full / "full_rank1.json", 2)]


def test_time_limit_inside_a_step_saves_the_partial_step_and_resume_finishes_it(full_run, tok_dir, tmp_path):
    from nemo_dapo.aligner.compat import CHECKPOINT_KEY, unpack_state

    def state(path):
        return unpack_state(torch.load(path / "common.pt", map_location="cpu", weights_only=False)[CHECKPOINT_KEY])

    cut, resumed = tmp_path / "deadline", tmp_path / "resumed"
    cut.mkdir(), resumed.mkdir()
    step1 = _checkpoints(full_run)[0]  # step 1 as run 1 saved it: run 3 starts there (no warm-up, no step 1 again)
    run_torchrun(WORKER, nproc=2, out_dir=cut,
                 env={"TOK_DIR": tok_dir, "PHASE": "deadline", "MAX_STEPS": "2", "RESUME_FROM": str(step1)})
    out = json.loads((cut / "deadline_rank0.json").read_text())
    assert out["start_step"] == 1 and out["state"]["step"] == 1, "the run must stop inside step 2"
    ckpts = _checkpoints(cut)
    assert [p.name.split("-")[1] for p in ckpts] == ["step=1"], ckpts  # saved mid-step 2
    after, partial = state(step1), state(ckpts[0])
    assert partial["loop"]["counters"]["rollout_steps"] == 1
    assert partial["loop"]["counters"]["gen_batches"] == after["loop"]["counters"]["gen_batches"] + 1
    assert partial["loop"]["filler"]["groups"], "the partial step's groups travel in the checkpoint"
    assert not _records(cut / "deadline_rank0.json", 2)  # step 2 was neither logged nor validated

    run_torchrun(WORKER, nproc=2, out_dir=resumed,
                 env={"TOK_DIR": tok_dir, "PHASE": "resume", "MAX_STEPS": "2", "RESUME_FROM": str(ckpts[0])})
    for rank in (0, 1):
        a = json.loads((full_run / f"full_rank{rank}.json").read_text())
        b = json.loads((resumed / f"resume_rank{rank}.json").read_text())
        assert b["counters"] == a["counters"] and b["state"] == a["state"]
        x, y = _records(full_run / f"full_rank{rank}.json", 2), _records(resumed / f"resume_rank{rank}.json", 2)
        assert len(x) == len(y) == 2
        # the update and validation of step 2 are those of the uninterrupted run; the generation statistics of the
        # resumed step only cover the batches generated after the restart
        same = ("actor/", "counters/", "train/batch_", "val/accuracy", "val/pass_at_n")
        assert {k: v for k, v in x[0].items() if k.startswith(same)} == \
            {k: v for k, v in y[0].items() if k.startswith(same)}
        assert x[1]["val/accuracy"] == y[1]["val/accuracy"]


def test_megatron_distributed_optimizer_saves_and_resumes_exactly(tok_dir, tmp_path):
    """The MoE recipes' optimizer (``mcore_distributed_optim``: megatron-core's DDP and distributed Adam, sharded
    over DP) through NeMo's checkpoint IO and the trainer: run 2 steps, resume a fresh launch from step 1's
    checkpoint, and step 2 is the same, Adam's moments and step count included."""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    full.mkdir(), resumed.mkdir()
    env = {"TOK_DIR": tok_dir, "MAX_STEPS": "2", "OPTIM": "mcore"}
    run_torchrun(WORKER, nproc=2, out_dir=full, env=dict(env, PHASE="run"))
    ckpts = _checkpoints(full)
    assert [p.name.split("-")[1] for p in ckpts] == ["step=1", "step=2"], ckpts
    run_torchrun(WORKER, nproc=2, out_dir=resumed, env=dict(env, PHASE="resume", RESUME_FROM=str(ckpts[0])))
    for rank in (0, 1):
        a, b = full / f"run_rank{rank}.json", resumed / f"resume_rank{rank}.json"
        assert json.loads(b.read_text())["start_step"] == 1
        step1, step2, again = _records(a, 1), _records(a, 2), _records(b, 2)
        # megatron's own norm, read before its step (step/megatron_grad_norm)
        assert step1[0]["actor/grad_norm"] > 0 and step1[0]["actor/skipped"] == 0
        assert len(step2) == len(again) == 2 and [_stable(r) for r in step2] == [_stable(r) for r in again]
