"""Run a worker script under ``torchrun`` (gloo, CPU) from a pytest test, or on ranks forked from a zygote that has
made the worker's first import already (``tests/support/zygote.py``).

Workers import ``tests.support.megatron_cpu_shim`` (test-only CUDA patches) before megatron, do their work on
every rank, and write what the test compares into ``$OUT_DIR`` (e.g. ``torch.save`` per rank).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.support.zygote import preload_of, zygote_for

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_json(*argv: str, timeout: float = 300) -> object:
    """Run ``python *argv`` in one process from the repo root (``OMP_NUM_THREADS=1``); fail with its stderr if it
    fails, else return the JSON of its last stdout line (how the one-process NeMo workers report)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def run_torchrun(script: str | Path, *args: str, nproc: int = 2, out_dir: str | Path | None = None,
                 env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``script`` on ``nproc`` local ranks; raise with the workers' output if any rank fails.

    A worker whose first import is a CPU shim (``tests.support.zygote.preload_of``) is forked from a zygote that
    has made that import already (``NEMO_DAPO_TEST_ZYGOTE=0``: always ``torchrun``)."""
    full_env = dict(os.environ)
    full_env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{full_env.get('PYTHONPATH', '')}",
                     "PYTHONUNBUFFERED": "1"})
    if out_dir is not None:
        full_env["OUT_DIR"] = str(out_dir)
    # a hung rank prints every thread's stack and exits before the timeout kills torchrun (megatron_cpu_shim)
    full_env["NEMO_DAPO_TEST_DUMP_AFTER_S"] = str(max(timeout - 20, 1))
    full_env.update(env or {})
    preload = preload_of(script) if os.environ.get("NEMO_DAPO_TEST_ZYGOTE", "1") != "0" else None
    zygote = zygote_for(preload, full_env) if preload else None
    if zygote is not None:  # the same ranks, forked from a process that has run the worker's first import
        proc = zygote.run(script, list(args), dict(full_env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())),
                          nproc, timeout)
        if proc.returncode != 0:
            raise AssertionError(f"{script} on {nproc} ranks (forked from the {preload} zygote) failed "
                                 f"(rc={proc.returncode}):\n{proc.stdout[-12000:]}")
        return proc
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(script), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun {script} failed (rc={proc.returncode}):\n"
                             f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def forbid_fork() -> None:
    """Make ``os.fork`` raise in this process. A rank that already runs gloo's threads must not fork: a child forked
    while another thread holds a lock waits on it forever (nemo_dapo/megatron/dist_save.py). ``spawn`` children
    (``_posixsubprocess.fork_exec``) are still allowed."""

    def refuse(*_args, **_kwargs):
        raise RuntimeError("os.fork() called by a multi-threaded rank (forbidden in this test)")

    os.fork = refuse
