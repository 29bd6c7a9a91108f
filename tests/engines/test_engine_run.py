"""The CPU job with rollouts through the local engine server: weights reach the engine every step, and an engine
killed mid-run ends the run with a clear error and a checkpoint that the next run resumes from."""
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from nemo_dapo.core.types import RolloutBatch
from nemo_dapo.local.run_log import read_metrics
from tests.local.test_run import TINY, base_dir, tiny_cfg  # noqa: F401 - base_dir is a fixture

pytestmark = pytest.mark.slow
ENGINE = ["rollout.engine=local", "rollout.streaming=true", "algorithm.dynamic_sampling.enabled=true",
          "algorithm.dynamic_sampling.max_gen_batches=2"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VLLM_PYTHON = os.environ.get("NEMO_DAPO_VLLM_PYTHON", os.path.join(ROOT, ".venv-vllm", "bin", "python"))
# vLLM's CPU attention needs head_dim 32: one head of the toy model's 32 dims
HEAD_DIM_32 = ["model.num_attention_heads=1", "model.num_key_value_heads=1"]
ENGINES = {
    "local": ["rollout.engine=local"],
    "vllm": HEAD_DIM_32 + ["rollout.engine=vllm", f"rollout.server.python={VLLM_PYTHON}"],
}
GLOO = ["rollout.server.weight_transport=gloo"]
ENGINES.update({f"{k}/gloo": v + GLOO for k, v in list(ENGINES.items())})  # the collective transport


@pytest.fixture(scope="module")
def base_dir_hd32(tmp_path_factory):
    from nemo_dapo.local.run_model import BASE_DIR, prepare_base_model

    run_dir = str(tmp_path_factory.mktemp("base32"))
    prepare_base_model(tiny_cfg(run_dir, *HEAD_DIM_32))
    return os.path.join(run_dir, BASE_DIR)


def _engine_vs_trainer(run, seed: int) -> tuple:
    """Sample a completion from the engine; return (engine log-probs, trainer log-probs) of its tokens [B, R]."""
    ids, mask = run.train_set.collate([0, 1, 2])
    out = run.sampler.generate(ids, mask, max_new_tokens=8, temperature=1.0, seed=seed)
    batch = RolloutBatch(prompt_ids=ids, prompt_mask=mask, response_ids=out.response_ids,
                         response_mask=out.response_mask, group_ids=torch.arange(3), truncated=out.truncated)
    trainer, _ = run.policy.logprobs(batch)
    return out.logprobs, trainer, batch


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_engine_weights_follow_the_trainer_every_step(tmp_path, base_dir, base_dir_hd32, engine):  # noqa: F811
    from nemo_dapo.local.run import LocalRun

    if engine.startswith("vllm") and not os.path.exists(VLLM_PYTHON):
        pytest.skip(f"no vLLM engine venv at {VLLM_PYTHON} (bash scripts/install.sh .venv-vllm engine-vllm)")
    # Dynamic sampling off, so every step trains and refits. The toy base's rewards are nearly all equal (its
    # advantages ~0), so each step's weight change is forced by perturbing the weights before it: the engine must
    # show them after the step, which only the loop's refit can bring about.
    base = base_dir_hd32 if engine.startswith("vllm") else base_dir
    cfg = tiny_cfg(str(tmp_path), f"model.path={base}", *ENGINE, *ENGINES[engine],
                   "algorithm.dynamic_sampling.enabled=false")
    run = LocalRun(cfg)
    try:
        engine_lp, trainer_lp, batch = _engine_vs_trainer(run, seed=1)
        valid = batch.response_mask > 0
        assert (engine_lp - trainer_lp)[valid].abs().max() < 1e-4  # same weights, same numerics (fp32)
        for k in range(2):
            with torch.no_grad():
                for p in run.model.parameters():
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(k)) * 0.05)
            m = run.loop.step()
            assert m.get("actor/updates", 0) > 0, "the step must train, or this test proves nothing"
            stale, _ = run.policy.logprobs(batch)  # the trainer's NEW log-probs of the OLD completion ...
            assert (stale - trainer_lp)[valid].abs().max() > 1e-3  # ... moved: the weights changed
            engine_lp, trainer_lp, batch = _engine_vs_trainer(run, seed=1)
            valid = batch.response_mask > 0
            assert (engine_lp - trainer_lp)[valid].abs().max() < 1e-4  # the engine has the new weights
        assert run.sampler.last_update["tensors"] == len(run.model.state_dict())
        assert run.sampler.last_update.get("transport", "shm") == ("group" if "gloo" in engine else "shm")
        if "gloo" in engine:  # vLLM's worker receives the broadcast itself (collective_rpc), the local server does
            assert run.sampler.client.health()["weight_group"] == {
                "local/gloo": "joined", "vllm/gloo": "joined (in the engine's workers)"}[engine]
    finally:
        run.close()


def _train_cmd(run_dir, base, steps, *extra):
    return [sys.executable, "-m", "nemo_dapo.cli", "train", *TINY, f"run_dir={run_dir}", f"model.path={base}",
            *ENGINE, f"trainer.max_steps={steps}", "rollout.server.request_timeout_s=30", *extra]


OVERLAP = ["rollout.on_filler_full=suspend", "algorithm.tis_cap=2.0", "rollout.overlap=true"]


@pytest.mark.parametrize("mode", [[], GLOO, OVERLAP], ids=["shm", "gloo", "overlap"])
def test_engine_killed_mid_run_gives_a_clear_error_and_a_resumable_checkpoint(tmp_path, base_dir,  # noqa: F811
                                                                               mode):
    run_dir = str(tmp_path / "run")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(_train_cmd(run_dir, base_dir, 10_000, *mode), stderr=subprocess.PIPE, text=True,
                            env=env)
    engine_pid, lines = None, []
    for line in proc.stderr:
        lines.append(line)
        found = re.search(r"started engine local \(pid (\d+)\)", line)
        engine_pid = int(found.group(1)) if found else engine_pid
        if engine_pid and re.search(r"step [3-9]/", line):
            break
    assert engine_pid, "".join(lines)
    os.kill(engine_pid, signal.SIGKILL)
    rest = proc.stderr.read()
    assert proc.wait(timeout=60) == 4, rest
    assert "rollout engine error" in rest and "engine 'local'" in rest and "rerun the same command" in rest, rest
    done = max(r["step"] for r in read_metrics(run_dir, "train"))
    assert os.path.isfile(os.path.join(run_dir, "checkpoints", f"step_{done:08d}.pt"))
    # The same command with a live engine resumes after the last finished step.
    again = subprocess.run(_train_cmd(run_dir, base_dir, done + 1, *mode), capture_output=True, text=True,
                           env=env, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"rollout step {done})" in again.stderr and "resumed from" in again.stderr
    last = read_metrics(run_dir, "train")[-1]
    assert last["step"] == done + 1
    assert 0.0 <= last["timing/engine_idle_s"] <= last["timing/step_s"]  # the engine's idle time is logged
