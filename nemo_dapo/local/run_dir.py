"""The run directory as a small database: one writer at a time, resume that checks what it resumes, clean stops.

* :class:`RunDirLock`: ``run_dir/.lock`` held with ``fcntl.flock`` for the whole job. The kernel drops the lock when
  its process dies (SIGKILL included), so a lock file left by a killed run is recognised as stale by simply taking
  the lock; the file's contents (pid, host, start time, command) only serve the messages.
* :func:`pick_checkpoint`: the newest checkpoint that loads; a corrupt or truncated one is named, moved aside as
  ``step_*.pt.corrupt`` and the previous one is used. A file that is not ours (foreign pickle globals) stops the job.
* :func:`config_drift`: the keys in which the resolved config differs from the one stored in the checkpoint,
  leaving out those that do not change what is trained (budgets, logging, evaluation, engine plumbing).
* :class:`StopSignals`: SIGINT / SIGTERM during the RL steps ask for a stop at the end of the current rollout step
  (after its optimizer updates, with a checkpoint of that step); outside the steps (warm-up, evaluation) and on a
  second signal they stop at once, and the run resumes from its last checkpoint.

* :func:`check_no_links`: nothing the run writes is a symbolic link (nor is ``.lock``, opened with ``O_NOFOLLOW``
  and refused unless it is a plain file): a shared run directory cannot make the run write outside itself.
* :func:`check_diverged`: a run that stopped for divergence (exit 7) is recorded so (``diverged.json`` and its last
  checkpoint); a rerun refuses to continue it unless given ``--resume-diverged``, and it stays marked.

Exit codes (``nemo_dapo/exit_codes.py``) of the errors raised here: :data:`EXIT_BUSY`, :data:`EXIT_UNWRITABLE`,
:data:`EXIT_DIVERGED` for a rerun of a diverged run, and 128 + the signal number for a signal stop (130 SIGINT,
143 SIGTERM).
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shlex
import signal
import socket
import stat
import sys
import threading
import time
from typing import Optional

from nemo_dapo.exit_codes import EXIT_BUSY, EXIT_DIVERGED, EXIT_UNWRITABLE
from nemo_dapo.local.config import ConfigError
from nemo_dapo.core.checkpoint import CheckpointError, CorruptCheckpoint, list_checkpoints, load_checkpoint

log = logging.getLogger("nemo_dapo")

LOCK_FILE = ".lock"

# Keys that may differ between a checkpoint and the resumed run: they do not change what is trained. Entries ending
# in "." cover a whole section. Everything else (seed, data, model, warm-up, algorithm, reward, rollout sampling,
# optimizer, batch sizes) must match, or the run would silently continue as a different experiment.
RESUME_SAFE_KEYS = (
    "name", "run_dir", "resume",
    "trainer.max_steps", "trainer.max_samples", "trainer.max_time_s",  # budgets: resuming to train longer
    "trainer.val_every", "trainer.val_samples", "trainer.val_problems", "trainer.save_every", "trainer.keep_last",
    "trainer.threads", "trainer.cpus", "trainer.tensorboard", "trainer.plots", "reward.num_workers",
    "rollout.server.python", "rollout.server.address", "rollout.server.connect_timeout_s",
    "rollout.server.request_timeout_s", "rollout.server.weight_timeout_s", "rollout.server.bucket_mb",
    "rollout.server.sleep_level", "rollout.server.threads", "rollout.server.cpus", "rollout.server.weight_transport",
    "eval.",  # the final evaluation only (a warning says that the stored base evaluation used the old keys)
)
BUDGET_KEYS = ("trainer.max_steps", "trainer.max_samples", "trainer.max_time_s")


class RunDirError(Exception):
    """A run-directory condition that stops ``nemo-dapo train`` with ``exit_code`` and one message."""

    exit_code = 2


class RunDirBusy(RunDirError):
    exit_code = EXIT_BUSY


class RunDirUnwritable(RunDirError):
    exit_code = EXIT_UNWRITABLE


class RunDirUnsafe(RunDirError):
    """An entry of the run directory is a link (or not a plain file) where the run writes: refused (exit 2)."""


class ResumeMismatch(ConfigError):
    """The resolved config differs from the checkpoint's in keys that change the run (exit 2, as config errors)."""


