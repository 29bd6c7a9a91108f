"""The run directory under hostile conditions, through the real `nemo-dapo train` command in subprocesses:
concurrent writers, stale locks, config drift on resume, finished runs, corrupt and planted checkpoints, signals,
a full disk and a read-only directory. Each case asserts the exit code and that the message names the input."""
import errno
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from nemo_dapo.cli import main
from nemo_dapo.core import checkpoint as ck
from nemo_dapo.local.run_dir import EXIT_BUSY, EXIT_UNWRITABLE, LOCK_FILE, RunDirBusy, RunDirLock, config_drift
from nemo_dapo.local.run_log import read_metrics
from tests.local.test_run import TINY, tiny_cfg

CMD = [sys.executable, "-m", "nemo_dapo.cli", "train"]
ENV = dict(os.environ, OMP_NUM_THREADS="1")
# Steps of a run that a test interrupts after its first step or checkpoint: enough that the run is still going
# when the signal or kill lands (a toy step takes about a second), few enough that the resumed run is short.
LONG = 8


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    from nemo_dapo.local.run_model import BASE_DIR, prepare_base_model

    run_dir = str(tmp_path_factory.mktemp("base"))
    prepare_base_model(tiny_cfg(run_dir))
    return os.path.join(run_dir, BASE_DIR)


def args(base_dir, run_dir, *extra):
    return TINY + [f"model.path={base_dir}", f"run_dir={run_dir}", *extra]


def train(base_dir, run_dir, *extra, flags=()):
    p = subprocess.run(CMD + list(flags) + args(base_dir, run_dir, *extra), env=ENV, capture_output=True, text=True,
                       timeout=300)
    return p.returncode, p.stderr


def start(base_dir, run_dir, *extra, session=False):
    return subprocess.Popen(CMD + args(base_dir, run_dir, *extra), env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=session)


def wait_for(proc, condition, what, timeout=240):
    deadline = time.time() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before {what}: {proc.stderr.read()}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def train_steps(run_dir):
    try:
        return [r["step"] for r in read_metrics(run_dir, "train")]
    except FileNotFoundError:
        return []


def ckpt_names(run_dir):
    return sorted(os.listdir(os.path.join(run_dir, "checkpoints")))


@pytest.fixture(scope="module")
def finished(tmp_path_factory, base_dir):
    """A finished 2-step run (checkpoints at steps 1 and 2); tests work on copies of it."""
    run_dir = str(tmp_path_factory.mktemp("finished") / "run")
    code, err = train(base_dir, run_dir, "trainer.max_steps=2")
    assert code == 0, err
    return run_dir


def copy_of(finished, tmp_path):
    dst = str(tmp_path / "run")
    shutil.copytree(finished, dst)
    return dst


# ---- one writer at a time -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_second_train_on_a_running_directory_is_refused_naming_the_holder(tmp_path, base_dir):
    run_dir = str(tmp_path / "run")
    first = start(base_dir, run_dir, "trainer.max_steps=400")
    try:
        wait_for(first, lambda: train_steps(run_dir), "the first step")
        code, err = train(base_dir, run_dir, "trainer.max_steps=400")
        assert code == EXIT_BUSY, err
        assert f"pid {first.pid} on host {socket.gethostname()}" in err and "started" in err and run_dir in err
        assert "run_dir=" in err and "Traceback" not in err
        assert first.poll() is None  # the holder is undisturbed
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=120)
    assert first.returncode == 143
    assert not os.path.exists(os.path.join(run_dir, LOCK_FILE))  # released on exit


@pytest.mark.slow
def test_the_stale_lock_of_a_killed_run_is_taken_over(tmp_path, base_dir):
    run_dir = str(tmp_path / "run")
    victim = start(base_dir, run_dir, f"trainer.max_steps={LONG}", "trainer.save_every=1")
    wait_for(victim, lambda: os.path.isdir(os.path.join(run_dir, "checkpoints")) and ckpt_names(run_dir),
             "the first checkpoint")
    victim.kill()
    victim.wait()
    lock = json.load(open(os.path.join(run_dir, LOCK_FILE)))
    assert lock["pid"] == victim.pid  # SIGKILL leaves the lock file behind ...
    code, err = train(base_dir, run_dir, f"trainer.max_steps={LONG}", "trainer.save_every=1")
    assert code == 0, err  # ... and the next run takes it over and resumes
    assert f"taking over the stale lock of pid {victim.pid}" in err and "that process is gone" in err
    assert train_steps(run_dir) == list(range(1, LONG + 1))
    assert not os.path.exists(os.path.join(run_dir, LOCK_FILE))


