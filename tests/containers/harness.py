"""Run ``containers/dapo.sbatch`` on this machine with the srun / enroot stand-ins (test-only helpers).

* :func:`build_images`: the trainer and engine "images" as the Dockerfiles make them (``COPY . /opt/nemo_dapo``
  of the checkout, plus the test recipe in ``conf/recipes/``), each with its ``python`` and ENV.
* :func:`job_env`: the environment of a one-node allocation (2 "GPUs") submitting the script, with the stand-ins
  first on PATH.
* :class:`Records`: what the stand-ins recorded (srun steps, container tasks, Python processes).
* :class:`Watcher`: samples every process's command line while the job runs (the engine authkey must never be on
  one).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.support.dist import ROOT, free_port

HERE = Path(__file__).resolve().parent
SBATCH = ROOT / "containers" / "dapo.sbatch"
RECIPE = "tiny_cpu_sbatch"
TRAINER_IMAGE, ENGINE_IMAGE = "nemo-dapo.sqsh", "nemo-dapo-engine.sqsh"
GPUS_PER_NODE = 2


def _context_files() -> list:
    """The build context: the checkout's files (tracked and untracked, not ignored) minus .dockerignore's."""
    out = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                         check=True).stdout.decode().split("\0")
    return [p for p in out if p and not p.startswith((".venv", ".git/")) and "__pycache__" not in p]


def build_images(root: Path, trainer_python: str, engine_python: str, ref: str | None = None) -> Path:
    """Write both images under ``root``; returns the images file for ``$STANDIN_IMAGES``. The context is the
    working tree, as ``docker build .`` takes it, or commit ``ref`` (``$NEMO_DAPO_TEST_IMAGE_REF``, e.g. HEAD)."""
    src = root / "opt" / "nemo_dapo"
    src.mkdir(parents=True)
    ref = ref or os.environ.get("NEMO_DAPO_TEST_IMAGE_REF")
    if ref:
        archive = subprocess.run(["git", "archive", ref], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    for rel in [] if ref else _context_files():
        path = ROOT / rel
        if path.is_symlink() or path.is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, src / rel, follow_symlinks=False)
    shutil.copy2(HERE / "conf" / f"{RECIPE}.yaml", src / "conf" / "recipes" / f"{RECIPE}.yaml")
    images = {}
    for name, python, cpu in ((TRAINER_IMAGE, trainer_python, True), (ENGINE_IMAGE, engine_python, False)):
        bindir = root / name / "bin"
        bindir.mkdir(parents=True)
        (bindir / "python").write_text(f'#!/bin/sh\nexec "{python}" "$@"\n')  # a link would lose the venv
        (bindir / "python").chmod(0o755)
        env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
               "PYTHONPATH": f"{src / 'tests' / 'containers' / 'image_site'}{os.pathsep}{src}"}
        if cpu:
            env["NEMO_DAPO_CPU_IMAGE"] = "1"
        images[name] = {"paths": {"/opt/nemo_dapo": str(src)}, "bin": str(bindir), "env": env,
                        "workdir": "/opt/nemo_dapo"}
    path = root / "images.json"
    path.write_text(json.dumps(images, indent=1))
    return path


def script_for(tmp: Path) -> Path:
    """The script to run: ``containers/dapo.sbatch`` itself when it reads ``GPUS_PER_NODE`` from the environment;
    else a copy in ``tmp`` that differs in that one line only (``GPUS_PER_NODE=8`` -> ``${GPUS_PER_NODE:-8}``: this
    machine's node has 2 "GPUs"), checked to be the only difference."""
    text = SBATCH.read_text()
    if "GPUS_PER_NODE=${GPUS_PER_NODE:-8}" in text:
        return SBATCH
    fixed = text.replace("\nGPUS_PER_NODE=8\n", "\nGPUS_PER_NODE=${GPUS_PER_NODE:-8}\n")
    assert text.count("\nGPUS_PER_NODE=8\n") == 1, "dapo.sbatch sets GPUS_PER_NODE in a way the harness does not know"
    path = Path(tmp) / "dapo.sbatch"
    path.write_text(fixed)
    return path


def new_job_id() -> int:
    """A job id whose node-local socket directory (/tmp/nemo-dapo-<id>, the script's) does not exist: a stale socket
    of an earlier run would make a server fail with 'Address already in use'. Remove it with :func:`clean_job`."""
    while True:
        job = random.randrange(10 ** 6, 10 ** 7)
        if not os.path.exists(f"/tmp/nemo-dapo-{job}"):
            return job


def clean_job(job: int) -> None:
    shutil.rmtree(f"/tmp/nemo-dapo-{job}", ignore_errors=True)


def job_env(inputs: dict, images: Path, results: Path, records: Path, job_id: int, **extra) -> dict:
    keep = {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "CUDA_", "NCCL_", "NEMO_DAPO_", "MASTER_", "RAY_", "TLLM_"))
            and k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    records.mkdir(parents=True, exist_ok=True)
    env = dict(keep, PATH=f"{HERE / 'bin'}{os.pathsep}{keep['PATH']}", STANDIN_PYTHON=sys.executable,
               STANDIN_RECORDS=str(records), STANDIN_IMAGES=str(images),
               SLURM_JOB_ID=str(job_id), SLURM_JOB_NAME="nemo-dapo", SLURM_JOB_NUM_NODES="1", SLURM_NNODES="1",
               SLURM_NODELIST="localhost", SLURM_CPUS_ON_NODE=str(os.cpu_count() or 2),
               GPUS_PER_NODE=str(GPUS_PER_NODE), MASTER_PORT=str(free_port()),
               CONTAINER=TRAINER_IMAGE, ENGINE_CONTAINER=ENGINE_IMAGE, RECIPE=RECIPE, ROLLOUT_ENGINE="local",
               CHECKPOINT=inputs["checkpoint"], TOKENIZER=inputs["tokenizer"], HF_MODEL=inputs["hf_model"],
               TRAIN_DATA=inputs["train"], VAL_DATA=inputs["val"], RESULTS=str(results), OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def sbatch(env: dict, *overrides: str, timeout: float = 900, script: Path = SBATCH) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *overrides], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