class RunInterrupted(RunDirError):
    """SIGINT / SIGTERM stopped the job; ``checkpoint`` is what a rerun resumes from (None: nothing saved yet)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.checkpoint, self.step = signum, None, None

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name
        if self.checkpoint is None:
            where = "before the first checkpoint (a finished warm-up stays cached in base_model/)"
        else:
            where = f"at rollout step {self.step}; checkpoint {self.checkpoint}"
        return f"interrupted by {name} {where}. Resume with the same command: {command_line()}"


def command_line() -> str:
    """This process's command as a user would retype it (``python -m nemo_dapo.cli`` is ``nemo-dapo``)."""
    return shlex.join(["nemo-dapo", *sys.argv[1:]])


# ---- one writer at a time -----------------------------------------------------------------------------------------
def _holder_text(info: dict) -> str:
    started = info.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return (f"pid {info.get('pid', '?')} on host {info.get('host', '?')} (started {when}: "
            f"{info.get('command', '?')})")


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError):
        return True  # exists but not ours, or unreadable: assume alive
    return True


def _same_file(fd: int, path: str) -> bool:
    """Whether ``path`` (not followed if a link) is the file open as ``fd``."""
    a, b = os.fstat(fd), os.lstat(path)
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _kind(path: str) -> str:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return f"a symbolic link to {os.path.realpath(path)!r}"
    if stat.S_ISREG(st.st_mode):
        return f"a file with {st.st_nlink} hard links"
    return "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"


def _unsafe(path: str, fix: str) -> "RunDirUnsafe":
    return RunDirUnsafe(f"{path} is {_kind(path)}, not a lock file of nemo-dapo: it is not written through (that "
                        f"would change another file) and left in place. Fix: check who put it there, remove it "
                        f"(rm {shlex.quote(path)}) and rerun, or {fix}")


