"""Start a test's ranks by forking a process that has already imported the worker's heavy first import.

A NeMo worker spends about 14 s of CPU importing NeMo before its first line of work (tests/README.md), and the suite
starts dozens of them, plus a ``torchrun`` launcher each time. ``run_torchrun`` hands such launches to a zygote: a
process, one per pytest worker and preload, that imported ``tests.support.nemo_cpu`` (or
``tests.support.megatron_cpu_shim``) once and forks one child per rank. A child sets the environment ``torchrun``
would (``RANK``, ``WORLD_SIZE``, ``MASTER_PORT``, ...), re-seeds what a fresh interpreter seeds from the OS, and runs
the worker script as ``__main__``: the worker's code, its processes and its collectives are the real ones; only the
interpreter start is shared.

The zygote forks only while it has a single thread (checked from /proc at start; otherwise ``run_torchrun`` falls
back to ``torchrun``), and only workers whose first non-standard-library statement is that very import
(:func:`preload_of`): anything a worker does before it (an environment default, say) keeps it on ``torchrun``.
Like ``torchrun``, a rank that fails makes the others stop (after a 5 s grace), and a timeout stops them all.

Protocol: one JSON line per request on the zygote's stdin ({script, args, env, nproc, timeout, log_dir}), one JSON
line per reply on its original stdout ({returncodes, first_failure, timed_out}); the ranks write ``rank<r>.log`` in
``log_dir``.
"""
from __future__ import annotations

import ast
import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRELOADS = ("tests.support.nemo_cpu", "tests.support.megatron_cpu_shim")
GRACE_S = 5.0


def preload_of(script: str | Path) -> str | None:
    """The module a zygote may import for ``script``: its first statement that is not a docstring or a standard
    library import, when that statement imports one of :data:`PRELOADS`; else None."""
    for node in ast.parse(Path(script).read_text()).body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            return None
        hit = [n for n in names if n in PRELOADS]
        if hit:
            return hit[0]
        if not all(n.split(".")[0] in sys.stdlib_module_names for n in names if n != "__future__"):
            return None
    return None


# ---- the client side (in the pytest worker) -----------------------------------------------------------------------
_ZYGOTES: dict = {}
_LOCK = threading.Lock()


