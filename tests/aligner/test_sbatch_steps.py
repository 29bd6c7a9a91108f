"""containers/dapo.sbatch, step by step, with a stand-in ``srun`` (bash, on PATH) that records each call and plays
the step: CPUs per task on every step, CUDA_DEVICE_MAX_CONNECTIONS in the trainer's step only, a Ray cluster per
engine server, a health wait that ends at once when a server dies, an engine death during training that stops the
job, and the checkpoint view's copied model_config.yaml. The contract: /tmp/notes-free, see the script's header."""
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "containers" / "dapo.sbatch"

# ENGINE_MODE: up (a server stays up), die (every server exits 1 at once), late_die (exits 1 once the trainer's srun
# has recorded its call: a fixed delay raced the trainer's start on a loaded machine)
SRUN = r"""#!/bin/bash
exec 9>"$SRUN_DIR/lock"; flock 9
n=$(ls "$SRUN_DIR" | grep -c '^call' || true)
for a in "$@"; do printf "%s\0" "$a"; done > "$SRUN_DIR/call$n"
echo "CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS-unset}" > "$SRUN_DIR/env$n"
flock -u 9; exec 9>&-
case "$*" in
  *nemo_dapo.cluster.engine_options*) printf '{\n "engine": "trtllm",\n "engine_gpus": %s,\n "options": {}\n}\n' \
      "${ENGINE_GPUS:-8}" > "$RESULTS/engine_options.json" ;;
  *nemo_dapo.engines.server*) case "${ENGINE_MODE:-up}" in die) exit 1 ;; late_die) until [ -e "$SRUN_DIR/trainer_up" ]; do sleep 0.1; done; exit 1 ;; esac
                              exec sleep 300 ;;
  *nemo_dapo.engines.health*) if [ "${ENGINE_MODE:-up}" = die ]; then exec sleep 300; fi ;;  # its full wait
  *train_gpt_dapo.py*) touch "$SRUN_DIR/trainer_up"; [ "${ENGINE_MODE:-up}" = late_die ] && exec sleep 60; exit 0 ;;
esac
"""


@pytest.fixture
def srun_bin(tmp_path):
    b = tmp_path / "bin"
    b.mkdir()
    (b / "srun").write_text(SRUN)
    (b / "srun").chmod(0o755)
    return b


