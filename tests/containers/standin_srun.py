"""Stand-in for Slurm's ``srun`` with pyxis (test-only): runs a job step's tasks as local processes of one node.

``tests/containers/bin/srun`` execs this file. It understands the options ``containers/dapo.sbatch`` passes and
refuses any other (a new option in the script must be taught here, not silently dropped). Each task gets the
variables real srun sets (``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NTASKS``, ``SLURM_CPUS_PER_TASK``, ...)
and, with ``--container-image``, runs through the ``enroot`` stand-in (what pyxis does inside srun), which maps the
mounts and records what the task got. Every call is recorded as ``$STANDIN_RECORDS/step<N>.json`` (argv, parsed
options, pid).

Semantics kept from srun: ``-o`` / ``-e`` patterns (``%j`` job id, ``%t`` task id, ``%s`` step id, ``%N`` node);
the step's exit code is the first failing task's (128 + signal for a killed one); ``--kill-on-bad-exit=1`` stops
the other tasks as soon as one exits non-zero; SIGTERM / SIGINT are forwarded to every task, which get 5 s before
SIGKILL. A step runs on one node: ``--nodes`` above 1 is an error; ``--nodelist=HOST`` (the first of the job's
``SLURM_JOB_NODELIST`` entries that is HOST) or ``--relative=R`` names which node of the job it is (``SLURM_NODEID``;
every node is this machine, so a test gives the nodes different names for it: localhost, 127.0.0.1).
"""
from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VALUED = ("--nodes", "-N", "--ntasks", "-n", "--ntasks-per-node", "--cpus-per-task", "-c", "--gpus-per-node",
          "--mpi", "--relative", "--nodelist", "-w", "--kill-on-bad-exit", "--container-image", "--container-mounts",
          "--container-workdir", "--output", "-o", "--error", "-e", "--export")
FLAGS = ("--overlap", "--no-container-mount-home", "--exclusive")
SHORT = {"-N": "--nodes", "-n": "--ntasks", "-c": "--cpus-per-task", "-o": "--output", "-e": "--error",
         "-w": "--nodelist"}


def fail(msg: str) -> None:
    print(f"srun (stand-in): {msg}", file=sys.stderr)
    sys.exit(2)


def parse(argv: list) -> tuple:
    """(options {long name: value or True}, command argv)."""
    opts, i = {}, 0
    while i < len(argv) and argv[i].startswith("-"):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        name = SHORT.get(name, name)
        if name in FLAGS and not eq:
            opts[name] = True
        elif name in (SHORT.get(v, v) for v in VALUED):
            if not eq:
                i += 1
                if i >= len(argv):
                    fail(f"option {arg} needs a value")
                value = argv[i]
            opts[name] = value
        else:
            fail(f"unknown option {arg!r}: teach tests/containers/standin_srun.py what real srun does with it")
        i += 1
    if i >= len(argv):
        fail("no command to run")
    return opts, argv[i:]