class Zygote:
    def __init__(self, preload: str, env: dict):
        self.preload = preload
        self.stderr = tempfile.TemporaryFile(mode="w+")  # a pipe nobody reads would fill with NeMo's warnings
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.zygote", preload], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True)
        hello = self.proc.stdout.readline()
        self.ready = hello.strip() == "ready"
        self.why = "" if self.ready else (hello.strip() or self.errors())

    def errors(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()[-3000:]

    def run(self, script: str, args: list, env: dict, nproc: int, timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="zygote-") as log_dir:
            request = dict(script=str(script), args=[str(a) for a in args], env=env, nproc=nproc, timeout=timeout,
                           log_dir=log_dir)
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
            if not line:
                self.ready = False
                raise AssertionError(f"the {self.preload} zygote died: {self.errors()}")
            reply = json.loads(line)
            logs = [Path(log_dir, f"rank{r}.log").read_text(errors="replace") for r in range(nproc)]
        rc = 124 if reply["timed_out"] else reply["first_failure"]
        out = "".join(f"--- rank {r} ---\n{text}" for r, text in enumerate(logs))
        return subprocess.CompletedProcess([str(script), *args], rc, stdout=out, stderr=out)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def zygote_for(preload: str, env: dict) -> Zygote | None:
    """The pytest worker's zygote for ``preload`` (started on first use, with ``env``'s ``SHIM_LEVEL``); None when
    it cannot fork safely (the caller uses ``torchrun``)."""
    key = (preload, env.get("SHIM_LEVEL", ""))
    with _LOCK:
        z = _ZYGOTES.get(key)
        if z is None or not z.ready:
            base = {k: v for k, v in env.items() if k != "NEMO_DAPO_TEST_DUMP_AFTER_S"}  # no watchdog thread there
            base["JE_ARROW_MALLOC_CONF"] = "background_thread:false"  # pyarrow's allocator thread (NeMo imports it)
            z = _ZYGOTES[key] = Zygote(preload, base)
            if not z.ready:
                print(f"tests.support.zygote: {preload} zygote unusable ({z.why}); using torchrun", file=sys.stderr)
        return z if z.ready else None


@atexit.register
def _close_all() -> None:
    for z in _ZYGOTES.values():
        z.close()


# ---- the zygote side ----------------------------------------------------------------------------------------------
def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _child(request: dict, rank: int, reply_fd: int, preload_env: dict) -> None:
    """In the forked rank: become the worker script's process (never returns). ``preload_env``: what the preload
    set in the environment, which a fresh process would have set on top of the request's environment too."""
    code = 1
    try:
        os.setpgid(0, 0)
        os.close(reply_fd)
        log = os.open(os.path.join(request["log_dir"], f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.environ.clear()
        os.environ.update(request["env"])
        for key, value in preload_env.items():
            os.environ.setdefault(key, value)
        import random

        import torch

        random.seed()  # a fresh interpreter seeds these from the OS; the fork would share the zygote's state
        torch.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        if os.environ.get("NEMO_DAPO_TEST_DUMP_AFTER_S"):
            import faulthandler

            faulthandler.dump_traceback_later(float(os.environ["NEMO_DAPO_TEST_DUMP_AFTER_S"]), exit=True)
        import runpy

        script = request["script"]
        sys.argv = [script, *request["args"]]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException:
            import traceback

            traceback.print_exc()
        atexit._run_exitfuncs()
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _launch(request: dict, reply_fd: int, preload_env: dict) -> dict:
    """Fork ``nproc`` ranks, wait like torchrun (a failure stops the others after a grace; the timeout stops all)."""
    nproc, port = request["nproc"], request["env"]["MASTER_PORT"]
    pids = {}
    for rank in range(nproc):
        env = dict(request["env"], RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                   ROLE_NAME="default", LOCAL_WORLD_SIZE=str(nproc), WORLD_SIZE=str(nproc),
                   GROUP_WORLD_SIZE="1", ROLE_WORLD_SIZE=str(nproc), MASTER_PORT=str(port),
                   TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="none",
                   TORCHELASTIC_USE_AGENT_STORE="False")
        pid = os.fork()
        if pid == 0:
            _child(dict(request, env=env), rank, reply_fd, preload_env)
        try:  # here too, so that a kill right after the fork finds the group (the child may not have run yet)
            os.setpgid(pid, pid)
        except OSError:
            pass
        pids[pid] = rank
    codes, deadline, stop_at, timed_out = [None] * nproc, time.monotonic() + request["timeout"], None, False
    first = 0  # the exit code of the rank that failed first (torchrun reports that one too)
    while any(c is None for c in codes):
        for pid, rank in pids.items():
            if codes[rank] is None:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[rank] = os.waitstatus_to_exitcode(status)
                    if codes[rank] != 0 and stop_at is None:
                        stop_at, first = time.monotonic() + GRACE_S, codes[rank]
        now = time.monotonic()
        if now > deadline or (stop_at is not None and now > stop_at):
            timed_out = now > deadline
            for pid, rank in pids.items():
                if codes[rank] is None:
                    try:
                        os.killpg(pid, 9)
                    except ProcessLookupError:
                        pass
            stop_at = deadline = float("inf")
        time.sleep(0.02)
    for pid in pids:  # what the ranks started (an engine server) goes with them
        try:
            os.killpg(pid, 9)
        except ProcessLookupError:
            pass
    return dict(returncodes=codes, first_failure=first, timed_out=timed_out)


def main(preload: str) -> int:
    import importlib

    before = dict(os.environ)
    importlib.import_module(preload)
    preload_env = {k: v for k, v in os.environ.items() if before.get(k) != v}
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # stray prints must not reach the reply pipe
    if _threads() != 1:
        reply.write(f"{preload} left {_threads()} threads running: forking it is unsafe\n")
        reply.flush()
        return 1
    reply.write("ready\n")
    reply.flush()
    for line in sys.stdin:
        reply.write(json.dumps(_launch(json.loads(line), reply.fileno(), preload_env)) + "\n")
        reply.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
