"""``containers/dapo.sbatch`` itself, run end to end on one CPU machine with stand-ins for srun and enroot.

The stand-ins (``tests/containers/bin/``) execute every step locally: a one-node allocation with 2 "GPUs"; the
trainer and engine images are the checkout copied as the Dockerfiles copy it (plus the test recipe,
``tests/containers/conf/tiny_cpu_sbatch.yaml``), their Python the full CPU stack with the NeMo CPU patches of
``tests/support/nemo_cpu.py`` in the trainer image. Inputs (``prepare_inputs.py``): a tiny NeMo checkpoint directory
as ``nemo-dapo convert`` writes it, its tokenizer, the CPU task's prompts, a random Hugging Face model for the
engines.

One job: the engine-options step, two ``local`` engine servers on the node, the health wait, the real trainer
(``examples/train_gpt_dapo.py``: NeMo-Aligner on CPU, TP=2 over gloo) for 3 rollout steps, teardown. Then the same
command with the step budget raised to 4: it must resume from the step-3 checkpoint and train step 4 only.
The records show the mounts, the environment each process got (``CUDA_DEVICE_MAX_CONNECTIONS`` only in the trainer,
the engine authkey in the environment and never on a command line), ``--cpus-per-task`` on every step, and two
engines on one node with their own addresses and Ray clusters. A second job kills one engine server during the
health wait: the script must stop within seconds, not wait out ``ENGINE_STARTUP_S``.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.aligner.conftest import needs_nemo
from tests.containers import harness as h
from tests.support.dist import ROOT, free_port

pytestmark = [needs_nemo, pytest.mark.nemo, pytest.mark.slow]
# the job's overrides: the base config's optimizer keys (betas, bucket_cap_mb, ...) are apex Adam's; NeMo passes an
# optimizer every key of model.optim unless model.optim.args is given, and torch SGD takes none of them. The
# converted checkpoint (prepare_inputs.py) lacks NeMo's use_cpu_initialization, without which NeMo selects a CUDA
# device: the one CPU-only key.
OVERRIDES = ("+model.optim.args={weight_decay: 0.0}", "+model.use_cpu_initialization=True")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    out = tmp_path_factory.mktemp("inputs")
    proc = subprocess.run([sys.executable, str(h.HERE / "prepare_inputs.py"), str(out)], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "inputs.json").read_text())


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    return h.script_for(tmp_path_factory.mktemp("script"))


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return h.build_images(tmp_path_factory.mktemp("images"), sys.executable, sys.executable)


def _read_only_inputs(inputs: dict) -> dict:
    return {k: h.tree_snapshot(inputs[k] if k in ("checkpoint", "tokenizer", "hf_model") else
                               os.path.dirname(inputs[k])) for k in ("checkpoint", "tokenizer", "hf_model", "train")}


def _checkpoints(results) -> dict:
    """{step: trainer state} of every finished checkpoint under RESULTS/checkpoints."""
    from nemo_dapo.aligner.compat import CHECKPOINT_KEY, unpack_state

    out = {}
    for p in sorted((results / "checkpoints").iterdir()):
        if p.is_dir() and not p.name.endswith(("unfinished", "-last")):
            state = unpack_state(torch.load(p / "common.pt", map_location="cpu", weights_only=False)[CHECKPOINT_KEY])
            out[state["step"]] = dict(state, path=str(p), mtime=p.stat().st_mtime_ns)
    return out


def _run_job(script, inputs, images, run_dir, job_id, *overrides, **env):
    watcher = h.Watcher()
    records = run_dir / "records"
    job = h.job_env(inputs, images, run_dir / "results", records, job_id, **env)
    watcher.start()

    def find_key():  # the script makes the key; the first task records it
        for p in records.glob("step*.task*.json"):
            key = json.loads(p.read_text())["env"].get("NEMO_DAPO_ENGINE_AUTHKEY")
            if key:
                return key
        return None

    proc = subprocess.Popen(["bash", str(script), *overrides], cwd=ROOT, env=job, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        watcher.needle = h.wait_for(lambda: find_key() or (proc.poll() is not None and "none"), timeout=300)
        out, err = proc.communicate(timeout=1200)
    finally:
        if proc.poll() is None:
            proc.kill()
        watcher.stop()
        h.clean_job(job_id)
    return proc.returncode, out, err, h.Records(records), watcher


@pytest.fixture(scope="module")
def first_job(script, inputs, images, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("job1")
    before = _read_only_inputs(inputs)
    started = time.time()
    rc, out, err, rec, watcher = _run_job(script, inputs, images, run_dir, h.new_job_id(), *OVERRIDES)
    assert rc == 0, f"sbatch failed ({rc}):\n{err[-3000:]}\n{_logs(run_dir / 'results')}"
    return dict(run_dir=run_dir, results=run_dir / "results", rec=rec, watcher=watcher, before=before,
                seconds=time.time() - started, ckpts=_checkpoints(run_dir / "results"))


def _logs(results) -> str:
    parts = []
    for p in sorted(results.rglob("*.err")):
        parts.append(f"--- {p.name}\n{p.read_text()[-2500:]}")
    return "\n".join(parts)


def _assert_step_kinds(rec) -> None:
    """options, then the servers and the health wait (both started in the background, so the stand-in may number
    either first), then the trainer."""
    kinds = rec.kinds()
    assert kinds[0] == "options" and sorted(kinds[1:3]) == ["health", "server"] and kinds[3:] == ["trainer"], kinds


def _option(step: dict, name: str):
    return step["options"].get(name)


def test_the_job_runs_its_steps_in_order_on_one_node(first_job):
    rec = first_job["rec"]
    _assert_step_kinds(rec)
    for i, step in enumerate(rec.steps):
        assert _option(step, "--cpus-per-task") and int(_option(step, "--cpus-per-task")) >= 1, (rec.kind(i), step)
        assert _option(step, "--no-container-mount-home"), rec.kind(i)
        for task in rec.tasks(i):
            assert task["env"]["SLURM_CPUS_PER_TASK"] == _option(step, "--cpus-per-task")
    server, trainer = rec.steps[rec.step_of("server")], rec.steps[rec.step_of("trainer")]
    assert server["ntasks"] == 2 and trainer["ntasks"] == 2  # two engines and two ranks on the one node
    assert _option(trainer, "--mpi") == "pmix"


def test_mounts_and_read_only_inputs(first_job, inputs):
    rec, results = first_job["rec"], str(first_job["results"])

    def mounts(kind):
        return {(m["container"], m["host"], m["ro"]) for m in rec.tasks(rec.step_of(kind))[0]["mounts"]}

    hf_dir = os.path.dirname(inputs["hf_model"])
    assert mounts("options") == {("/results", results, False)}
    assert mounts("server") == {(hf_dir, hf_dir, True), ("/tmp", "/tmp", False), ("/results", results, True)}
    assert mounts("health") == {("/tmp", "/tmp", False)}
    data = os.path.dirname(inputs["train"])
    assert mounts("trainer") == {(inputs["checkpoint"], inputs["checkpoint"], True), (data, data, True),
                                 ("/tokenizer", inputs["tokenizer"], True), ("/results", results, False),
                                 (hf_dir, hf_dir, True), ("/tmp", "/tmp", False)}
    # nothing wrote into a read-only input (NeMo-Aligner writes model_config.yaml into the checkpoint it restores:
    # the script's checkpoint view must hold a copy of it, not a link to the original)
    assert _read_only_inputs(inputs) == first_job["before"]
    view = first_job["results"] / "checkpoint_view"
    assert (view / "model_weights").is_symlink() and not (view / "model_config.yaml").is_symlink()
    trainer_cmd = rec.steps[rec.step_of("trainer")]["command"][-1]
    assert "pretrained_checkpoint.restore_from_path=/results/checkpoint_view" in trainer_cmd
    assert "++model.tokenizer.type=/tokenizer" in trainer_cmd


def test_environment_of_each_process(first_job):
    rec, watcher = first_job["rec"], first_job["watcher"]
    servers, trainers = rec.python("nemo_dapo.engines.server"), rec.python("train_gpt_dapo.py")
    others = rec.python("nemo_dapo.cluster.engine_options") + rec.python("nemo_dapo.engines.health")
    assert len(servers) == 2 and len(trainers) == 2 and len(others) == 2
    key = trainers[0]["env"]["NEMO_DAPO_ENGINE_AUTHKEY"]
    assert len(key) >= 32 and watcher.needle == key
    for p in servers + trainers + rec.python("nemo_dapo.engines.health"):
        assert p["env"]["NEMO_DAPO_ENGINE_AUTHKEY"] == key
    # the key is in environments only: never in an argument of a step, a container command or any process seen
    # while the job ran (all of /proc, sampled every 0.2 s)
    argvs = [s["argv"] for s in rec.steps] + [t["command"] for i in range(len(rec.steps)) for t in rec.tasks(i)]
    argvs += [p["argv"] for p in rec.procs]
    assert not [a for a in argvs if any(key in x for x in a)]
    assert watcher.samples > 10 and watcher.hits == []
    # CUDA_DEVICE_MAX_CONNECTIONS=1 serialises CUDA streams: the trainer's Megatron needs it, the engines must not
    # get it (TensorRT-LLM's streams would be serialised)
    assert [p["env"].get("CUDA_DEVICE_MAX_CONNECTIONS") for p in trainers] == ["1", "1"]
    assert all("CUDA_DEVICE_MAX_CONNECTIONS" not in p["env"] for p in servers + others)
    assert [p["env"]["SLURM_PROCID"] for p in trainers] == ["0", "1"]


def test_two_engines_on_one_node_each_with_its_own_address_and_ray_cluster(first_job):
    rec = first_job["rec"]
    servers = rec.python("nemo_dapo.engines.server")
    addresses = [p["argv"][p["argv"].index("--address") + 1] for p in servers]
    job = servers[0]["env"]["SLURM_JOB_ID"]
    assert addresses == [f"unix:/tmp/nemo-dapo-{job}/engine-{i}.sock" for i in (0, 1)]
    assert [p["env"]["SLURM_LOCALID"] for p in servers] == ["0", "1"]
    assert [p["env"]["CUDA_VISIBLE_DEVICES"] for p in servers] == ["0", "1"]
    # each server its own Ray cluster: TensorRT-LLM's ray.init(address="auto") would otherwise join the other's
    assert all(p["env"].get("TLLM_RAY_FORCE_LOCAL_CLUSTER") == "1" for p in servers)
    assert len({p["env"].get("RAY_TMPDIR") for p in servers}) == 2
    probe = rec.python("nemo_dapo.engines.health")[0]["argv"]
    assert [a for a in probe if a.startswith("unix:")] == addresses
    # the trainer's two ranks each own one engine (engine TP 1): both generated, through their own server
    for i in (0, 1):
        # (NeMo's exp_manager moves the files it finds in its log dir, RESULTS, into run_<n>/ at start-up)
        log = next(first_job["results"].rglob(f"engine_{job}_{i}.err")).read_text()
        assert "ready on " + addresses[i] in log


def test_three_rollout_steps_trained_and_checkpointed(first_job):
    ckpts = first_job["ckpts"]
    assert sorted(ckpts) == [1, 2, 3]
    for step, state in ckpts.items():  # 2 prompts x 4 responses trained per step, in 2 updates (batch 4)
        counters = state["loop"]["counters"]
        assert counters["rollout_steps"] == step and state["dapo_optimization_step"] == 2 * step
        # full batches of mixed-accuracy groups (dynamic sampling keeps only those) within the generation budget
        # (8 batches per step): the engines sampled "Answer: <right number>" now and then, which their random
        # Hugging Face weights cannot do, so the policy's weights reached the engines through the refit
        assert counters["trained_samples"] == 8 * step and counters["gen_batches"] < 8 * step
    assert ckpts[3]["consumed_samples"] > ckpts[2]["consumed_samples"] > ckpts[1]["consumed_samples"] > 0


def test_teardown_left_no_step_running(first_job):
    rec = first_job["rec"]
    pids = [s["pid"] for s in rec.steps] + [p["pid"] for p in rec.procs]
    assert pids and not [p for p in pids if h.alive(p)]


@pytest.fixture(scope="module")
def resumed_job(first_job, script, inputs, images):
    """The same command again with the step budget raised from 3 to 4 (same RESULTS)."""
    run_dir = first_job["run_dir"]
    records = run_dir / "records2"
    job = h.new_job_id()
    env = h.job_env(inputs, images, first_job["results"], records, job)
    try:
        out = subprocess.run(["bash", str(script), *OVERRIDES, "trainer.dapo.max_steps=4"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=1200)
    finally:
        h.clean_job(job)
    assert out.returncode == 0, f"{out.stderr[-3000:]}\n{_logs(first_job['results'])}"
    return dict(rec=h.Records(records), ckpts=_checkpoints(first_job["results"]))


def test_the_same_command_resumes_from_the_checkpoint(first_job, resumed_job):
    before, after = first_job["ckpts"], resumed_job["ckpts"]
    assert sorted(after) == [1, 2, 3, 4]
    for step in (1, 2, 3):  # no step was trained (or saved) again
        assert after[step]["mtime"] == before[step]["mtime"] and after[step]["path"] == before[step]["path"]
    # the counters continue from step 3's (a fresh start would have 1 step, 2 updates, 8 samples)
    last, new = before[3]["loop"]["counters"], after[4]["loop"]["counters"]
    assert new["rollout_steps"] == 4 and after[4]["dapo_optimization_step"] == 8
    assert new["trained_samples"] == last["trained_samples"] + 8
    assert new["gen_batches"] > last["gen_batches"] and after[4]["consumed_samples"] > before[3]["consumed_samples"]
    _assert_step_kinds(resumed_job["rec"])


def _task_running(records, needle: str, task: int):
    """The record of task ``task`` of the step whose command contains ``needle``, once it exists."""
    for path in records.glob(f"step*.task{task}.json"):
        record = json.loads(path.read_text())
        if needle in record["container_command"][-1]:
            return record
    return None


def test_health_wait_stops_at_once_when_a_server_dies(script, inputs, images, tmp_path):
    records = tmp_path / "records"
    job = h.new_job_id()
    env = h.job_env(inputs, images, tmp_path / "results", records, job, ENGINE_STARTUP_S="1800")
    proc = subprocess.Popen(["bash", str(script), *OVERRIDES], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        task = h.wait_for(lambda: _task_running(records, "nemo_dapo.engines.server", 1), timeout=120)
        assert task, "engine server 1 never started"
        assert h.wait_for(lambda: _task_running(records, "nemo_dapo.engines.server", 0), timeout=120), \
            "engine server 0 never started"  # its record too, before the kill (both are counted below)
        assert h.wait_for(lambda: _task_running(records, "nemo_dapo.engines.health", 0), timeout=120), \
            "the health probe never started"
        os.kill(task["pid"], signal.SIGKILL)  # engine server 1 dies while the script waits for health
        killed = time.time()
        _, err = proc.communicate(timeout=120)
        stopped = time.time() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
        h.clean_job(job)
    rec = h.Records(records)
    assert proc.returncode != 0 and stopped < 20, (proc.returncode, stopped, err[-2000:])
    assert sorted(rec.kinds()) == ["health", "options", "server"]  # no trainer was started
    assert "engine server exited" in err and "engine_*.err" in err  # the message points at the engine logs
    pids = [s["pid"] for s in rec.steps] + [t["pid"] for k in ("server", "health") for t in rec.tasks(rec.step_of(k))]
    assert len(pids) == 6 and not [p for p in pids if h.alive(p)]  # the other server and the probe were stopped


def test_engines_on_a_node_of_their_own(script, inputs, images, tmp_path):
    """ENGINE_NODES=1 of 2 nodes: the servers run on node 1 on TCP ports, the trainer (node 0; TP=1, so two
    data-parallel replicas, one engine each) gets their list and refits them over a gloo broadcast, with
    placement separate and sleep_level 0 passed to the options step and the trainer alike; partial rollouts with
    overlap (a round on the engines during each update) pass through the launcher's overrides."""
    port = free_port()
    overlap = ("trainer.dapo.rollout.on_filler_full=suspend", "model.dapo.algorithm.tis_cap=2.0",
               "trainer.dapo.rollout.overlap=true", "trainer.dapo.rollout.round_tokens=4")
    rc, out, err, rec, _ = _run_job(script, inputs, images, tmp_path, h.new_job_id(), *OVERRIDES, *overlap,
                                    "model.tensor_model_parallel_size=1", "trainer.dapo.max_steps=2",
                                    ENGINE_NODES="1", SLURM_JOB_NUM_NODES="2", SLURM_NNODES="2",
                                    SLURM_JOB_NODELIST="localhost,127.0.0.1", ENGINE_BASE_PORT=str(port))
    assert rc == 0, f"sbatch failed ({rc}):\n{err[-3000:]}\n{_logs(tmp_path / 'results')}"
    servers = rec.python("nemo_dapo.engines.server")
    assert [p["argv"][p["argv"].index("--address") + 1] for p in servers] == [f"tcp://0.0.0.0:{port + i}"
                                                                              for i in (0, 1)]
    assert {p["env"]["SLURM_NODEID"] for p in servers} == {"1"}
    # pyxis's RANK / LOCAL_RANK describe the engine step's tasks: the servers drop them, the trainer keeps its own
    assert not [k for p in servers for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR") if k in p["env"]]
    probe = rec.python("nemo_dapo.engines.health")[0]
    assert probe["env"]["SLURM_NODEID"] == "1" and [a for a in probe["argv"] if a.startswith("tcp://")] == [
        f"tcp://127.0.0.1:{port + i}" for i in (0, 1)]
    ranks = rec.python("train_gpt_dapo.py")
    assert len(ranks) == 2 and {p["env"]["SLURM_NODEID"] for p in ranks} == {"0"}
    assert [p["env"]["RANK"] for p in ranks] == ["0", "1"]
    # every step names its nodes from the one hostnames list: the trainer the first, the engines the last
    assert [_option(rec.steps[rec.step_of(k)], "--nodelist") for k in ("server", "health", "trainer")] == [
        "127.0.0.1", "127.0.0.1", "localhost"]
    cpus = re.compile(r"^(engine server|trainer rank) \d on node (\d): CPUs \S+$", re.M)
    job = servers[0]["env"]["SLURM_JOB_ID"]
    printed = [cpus.findall(f.read_text()) for f in (tmp_path / "results").rglob(f"*_{job}_*.*")]
    assert sorted(m for found in printed for m in found) == [("engine server", "1")] * 2 + [("trainer rank", "0")] * 2
    listed = {p["env"]["NEMO_DAPO_ENGINE_ADDRESS"] for p in ranks}
    assert listed == {f"tcp://127.0.0.1:{port},tcp://127.0.0.1:{port + 1}"}
    for p in ranks:
        assert "trainer.dapo.engine_server.placement=separate" in " ".join(p["argv"])
    options = json.loads(next((tmp_path / "results").rglob("engine_options.json")).read_text())
    assert options["options"].get("enable_sleep", False) is False
    for i in (0, 1):  # each replica's owner formed a weight group with its server and refit it over gloo
        log = next((tmp_path / "results").rglob(f"engine_{job}_{i}.err")).read_text()
        assert "ready on " + f"tcp://0.0.0.0:{port + i}" in log
        trainer = next((tmp_path / "results").rglob(f"dapo_{job}_{i}.log")).read_text()
        assert f"rank {i} owns engine local at tcp://127.0.0.1:{port + i}" in trainer
        refits = re.findall(r"refit of engine \S+: \d+ buckets, [\d.]+ MB over (\w+)", trainer)
        assert refits == ["group"] * 3, refits  # the initial push and one after each step
    ckpts = _checkpoints(tmp_path / "results")
    last = ckpts[max(ckpts)]["loop"]
    assert last["counters"]["rollout_steps"] == 2 and last["partial"]["weight_version"] == 2
    # step 2 continued what the round during step 1's update left: the groups carried and the prompts drawn ahead
    assert last["partial"]["counters"]["resumed_groups"] >= 1