class RunDirLock:
    """Exclusive lock on a run directory for one ``train`` job (a context manager)."""

    def __init__(self, run_dir: str, *, what: str = "run directory", fix: str = "give this run another run_dir=..."):
        self.run_dir, self.path, self.fd = run_dir, os.path.join(run_dir, LOCK_FILE), None
        self.what, self.fix = what, fix  # the messages: what the directory is, how to use another one

    def _read(self, fd: int) -> dict:
        os.lseek(fd, 0, os.SEEK_SET)
        raw = os.read(fd, 65536)
        try:
            info = json.loads(raw.decode("utf-8")) if raw.strip() else {}
        except (UnicodeDecodeError, json.JSONDecodeError):
            info = {"pid": "?", "host": "?", "command": f"unreadable lock file ({len(raw)} bytes)"}
        return info if isinstance(info, dict) else {}

    def _open(self) -> int:
        """The lock file, opened without following a link (a planted ``.lock`` symlink is never written through);
        anything but a plain file with one name is refused (:class:`RunDirUnsafe`)."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS) or not os.path.lexists(self.path):
                raise
            raise _unsafe(self.path, self.fix) from None  # a link (ELOOP), a directory, a socket, ...
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            os.close(fd)
            raise _unsafe(self.path, self.fix)
        return fd

    def acquire(self) -> "RunDirLock":
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                info = self._read(fd)
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise  # a filesystem without locks: reported as the OSError it is
                raise RunDirBusy(f"{self.what} {self.run_dir!r} is in use by {_holder_text(info)}. Wait for it "
                                 "to finish or stop it (it saves a checkpoint on SIGTERM/Ctrl-C), or "
                                 f"{self.fix}") from None
            # The previous holder may have unlinked the file between our open and flock: lock the current file.
            try:
                same = _same_file(fd, self.path)
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        previous = self._read(fd)
        if previous:
            gone = previous.get("host") == socket.gethostname() and not _pid_alive(previous.get("pid"))
            log.warning("run directory %s: taking over the stale lock of %s%s", self.run_dir, _holder_text(previous),
                        ": that process is gone" if gone else ": its lock was released without cleanup")
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
              "command": command_line()}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps(me).encode())
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            if _same_file(self.fd, self.path):  # never remove what another hand put under the name meanwhile
                os.unlink(self.path)  # unlink while still locked: a waiter re-checks the inode (see acquire)
        except OSError:
            pass
        os.close(self.fd)  # closing drops the flock
        self.fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


# ---- nothing written through a link -------------------------------------------------------------------------------
# What `train` writes in its run directory, and the directories whose files it writes by fixed names. A link there
# (planted by anyone who can write a shared run directory, or left by a user) would make the run write outside its
# own directory: into another file, or into another run's checkpoints.
WRITTEN = ("checkpoints", "metrics.jsonl", "tb", "plots", "final_model", "final_model.tmp", "summary.json",
           "config.yaml", "diverged.json", "base_model.tmp")
WRITTEN_INSIDE = ("checkpoints", "tb", "plots")


def check_no_links(run_dir: str) -> None:
    """Refuse (:class:`RunDirUnsafe`, exit 2) a run directory in which an entry the run writes is a symbolic link;
    a ``checkpoints/`` that leads into another run directory names that run (and its holder, if one is live)."""
    for name in WRITTEN:
        path = os.path.join(run_dir, name)
        inside = [os.path.join(path, n) for n in _listdir(path)] if name in WRITTEN_INSIDE else []
        for p in [path] + inside:
            if os.path.islink(p):
                raise RunDirUnsafe(f"{p} is a symbolic link to {os.path.realpath(p)!r}{_owner(p)}: a run writes only "
                                   "inside its own run directory, and through a link it would write into another "
                                   "file or run (two runs training into one checkpoint directory). Fix: remove the "
                                   f"link (rm {shlex.quote(p)}) and rerun; to keep a run on another disk, put its "
                                   "whole run_dir there")


def _listdir(path: str) -> list:
    return os.listdir(path) if os.path.isdir(path) and not os.path.islink(path) else []


def _owner(link: str) -> str:
    """', which is in run directory D (in use by ...)' when the link's target lies in another run directory."""
    target = os.path.realpath(link)
    for d in (target, os.path.dirname(target)):
        lock = os.path.join(d, LOCK_FILE)
        if os.path.isfile(lock) and not os.path.islink(lock):
            try:
                with open(lock, encoding="utf-8") as f:
                    info = json.load(f)
            except (OSError, ValueError):
                info = {}
            holder = _holder_text(info) if isinstance(info, dict) and info else "a run whose lock is unreadable"
            return f", which is in run directory {d!r} (in use by {holder})"
        if os.path.isdir(os.path.join(d, "checkpoints")) and d != os.path.dirname(link):
            return f", which is in run directory {d!r}"
    return ""


# ---- a diverged run stays diverged ----------------------------------------------------------------------------------
DIVERGED_FILE = "diverged.json"


class RunDiverged(RunDirError):
    """The run directory holds a diverged run and the user did not ask to continue it."""

    exit_code = EXIT_DIVERGED


def read_divergence(run_dir: str) -> list:
    """The divergences recorded in ``run_dir/diverged.json``: [{step, reason, checkpoint, time, resumed}] ([] when
    there is none). An unreadable file counts as one unresolved divergence: it is never taken for a healthy run."""
    path = os.path.join(run_dir, DIVERGED_FILE)
    if not os.path.lexists(path):
        return []
    try:
        with open(path, encoding="utf-8") as f:
            found = json.load(f).get("divergences")
        if isinstance(found, list) and all(isinstance(d, dict) for d in found):
            return found
    except (OSError, ValueError, AttributeError):
        pass
    return [{"step": None, "reason": f"{path} is unreadable", "resumed": False}]


def record_divergence(run_dir: str, history: list) -> None:
    """Write ``history`` (every divergence of the run, the latest last) to ``run_dir/diverged.json`` atomically."""
    from nemo_dapo.local.run_log import write_json

    write_json(os.path.join(run_dir, DIVERGED_FILE), {"divergences": history})