def next_step_id(records: Path) -> int:
    with open(records / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        n = len([p for p in records.glob("step*.json") if ".task" not in p.name])
        (records / f"step{n}.json").write_text("{}")  # reserve the number under the lock
    return n


def expand(pattern: str, job: str, step: int, task: int) -> str:
    return (pattern.replace("%j", job).replace("%t", str(task)).replace("%s", str(step))
            .replace("%N", "localhost"))


def node_of(opts: dict) -> int:
    """The job's node the step runs on: ``--nodelist``'s one host, found in SLURM_JOB_NODELIST (real srun refuses
    --relative beside it), else ``--relative``, else the first."""
    if "--nodelist" in opts:
        if "--relative" in opts:
            fail("--relative cannot be combined with --nodelist")
        hosts = os.environ.get("SLURM_JOB_NODELIST", "localhost").split(",")
        if opts["--nodelist"] not in hosts:
            fail(f"--nodelist={opts['--nodelist']} is not one node of the job's {hosts} (this stand-in runs one)")
        return hosts.index(opts["--nodelist"])
    return int(opts.get("--relative", "0"))


def task_env(opts: dict, task: int, ntasks: int, step: int) -> dict:
    env = dict(os.environ)
    env.update(SLURM_PROCID=str(task), SLURM_LOCALID=str(task), SLURM_NODEID=str(node_of(opts)),
               SLURM_NTASKS=str(ntasks),
               SLURM_NPROCS=str(ntasks), SLURM_STEP_NUM_TASKS=str(ntasks), SLURM_NTASKS_PER_NODE=str(ntasks),
               SLURM_TASKS_PER_NODE=str(ntasks), SLURM_STEP_NUM_NODES="1", SLURM_NNODES="1",
               SLURM_STEP_NODELIST="localhost", SLURM_NODELIST=env.get("SLURM_NODELIST", "localhost"),
               SLURM_STEP_ID=str(step), SLURMD_NODENAME="localhost")
    if "--cpus-per-task" in opts:
        env["SLURM_CPUS_PER_TASK"] = str(opts["--cpus-per-task"])
    else:
        env.pop("SLURM_CPUS_PER_TASK", None)
    return env


def task_argv(opts: dict, command: list, step: int, task: int) -> list:
    if "--container-image" not in opts:
        return command
    argv = [str(HERE / "bin" / "enroot"), "start", "--step", str(step), "--task", str(task)]
    for mount in filter(None, opts.get("--container-mounts", "").split(",")):
        argv += ["--mount", mount]
    if "--container-workdir" in opts:
        argv += ["--workdir", opts["--container-workdir"]]
    if opts.get("--no-container-mount-home"):
        argv.append("--no-mount-home")
    return argv + [opts["--container-image"], "--", *command]


def main(argv: list) -> int:
    opts, command = parse(argv)
    nodes, node = int(opts.get("--nodes", "1")), node_of(opts)
    if nodes != 1 or not 0 <= node < int(os.environ.get("SLURM_JOB_NUM_NODES", "1")):
        fail(f"this stand-in runs a step on one node of the job's {os.environ.get('SLURM_JOB_NUM_NODES', '1')}; "
             f"got --nodes={nodes} and node {node}")
    ntasks = int(opts.get("--ntasks", opts.get("--ntasks-per-node", "1")))
    records = Path(os.environ["STANDIN_RECORDS"])
    step = next_step_id(records)
    job = os.environ.get("SLURM_JOB_ID", "0")
    (records / f"step{step}.json").write_text(json.dumps(
        {"argv": argv, "options": opts, "command": command, "ntasks": ntasks, "pid": os.getpid(),
         "started": time.time()}, indent=1))
    procs = []
    for t in range(ntasks):
        out = err = None
        if "--output" in opts:
            out = open(expand(opts["--output"], job, step, t), "ab")
        if "--error" in opts:
            err = open(expand(opts["--error"], job, step, t), "ab")
        procs.append(subprocess.Popen(task_argv(opts, command, step, t), env=task_env(opts, t, ntasks, step),
                                      stdout=out, stderr=err, start_new_session=True))

    def stop(sig=signal.SIGTERM, grace: float = 5.0) -> None:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.time() + grace
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def on_signal(signum, frame):
        stop(signal.SIGTERM)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    kill_on_bad_exit = str(opts.get("--kill-on-bad-exit", "0")) == "1"
    rc = 0
    while any(p.poll() is None for p in procs):
        bad = [p for p in procs if p.poll() not in (None, 0)]
        if bad and kill_on_bad_exit:
            print(f"srun (stand-in): task {procs.index(bad[0])} exited with {bad[0].returncode}: killing the step "
                  "(--kill-on-bad-exit)", file=sys.stderr)
            stop(signal.SIGKILL, grace=2.0)
            break
        time.sleep(0.1)
    for p in procs:
        code = p.wait()
        code = 128 - code if code < 0 else code
        if code and not rc:
            rc = code
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