def test_lock_refuses_a_second_holder_and_reports_a_dead_one(tmp_path):
    with RunDirLock(str(tmp_path)):
        with pytest.raises(RunDirBusy, match=rf"in use by pid {os.getpid()} on host"):
            RunDirLock(str(tmp_path)).acquire()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": 0,
                                                  "command": "nemo-dapo train"}))
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("nemo_dapo").addHandler(handler)
    try:
        with RunDirLock(str(tmp_path)):
            pass
    finally:
        logging.getLogger("nemo_dapo").removeHandler(handler)
    assert any(f"stale lock of pid {dead.pid}" in m and "that process is gone" in m for m in seen), seen


# ---- resume checks what it resumes --------------------------------------------------------------------------------
@pytest.mark.slow
def test_config_drift_on_resume_is_refused_with_the_keys_and_the_ways_out(tmp_path, finished, base_dir):
    run_dir = copy_of(finished, tmp_path)
    before = {n: os.path.getmtime(os.path.join(run_dir, "checkpoints", n)) for n in ckpt_names(run_dir)}
    config_before = open(os.path.join(run_dir, "config.yaml")).read()
    code, err = train(base_dir, run_dir, "trainer.max_steps=3", "seed=7", "optim.lr=0.01")
    assert code == 2, err
    assert "seed: 1234 -> 7" in err and "optim.lr: 0.001 -> 0.01" in err and "step_00000002.pt" in err
    assert "--allow-config-change" in err and "run_dir=" in err and "Traceback" not in err
    assert {n: os.path.getmtime(os.path.join(run_dir, "checkpoints", n)) for n in ckpt_names(run_dir)} == before
    assert open(os.path.join(run_dir, "config.yaml")).read() == config_before
    code, err = train(base_dir, run_dir, "trainer.max_steps=3", "seed=7", "optim.lr=0.01",
                      flags=["--allow-config-change"])
    assert code == 0, err
    assert "with changed keys (--allow-config-change): optim.lr" in err
    assert train_steps(run_dir) == [1, 2, 3]


def test_drift_ignores_budgets_logging_and_eval_but_not_what_is_trained():
    stored = {"seed": 1, "trainer": {"max_steps": 2, "plots": True, "train_batch_size": 2}, "eval": {"n_samples": 2},
              "model": {"extra": {"a": 1}}}
    current = {"seed": 1, "trainer": {"max_steps": 9, "plots": False, "train_batch_size": 4},
               "eval": {"n_samples": 8}, "model": {"extra": {"a": 2}}}
    assert config_drift(stored, current) == [("model.extra", {"a": 1}, {"a": 2}),
                                             ("trainer.train_batch_size", 2, 4)]


@pytest.mark.slow
def test_a_finished_run_is_reported_finished_and_left_untouched(tmp_path, finished, base_dir):
    run_dir = copy_of(finished, tmp_path)
    summary = open(os.path.join(run_dir, "summary.json")).read()
    metrics = open(os.path.join(run_dir, "metrics.jsonl")).read()
    code, err = train(base_dir, run_dir, "trainer.max_steps=2", "trainer.val_every=2")  # logging keys may differ
    assert code == 0, err
    assert f"in {run_dir} is finished (rollout step 2" in err and "trainer.max_steps" in err
    assert open(os.path.join(run_dir, "summary.json")).read() == summary
    assert open(os.path.join(run_dir, "metrics.jsonl")).read() == metrics
    code, err = train(base_dir, run_dir, "trainer.max_steps=3")  # a raised budget continues the run
    assert code == 0, err
    assert json.load(open(os.path.join(run_dir, "summary.json")))["rollout_steps"] == 3
    assert train_steps(run_dir) == [1, 2, 3]