def check_diverged(run_dir: str, state: Optional[dict], checkpoint: Optional[str], *, resume_diverged: bool) -> list:
    """The run's divergence history (from the checkpoint and ``diverged.json``); refuses (:class:`RunDiverged`) to
    continue a run with an unresolved divergence unless ``resume_diverged``, which marks it resumed in the returned
    history (the caller writes it with :func:`record_divergence` once the resume goes ahead)."""
    history = [dict(d) for d in read_divergence(run_dir)]
    steps = {d.get("step") for d in history}
    saved = ((state or {}).get("health") or {}).get("diverged") or []
    history += [dict(d) for d in saved if d.get("step") not in steps]  # e.g. checkpoints copied without the file
    open_ = [d for d in history if not d.get("resumed")]
    if not open_:
        return history
    d = open_[-1]
    where = f"checkpoint {checkpoint}" if checkpoint else "its checkpoints are gone"
    if not resume_diverged:
        raise RunDiverged(f"run directory {run_dir!r} holds a run that diverged at rollout step {d.get('step')} "
                          f"({d.get('reason')}); it is not continued ({where}). Fix: start over with resume=never "
                          "or a new run_dir (e.g. with a lower optim.lr), or pass --resume-diverged to continue it "
                          "anyway (it stays marked diverged: an ablation never counts it)")
    for d in open_:
        d.update(resumed=True, resumed_at=time.time())  # the caller records it once the resume goes ahead
    log.warning("continuing a run that diverged at rollout step %s (--resume-diverged), from %s; it stays marked "
                "diverged in %s", d.get("step"), where, os.path.join(run_dir, DIVERGED_FILE))
    return history


# ---- what is resumed ----------------------------------------------------------------------------------------------
def pick_checkpoint(directory: str) -> tuple:
    """(path, state) of the newest checkpoint in ``directory`` that loads, or (None, None) if there is none.

    A corrupt or truncated file is renamed to ``<name>.corrupt`` (kept for inspection, out of the resume order) and
    the next older one is tried; when none is left the error names every corrupt file.
    """
    corrupt = []
    for _, path in reversed(list_checkpoints(directory)):
        try:
            state = load_checkpoint(path)
            if not (isinstance(state, dict) and {"loop", "rng", "base_eval"} <= set(state)):
                raise CorruptCheckpoint(f"checkpoint {path!r} is not a nemo-dapo train checkpoint (it lacks the "
                                        "loop / rng / base_eval entries)")
        except CorruptCheckpoint as e:
            os.replace(path, path + ".corrupt")
            corrupt.append(path)
            log.warning("%s; moved aside to %s.corrupt, falling back to the previous checkpoint", e, path)
            continue
        if corrupt:
            log.warning("resuming from %s, the newest intact checkpoint (skipped: %s)", path, ", ".join(corrupt))
        return path, state
    if corrupt:
        raise CheckpointError(f"no intact checkpoint in {directory!r}: {', '.join(corrupt)} could not be read "
                              "(moved aside as *.corrupt). Start over with resume=never or another run_dir")
    return None, None


def check_model_shapes(saved: dict, model: dict, checkpoint: str, *, has_config: bool) -> None:
    """Refuse (:class:`CheckpointError`, exit 2) to load ``checkpoint``'s weights ``saved`` into a model whose
    tensors ``model`` (name -> tensor) differ in names or shapes: it was trained for another model."""
    diffs = [f"{k}: {list(saved[k].shape)} in the checkpoint, {list(v.shape)} configured"
             for k, v in model.items() if k in saved and tuple(saved[k].shape) != tuple(v.shape)]
    diffs += [f"{k}: not in the checkpoint" for k in model if k not in saved]
    diffs += [f"{k}: not in the configured model" for k in saved if k not in model]
    if not diffs:
        return
    why = ("it holds no config (written by an older version), so the difference was not found before" if not
           has_config else "the config change was allowed, but the weights cannot follow it")
    shown = "; ".join(diffs[:3]) + ("; ..." if len(diffs) > 3 else "")
    raise CheckpointError(f"checkpoint {checkpoint} is of another model: {len(diffs)} of its tensors do not match "
                          f"the configured model's shapes ({shown}); "
                          f"{why}. Fix: resume it with the model keys it was trained with (model.*, "
                          "data.tokenizer_vocab_size, model.path), or start over with resume=never or a new run_dir")