class Records:
    """The stand-ins' records of one job (``$STANDIN_RECORDS``)."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.steps = [json.loads(p.read_text()) for p in sorted(self.dir.glob("step*.json"), key=self._step_no)
                      if ".task" not in p.name]
        self.procs = [json.loads(p.read_text()) for p in self.dir.glob("proc-*.json")]

    @staticmethod
    def _step_no(path: Path) -> int:
        return int(path.name[4:].split(".")[0])

    def tasks(self, step: int) -> list:
        return [json.loads((self.dir / f"step{step}.task{t}.json").read_text())
                for t in range(self.steps[step]["ntasks"])
                if (self.dir / f"step{step}.task{t}.json").exists()]

    def kind(self, step: int) -> str:
        cmd = self.steps[step]["command"][-1]
        for needle, kind in (("nemo_dapo.cluster.engine_options", "options"), ("nemo_dapo.engines.server", "server"),
                             ("nemo_dapo.engines.health", "health"), ("train_gpt_dapo.py", "trainer")):
            if needle in cmd:
                return kind
        return "?"

    def kinds(self) -> list:
        return [self.kind(i) for i in range(len(self.steps))]

    def step_of(self, kind: str) -> int:
        return self.kinds().index(kind)

    def python(self, needle: str) -> list:
        """The recorded Python processes whose command line contains ``needle``, by SLURM_PROCID."""
        found = [p for p in self.procs if any(needle in a for a in p["argv"])]
        return sorted(found, key=lambda p: int(p["env"].get("SLURM_PROCID", "0")))


class Watcher(threading.Thread):
    """Samples /proc/*/cmdline every 0.2 s while the job runs; ``hits`` are command lines containing ``needle``
    (set once it is known: the script makes the key)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.needle, self.hits, self.samples = None, [], 0
        self._halt = threading.Event()

    def run(self):
        while not self._halt.is_set():
            if self.needle:
                for proc in Path("/proc").glob("[0-9]*"):
                    try:
                        cmd = (proc / "cmdline").read_bytes()
                    except OSError:
                        continue
                    if self.needle.encode() in cmd:
                        self.hits.append(cmd.decode(errors="replace"))
                self.samples += 1
            self._halt.wait(0.2)

    def stop(self):
        self._halt.set()
        self.join()


def tree_snapshot(path: str) -> dict:
    """{relative path: (size, mtime_ns)} of every file under ``path`` (a read-only input must not change)."""
    base = Path(path)
    return {str(p.relative_to(base)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(base.rglob("*")) if p.is_file()}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) is not running
        return (Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()[0]) != "Z"
    except OSError:
        return False


def wait_for(predicate, timeout: float, interval: float = 0.1):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return None