# ---- corrupt and planted checkpoints ------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_truncated_latest_checkpoint_is_named_and_resume_falls_back(tmp_path, finished, base_dir):
    run_dir = copy_of(finished, tmp_path)
    latest = os.path.join(run_dir, "checkpoints", "step_00000002.pt")
    data = open(latest, "rb").read()
    open(latest, "wb").write(data[:len(data) // 2])
    code, err = train(base_dir, run_dir, "trainer.max_steps=2")
    assert code == 0, err
    assert "step_00000002.pt" in err and "truncated or corrupt" in err
    assert "resuming from" in err and "step_00000001.pt, the newest intact checkpoint" in err
    assert os.path.isfile(latest + ".corrupt")  # kept for inspection, out of the resume order
    assert ck.load_checkpoint(latest)["loop"]["counters"]["rollout_steps"] == 2  # step 2 retrained and saved
    assert train_steps(run_dir) == [1, 2]


@pytest.mark.slow
def test_all_checkpoints_corrupt_is_one_error_naming_them(tmp_path, finished, base_dir):
    run_dir = copy_of(finished, tmp_path)
    for name in ckpt_names(run_dir):
        open(os.path.join(run_dir, "checkpoints", name), "wb").write(b"\0" * 100)
    code, err = train(base_dir, run_dir, "trainer.max_steps=2")
    assert code == 2, err
    assert "no intact checkpoint" in err and "step_00000001.pt" in err and "step_00000002.pt" in err
    assert "resume=never" in err and "Traceback" not in err


class _Planted:
    """Unpickling this runs a shell command (what a crafted step_*.pt would hold)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.slow
def test_a_planted_pickle_in_the_run_directory_is_refused_and_never_runs(tmp_path, finished, base_dir):
    run_dir = copy_of(finished, tmp_path)
    marker = tmp_path / "pwned"
    torch.save({"loop": _Planted(marker), "rng": {}, "base_eval": {}},
               ck.checkpoint_path(os.path.join(run_dir, "checkpoints"), 3))
    code, err = train(base_dir, run_dir, "trainer.max_steps=4")
    assert code == 2, err
    assert "step_00000003.pt" in err and "posix.system" in err and "nothing in it was run" in err
    assert not marker.exists()


# ---- signals ------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_signal_saves_the_current_step_and_the_same_command_resumes(tmp_path, base_dir, sig, code):
    """SIGTERM as a scheduler sends it (to the trainer); SIGINT as Ctrl-C sends it: to the whole process group,
    generation worker included (rollout.processes=2), which must leave the stopping to the trainer."""
    run_dir = str(tmp_path / "run")
    extra = (f"trainer.max_steps={LONG}", "trainer.save_every=100")  # only the last step is saved on schedule
    if sig == signal.SIGINT:
        extra += ("rollout.processes=2",)
    proc = start(base_dir, run_dir, *extra, session=True)
    wait_for(proc, lambda: train_steps(run_dir), "the first step")
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    done = train_steps(run_dir)
    step = done[-1]
    assert 1 <= step < LONG and done == list(range(1, step + 1))
    name = f"step_{step:08d}.pt"
    assert ckpt_names(run_dir) == [name]  # the interrupted point, off the save schedule
    assert f"{sig.name} received: stopping after the current rollout step" in err
    assert f"stopped: interrupted by {sig.name} at rollout step {step}; checkpoint" in err and name in err
    assert "Resume with the same command: nemo-dapo train " in err and "Traceback" not in err
    assert not os.path.exists(os.path.join(run_dir, "summary.json"))
    rc, err = train(base_dir, run_dir, *extra)
    assert rc == 0, err
    assert f"resumed from {os.path.join(run_dir, 'checkpoints', name)} (rollout step {step})" in err
    assert train_steps(run_dir) == list(range(1, LONG + 1))
    assert json.load(open(os.path.join(run_dir, "summary.json")))["rollout_steps"] == LONG


# ---- disk full, read-only directory -------------------------------------------------------------------------------
def test_disk_full_while_saving_is_one_error_and_the_previous_checkpoints_stay(tmp_path, base_dir, monkeypatch,
                                                                               capsys):
    run_dir = str(tmp_path / "run")
    real_save, calls = torch.save, []

    def filling_save(obj, f, *a, **k):
        calls.append(1)
        if len(calls) == 2:  # the second checkpoint runs out of space half-way
            f.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")  # as write() raises it: no file name
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(ck.torch, "save", filling_save)
    code = main(["train", *args(base_dir, run_dir, "trainer.max_steps=3")])
    err = capsys.readouterr().err
    assert code == EXIT_UNWRITABLE, err
    errors = [line for line in err.splitlines() if line.startswith("nemo-dapo train: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert "step_00000002.pt': No space left on device" in errors[0] and "kept intact" in errors[0]
    assert "step_00000001.pt" in errors[0] and "rerun the same command" in errors[0]
    assert ckpt_names(run_dir) == ["step_00000001.pt"]  # no temporary file, step 1 intact
    assert ck.load_checkpoint(os.path.join(run_dir, "checkpoints", "step_00000001.pt"))["loop"]["counters"][
        "rollout_steps"] == 1
    monkeypatch.setattr(ck.torch, "save", real_save)
    assert main(["train", *args(base_dir, run_dir, "trainer.max_steps=3")]) == 0  # lock released; resumes
    assert train_steps(run_dir) == [1, 2, 3]


def _can_mount_read_only() -> bool:
    """Root can write through chmod 0555; a read-only bind mount in a private mount namespace stops root too."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "--mount", "sh", "-c", "mount --bind / /mnt && mount -o remount,bind,ro /mnt"],
                           capture_output=True)
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize("how", ["chmod", "ro-mount"])
def test_a_read_only_checkpoint_directory_is_one_error_and_nothing_is_lost(tmp_path, finished, base_dir, how):
    run_dir = copy_of(finished, tmp_path)
    ckpts = os.path.join(run_dir, "checkpoints")
    cmd = CMD + args(base_dir, run_dir, "trainer.max_steps=3")
    if how == "chmod":
        if os.geteuid() == 0:
            pytest.skip("root writes to a chmod 0555 directory (the ro-mount case and the ENOSPC test cover it)")
        os.chmod(ckpts, 0o555)
    else:
        if not _can_mount_read_only():
            pytest.skip("needs root and `unshare --mount` for a read-only bind mount")
        cmd = ["unshare", "--mount", "sh", "-c", 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && '
               'exec "$@"', ckpts, *cmd]
    try:
        p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    finally:
        os.chmod(ckpts, 0o755)
    assert p.returncode == EXIT_UNWRITABLE, p.stderr
    assert ckpts in p.stderr and "step_00000001.pt, step_00000002.pt" in p.stderr and "Traceback" not in p.stderr
    assert ckpt_names(run_dir) == ["step_00000001.pt", "step_00000002.pt"]
    assert ck.load_checkpoint(os.path.join(ckpts, "step_00000002.pt"))["loop"]["counters"]["rollout_steps"] == 2
    assert not os.path.exists(os.path.join(run_dir, LOCK_FILE))


# ---- cached artifacts ---------------------------------------------------------------------------------------------
def _weights(directory):
    from safetensors.torch import load_file

    return load_file(os.path.join(directory, "model.safetensors"))


def test_the_warmup_cache_is_keyed_by_its_inputs_and_never_overwritten(tmp_path, monkeypatch):
    from nemo_dapo.local import run_model
    from nemo_dapo.local.run_model import BASE_DIR, fingerprint, prepare_base_model

    cfg_a = tiny_cfg(str(tmp_path), "warmup.max_steps=1")
    key_a = fingerprint(cfg_a)
    assert prepare_base_model(cfg_a)[2]["source"] == "warmup"
    current = os.path.join(str(tmp_path), BASE_DIR)
    first = _weights(current)
    cfg_b = tiny_cfg(str(tmp_path), "warmup.max_steps=1", "seed=99")
    assert prepare_base_model(cfg_b)[2]["source"] == "warmup"  # other inputs: built anew ...
    kept = os.path.join(str(tmp_path), f"{BASE_DIR}.{key_a}")
    assert all(torch.equal(first[k], v) for k, v in _weights(kept).items())  # ... the first one kept aside
    assert prepare_base_model(cfg_a)[2]["source"] == "cache"  # and reused when its inputs come back
    assert all(torch.equal(first[k], v) for k, v in _weights(current).items())
    assert json.load(open(os.path.join(current, "fingerprint.json")))["inputs"]["seed"] == cfg_a.seed
    # Every input class changes the key: seed, task, tokenizer, model config, code.
    for override in ("seed=5", "data.max_terms=4", "data.tokenizer_vocab_size=300", "model.hidden_size=16",
                     "rollout.max_new_tokens=10"):
        assert fingerprint(tiny_cfg(str(tmp_path), "warmup.max_steps=1", override)) != key_a, override
    real = run_model.code_version
    monkeypatch.setattr(run_model, "code_version", lambda: dict(real(), sources="edited"))
    assert fingerprint(cfg_a) != key_a


def test_only_space_or_run_directory_permissions_count_as_unwritable(tmp_path):
    from nemo_dapo.local.run_dir import is_write_failure

    run_dir = str(tmp_path / "run")
    assert is_write_failure(OSError(errno.ENOSPC, "No space left on device"), run_dir)
    assert is_write_failure(PermissionError(errno.EACCES, "Permission denied", os.path.join(run_dir, "x.pt")),
                            run_dir)
    assert not is_write_failure(PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "data.jsonl")),
                                run_dir)  # an unreadable input is a bad input, not an unwritable run directory