def _flatten(tree, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and k != "extra":
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _safe(key: str) -> bool:
    return any(key == s or (s.endswith(".") and key.startswith(s)) for s in RESUME_SAFE_KEYS)


def config_drift(stored: dict, current: dict, *, all_keys: bool = False) -> list:
    """[(key, stored value, current value)] of the keys that differ (only run-changing ones unless ``all_keys``)."""
    a, b = _flatten(stored), _flatten(current)
    missing = "<absent>"
    return [(k, a.get(k, missing), b.get(k, missing)) for k in sorted(set(a) | set(b))
            if a.get(k, missing) != b.get(k, missing) and (all_keys or not _safe(k))]


def check_resume_config(stored: Optional[dict], current: dict, checkpoint: str, *, allow_change: bool) -> None:
    """Refuse (:class:`ResumeMismatch`) to resume ``checkpoint`` under a config that changes the run."""
    if stored is None:
        log.warning("checkpoint %s holds no config (older version): its config is not checked", checkpoint)
        return
    drift = config_drift(stored, current)
    changes = "; ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in drift)
    if drift and not allow_change:
        raise ResumeMismatch(
            f"run directory {current['run_dir']!r} holds checkpoint {checkpoint} of another configuration; "
            f"{len(drift)} key(s) that change the run differ: {changes}. Either train in a new run directory "
            "(run_dir=... or resume=never to start this one over), or pass --allow-config-change to continue this "
            "run under the new values")
    if drift:
        log.warning("resuming %s with changed keys (--allow-config-change): %s", checkpoint, changes)
    evals = [k for k, _, _ in config_drift(stored, current, all_keys=True) if k.startswith("eval.")]
    if evals:
        log.warning("eval keys changed on resume (%s): the stored base evaluation used the old values, so base and "
                    "final accuracy are not measured alike", ", ".join(evals))


def finished_summary(run_dir: str, state: dict, stored: Optional[dict], current: dict) -> Optional[dict]:
    """The run's summary.json if the checkpoint is the end of a finished run and no budget was raised, else None."""
    path = os.path.join(run_dir, "summary.json")
    if stored is None or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            summary = json.load(f)
    except (OSError, ValueError):
        return None  # unreadable: the run is finished again and the summary rewritten
    step = state["loop"]["counters"].get("rollout_steps")
    a, b = _flatten(stored), _flatten(current)
    if summary.get("rollout_steps") != step or any(a.get(k) != b.get(k) for k in BUDGET_KEYS):
        return None
    return summary


# ---- clean stops --------------------------------------------------------------------------------------------------
class StopSignals:
    """SIGINT/SIGTERM handlers for one job. Inside ``deferred()`` a first signal only sets ``signum`` (the caller
    stops at its next safe point); otherwise, or on a second signal, :class:`RunInterrupted` is raised at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum: Optional[int] = None
        self._defer, self._previous = False, {}

    def _handle(self, signum, frame):
        if self._defer and self.signum is None:
            self.signum = signum
            log.warning("%s received: stopping after the current rollout step, with a checkpoint (send it again to "
                        "stop at once and resume from the last checkpoint)", signal.Signals(signum).name)
            return
        raise RunInterrupted(signum)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread only
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def defer(self, on: bool) -> None:
        self._defer = on

    def raise_if_requested(self) -> None:
        if self.signum is not None:
            raise RunInterrupted(self.signum)


def is_write_failure(e: OSError, run_dir: str) -> bool:
    """Out of space anywhere, or no permission inside the run directory (an unreadable input file is not this)."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG):
        return True
    if e.errno in (errno.EACCES, errno.EPERM) and isinstance(e.filename, str):
        root = os.path.abspath(run_dir)
        return os.path.commonpath([root, os.path.abspath(e.filename)]) == root
    return False


def unwritable(e: OSError, run_dir: str, checkpoints: list) -> RunDirUnwritable:
    kept = ", ".join(os.path.basename(p) for _, p in checkpoints) or "none"
    return RunDirUnwritable(f"cannot write {e.filename or run_dir!r}: {e.strerror or e}. Nothing half-written was "
                            f"left; checkpoints kept intact in {run_dir!r}: {kept}. Free space or fix the "
                            "permissions, then rerun the same command to resume")