def run(srun_bin, tmp_path, timeout=60, **env_over):
    calls = tmp_path / "calls"
    calls.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    env.update(PATH=f"{srun_bin}:{os.environ['PATH']}", SRUN_DIR=str(calls), SLURM_JOB_NUM_NODES="2",
               SLURM_JOB_ID="91", SLURM_CPUS_ON_NODE="128", CONTAINER="t.sqsh", ENGINE_CONTAINER="e.sqsh",
               CHECKPOINT="/ckpt/m.nemo", TOKENIZER="/hf/tok", HF_MODEL="/hf/model", TRAIN_DATA="/d/train.parquet",
               VAL_DATA="/d/val.parquet", RESULTS=str(tmp_path / "results"))
    env.update(env_over)
    t0 = time.monotonic()
    out = subprocess.run(["bash", str(SBATCH)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    n = len(list(calls.glob("call*")))
    argv = [(calls / f"call{i}").read_text().split("\0")[:-1] for i in range(n)]
    envs = [(calls / f"env{i}").read_text().split() for i in range(n)]
    return out, argv, envs, time.monotonic() - t0


def kind(call):
    cmd = call[-1]
    for k, marker in (("options", "cluster.engine_options"), ("server", "engines.server"), ("health", "engines.health"),
                      ("trainer", "train_gpt_dapo.py")):
        if marker in cmd:
            return k
    return "?"


def cpus(call):
    return int(next(a for a in call if a.startswith("--cpus-per-task=")).split("=", 1)[1])


def test_every_step_gets_cpus_per_task_from_the_node_and_overrides(srun_bin, tmp_path):
    out, calls, _, _ = run(srun_bin, tmp_path)
    assert out.returncode == 0, out.stderr
    got = {kind(c): cpus(c) for c in calls}
    # 128 CPUs, colocated: the 8 trainer ranks share half (8 each), the one TP8 engine server the other half
    assert got == {"options": 2, "server": 64, "health": 1, "trainer": 8}
    sub = tmp_path / "four"
    sub.mkdir()
    out, calls, _, _ = run(srun_bin, sub, ENGINE_GPUS="2", CPUS_PER_TRAINER_TASK="3")
    got = {kind(c): cpus(c) for c in calls}
    assert got["server"] == 16 and got["trainer"] == 3  # four servers per node share the engines' 64


def test_both_steps_ask_slurm_to_end_the_step_when_one_task_fails(srun_bin, tmp_path):
    """Slurm's --kill-on-bad-exit=1 on both steps (tests/containers/standin_srun.py plays its semantics end to end):
    a trainer rank that fails alone would leave the others in an NCCL collective for the watchdog's 30 minutes."""
    out, calls, _, _ = run(srun_bin, tmp_path)
    assert out.returncode == 0, out.stderr
    for step in ("server", "trainer"):
        assert "--kill-on-bad-exit=1" in next(c for c in calls if kind(c) == step), step


def test_cuda_device_max_connections_only_in_the_trainer_step(srun_bin, tmp_path):
    out, calls, envs, _ = run(srun_bin, tmp_path, CUDA_DEVICE_MAX_CONNECTIONS="1")  # even if the submitter set it
    assert out.returncode == 0, out.stderr
    server = next(c for c in calls if kind(c) == "server")
    trainer = next(c for c in calls if kind(c) == "trainer")
    assert "unset CUDA_DEVICE_MAX_CONNECTIONS" in server[-1]
    export = "export CUDA_DEVICE_MAX_CONNECTIONS=1;"
    assert export in trainer[-1] and trainer[-1].index(export) < trainer[-1].index("python -u")
    res = subprocess.run(["bash", "-c", server[-1].replace("exec python", "env | grep -c CUDA_DEVICE_MAX || true #")],
                         env=dict(os.environ, SLURM_LOCALID="0", CUDA_DEVICE_MAX_CONNECTIONS="1"),
                         capture_output=True, text=True)
    assert res.stdout.strip() == "0"  # the engine command really drops it


def test_each_engine_server_starts_its_own_ray_cluster(srun_bin, tmp_path):
    _, calls, _, _ = run(srun_bin, tmp_path, ENGINE_GPUS="4")
    server = next(c for c in calls if kind(c) == "server")
    assert "--ntasks-per-node=2" in server and "--kill-on-bad-exit=1" in server
    seen = []
    for local in ("0", "1"):  # the two servers of one node, as srun would run them
        cmd = server[-1].replace("exec python", "echo $TLLM_RAY_FORCE_LOCAL_CLUSTER $RAY_TMPDIR $CUDA_VISIBLE_DEVICES #")
        res = subprocess.run(["bash", "-c", cmd], env=dict(os.environ, SLURM_LOCALID=local), capture_output=True,
                             text=True, check=True)
        seen.append(res.stdout.split())
    assert seen == [["1", "/tmp/ray-91-0", "0,1,2,3"], ["1", "/tmp/ray-91-1", "4,5,6,7"]]


def test_health_wait_ends_at_once_when_a_server_dies(srun_bin, tmp_path):
    out, calls, _, took = run(srun_bin, tmp_path, ENGINE_MODE="die", ENGINE_STARTUP_S="1800")
    assert out.returncode == 3 and "an engine server exited during start-up" in out.stderr
    assert took < 20  # not the probe's 1,800 s (nor the stand-in probe's 300 s)
    assert "trainer" not in [kind(c) for c in calls]


def test_an_engine_death_during_training_stops_the_trainer(srun_bin, tmp_path):
    out, calls, _, took = run(srun_bin, tmp_path, ENGINE_MODE="late_die")
    assert out.returncode == 3 and "exited during training" in out.stderr and took < 30
    assert sorted(kind(c) for c in calls) == ["health", "options", "server", "trainer"]  # server/probe: concurrent


def test_checkpoint_view_copies_model_config_and_links_the_rest(srun_bin, tmp_path):
    ckpt = tmp_path / "ckpt"
    (ckpt / "weights").mkdir(parents=True)
    (ckpt / "model_config.yaml").write_text("hidden_size: 8\n")
    (ckpt / "model_config.yaml").chmod(0o444)
    view = tmp_path / "results" / "checkpoint_view"
    view.mkdir(parents=True)
    os.symlink(ckpt / "model_config.yaml", view / "model_config.yaml")  # what an older script left
    out, *_ = run(srun_bin, tmp_path, CHECKPOINT=str(ckpt))
    assert out.returncode == 0, out.stderr
    cfg = view / "model_config.yaml"
    assert not cfg.is_symlink() and cfg.read_text() == "hidden_size: 8\n"
    cfg.chmod(0o644)
    cfg.write_text("hidden_size: 8\nwritten: by NeMo-Aligner\n")  # the write that failed through the link
    assert (ckpt / "model_config.yaml").read_text() == "hidden_size: 8\n"
    assert (view / "weights").is_symlink()


def test_engine_step_command_is_plain_bash_with_srun_by_name(srun_bin, tmp_path):
    """The script calls srun from PATH and hands each step a `bash -c` string (what a local stand-in runs)."""
    text = SBATCH.read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))  # comments may name it
    assert "enroot" not in code
    _, calls, _, _ = run(srun_bin, tmp_path)
    for c in calls:
        assert c[-3:-1] == ["bash", "-c"], c[:3]
        shlex.split(c[-1])  # a well-formed command line
    assert sys.executable  # (the stand-in needs no Python)