# ---- nothing written through a link -------------------------------------------------------------------------------
def _train_in_process(run_dir, capsys, *extra):
    # One short step if the refusal were missing (the run would then write through the link and the test fail).
    code = main(["train", *TINY, f"run_dir={run_dir}", "trainer.max_steps=1", "trainer.val_every=0",
                 "data.heldout_size=2", "eval.n_samples=1", "warmup.max_steps=1", *extra])
    return code, capsys.readouterr().err


def _one_error(err):
    lines = [line for line in err.splitlines() if line.startswith("nemo-dapo train: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("kind", ["symlink", "dangling-symlink", "hardlink", "fifo", "directory"])
def test_a_lock_that_is_not_a_plain_file_is_refused_and_its_target_untouched(tmp_path, capsys, kind):
    run_dir, victim = tmp_path / "run", tmp_path / "victim.txt"
    run_dir.mkdir()
    victim.write_text("precious\n")
    lock = run_dir / LOCK_FILE
    if kind == "symlink":
        lock.symlink_to(victim)
    elif kind == "dangling-symlink":
        lock.symlink_to(tmp_path / "created-through-the-link")
    elif kind == "hardlink":
        os.link(victim, lock)
    elif kind == "fifo":
        os.mkfifo(lock)
    else:
        lock.mkdir()
    code, err = _train_in_process(run_dir, capsys)
    assert code == 2, err
    line = _one_error(err)
    assert str(lock) in line and "rm " in line and "not a lock file" in line
    assert victim.read_text() == "precious\n" and not (tmp_path / "created-through-the-link").exists()
    assert os.path.lexists(lock)  # left in place for the user to inspect: not hidden by a removal
    assert kind != "symlink" or os.readlink(lock) == str(victim)
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "config.yaml").exists()


def test_release_removes_only_its_own_lock_file(tmp_path):
    lock = RunDirLock(str(tmp_path)).acquire()
    os.unlink(tmp_path / LOCK_FILE)  # someone replaces the name while the run holds the lock
    os.symlink(tmp_path / "elsewhere", tmp_path / LOCK_FILE)
    lock.release()
    assert os.path.islink(tmp_path / LOCK_FILE)  # not removed: it is not the file this run locked


def test_a_checkpoints_link_into_a_live_run_is_refused_naming_that_run(tmp_path, capsys):
    live, mine = tmp_path / "live", tmp_path / "mine"
    (live / "checkpoints").mkdir(parents=True)
    (live / "checkpoints" / "step_00000003.pt").write_bytes(b"the live run's checkpoint")
    mine.mkdir()
    (mine / "checkpoints").symlink_to(live / "checkpoints")
    with RunDirLock(str(live)):  # the other run is training
        code, err = _train_in_process(mine, capsys)
    assert code == 2, err
    line = _one_error(err)
    assert str(mine / "checkpoints") in line and f"run directory {str(live)!r}" in line
    assert f"in use by pid {os.getpid()}" in line and "rm " in line
    assert os.listdir(live / "checkpoints") == ["step_00000003.pt"]


@pytest.mark.parametrize("name", ["metrics.jsonl", "summary.json", "tb", os.path.join("plots", "reward.png")])
def test_any_link_where_the_run_writes_is_refused(tmp_path, capsys, name):
    run_dir, victim = tmp_path / "run", tmp_path / "victim"
    (run_dir / "plots").mkdir(parents=True)
    victim.write_text("precious\n")
    os.symlink(victim, run_dir / name)
    code, err = _train_in_process(run_dir, capsys)
    assert code == 2, err
    assert str(run_dir / name) in _one_error(err) and victim.read_text() == "precious\n"


def test_the_atomic_writer_never_writes_through_a_planted_temporary_name(tmp_path):
    from nemo_dapo.local.run_log import write_text

    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    os.symlink(victim, tmp_path / "summary.json.tmp")  # the fixed temporary name of an earlier version
    write_text(str(tmp_path / "summary.json"), "{}")
    assert victim.read_text() == "precious\n" and (tmp_path / "summary.json").read_text() == "{}"
    assert sorted(os.listdir(tmp_path)) == ["summary.json", "summary.json.tmp", "victim"]


# ---- resume decisions, unit by unit (the end-to-end tests above are slow) ------------------------------------------
def _save(directory, step, **state):
    state = state or {"loop": {"counters": {"rollout_steps": step}}, "rng": {}, "base_eval": {}}
    return ck.save_checkpoint(str(directory), step, state, keep_last=10)


def test_resume_takes_the_newest_checkpoint_and_moves_a_corrupt_one_aside(tmp_path):
    from nemo_dapo.local.run_dir import pick_checkpoint

    d = tmp_path / "checkpoints"
    paths = [_save(d, step) for step in (1, 2, 3)]
    path, state = pick_checkpoint(str(d))
    assert path == paths[2] and state["loop"]["counters"]["rollout_steps"] == 3
    with open(paths[2], "wb") as f:
        f.write(b"\0" * 100)  # a truncated newest file
    path, state = pick_checkpoint(str(d))
    assert path == paths[1] and state["loop"]["counters"]["rollout_steps"] == 2
    assert sorted(os.listdir(d)) == ["step_00000001.pt", "step_00000002.pt", "step_00000003.pt.corrupt"]


def test_a_checkpoint_without_the_train_entries_is_not_resumed(tmp_path):
    from nemo_dapo.local.run_dir import pick_checkpoint

    d = tmp_path / "checkpoints"
    first = _save(d, 1)
    _save(d, 2, model={})  # a file of another tool under our name: no loop / rng / base_eval
    assert pick_checkpoint(str(d))[0] == first
    assert os.path.isfile(ck.checkpoint_path(str(d), 2) + ".corrupt")


def test_resume_refuses_a_changed_seed_unless_allowed_and_ignores_a_raised_budget():
    from nemo_dapo.local.run_dir import ResumeMismatch, check_resume_config

    stored = {"run_dir": "runs/x", "seed": 1, "trainer": {"max_steps": 2}}
    with pytest.raises(ResumeMismatch, match=r"1 key\(s\) that change the run differ: seed: 1 -> 7"):
        check_resume_config(stored, {**stored, "seed": 7}, "step_00000002.pt", allow_change=False)
    check_resume_config(stored, {**stored, "seed": 7}, "step_00000002.pt", allow_change=True)  # --allow-config-change
    check_resume_config(stored, {**stored, "trainer": {"max_steps": 9}}, "step_00000002.pt", allow_change=False)


def test_a_run_counts_as_finished_only_at_its_last_step_under_the_same_budget(tmp_path):
    from nemo_dapo.local.run_dir import finished_summary

    (tmp_path / "summary.json").write_text(json.dumps({"rollout_steps": 2}))
    cfg = {"trainer": {"max_steps": 2, "max_samples": None, "max_time_s": None, "val_every": 1}}
    at = lambda step: {"loop": {"counters": {"rollout_steps": step}}}  # noqa: E731
    assert finished_summary(str(tmp_path), at(2), cfg, cfg) == {"rollout_steps": 2}
    assert finished_summary(str(tmp_path), at(2), cfg, {"trainer": {**cfg["trainer"], "val_every": 5}}) is not None
    for budget in ({"max_steps": 3}, {"max_samples": 100}, {"max_time_s": 60.0}):  # a raised budget continues it
        assert finished_summary(str(tmp_path), at(2), cfg, {"trainer": {**cfg["trainer"], **budget}}) is None, budget
    assert finished_summary(str(tmp_path), at(1), cfg, cfg) is None  # an older checkpoint: not the end


def test_a_diverged_run_is_refused_until_resumed_and_an_unreadable_record_counts_as_diverged(tmp_path):
    from nemo_dapo.local.run_dir import RunDiverged, check_diverged, record_divergence

    run_dir = str(tmp_path)
    assert check_diverged(run_dir, None, None, resume_diverged=False) == []
    (tmp_path / "diverged.json").write_text("{half a reco")  # never taken for a healthy run
    with pytest.raises(RunDiverged, match="diverged.json is unreadable"):
        check_diverged(run_dir, None, None, resume_diverged=False)
    record_divergence(run_dir, [{"step": 3, "reason": "entropy", "resumed": False}])
    with pytest.raises(RunDiverged, match=r"diverged at rollout step 3 \(entropy\).*--resume-diverged"):
        check_diverged(run_dir, None, "step_00000003.pt", resume_diverged=False)
    history = check_diverged(run_dir, None, "step_00000003.pt", resume_diverged=True)
    assert [(d["step"], d["resumed"]) for d in history] == [(3, True)]
    record_divergence(run_dir, history)
    assert check_diverged(run_dir, None, "step_00000003.pt", resume_diverged=False) == history  # resumed once: done
    os.unlink(tmp_path / "diverged.json")  # the checkpoint's own record still counts
    state = {"health": {"diverged": [{"step": 5, "reason": "skipped updates", "resumed": False}]}}
    with pytest.raises(RunDiverged, match="diverged at rollout step 5"):
        check_diverged(run_dir, state, "step_00000005.pt", resume_diverged=False)


def test_taking_over_a_lock_replaces_its_whole_contents(tmp_path):
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": 0,
                                                  "command": "nemo-dapo train " + "x" * 500}))
    with RunDirLock(str(tmp_path)):
        info = json.loads((tmp_path / LOCK_FILE).read_text())  # no tail of the longer old contents
    assert info["pid"] == os.getpid() and info["host"] == socket.gethostname()


def test_a_second_signal_during_a_step_stops_at_once():
    from nemo_dapo.local.run_dir import RunInterrupted, StopSignals

    with StopSignals() as stop:
        stop.defer(True)
        os.kill(os.getpid(), signal.SIGTERM)  # the first: noted, the step goes on
        assert stop.signum == signal.SIGTERM
        with pytest.raises(RunInterrupted) as e:
            os.kill(os.getpid(), signal.SIGINT)  # the second: at once
        assert e.value.exit_code == 130
        with pytest.raises(RunInterrupted) as e:
            stop.raise_if_requested()
        assert e.value.exit_code == 143


def test_a_link_inside_the_checkpoint_directory_is_refused(tmp_path):
    from nemo_dapo.local.run_dir import RunDirUnsafe, check_no_links

    (tmp_path / "checkpoints").mkdir()
    os.symlink(tmp_path / "elsewhere.pt", tmp_path / "checkpoints" / "step_00000003.pt")
    with pytest.raises(RunDirUnsafe, match=r"step_00000003.pt is a symbolic link"):
        check_no_links(str(tmp_path))
