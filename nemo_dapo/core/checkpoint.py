"""Atomic, keep-last-k training checkpoints (torch.save of one dict per step) and RNG-state capture.

A checkpoint is ``<dir>/step_<NNNNNNNN>.pt``. It is written to a temporary file in the same directory, flushed and
fsync'ed, then renamed over the final name with ``os.replace`` (atomic on POSIX), and the directory is fsync'ed so
the rename itself survives a crash. A process killed at any instant therefore leaves either the previous set of
checkpoints or the new one, never a truncated file under a final name; stray temporary files are ignored and
cleaned up by the next save.

Directories (a saved model, the warm-up cache) are written the same way by :func:`atomic_directory`: into
``<dir>.tmp``, files fsync'ed, then swapped in whole.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import pickle
import random
import re
import shutil
import tempfile
from typing import Iterator, Optional

import torch

from nemo_dapo.core.durable import fsync_dir

_NAME = re.compile(r"^step_(\d+)\.pt$")
_TMP_PREFIX = ".tmp_step_"


def checkpoint_path(directory: str, step: int) -> str:
    return os.path.join(directory, f"step_{step:08d}.pt")


def list_checkpoints(directory: str) -> list:
    """[(step, path)] of the complete checkpoints in ``directory``, oldest first ([] if it does not exist)."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        m = _NAME.match(name)
        if m:
            found.append((int(m.group(1)), os.path.join(directory, name)))
    return sorted(found)


def latest_checkpoint(directory: str) -> Optional[str]:
    ckpts = list_checkpoints(directory)
    return ckpts[-1][1] if ckpts else None


@contextlib.contextmanager
def atomic_directory(directory: str) -> Iterator[str]:
    """``with atomic_directory(d) as tmp:`` write the new content into ``tmp`` (``d + ".tmp"``, fresh); on a clean
    exit it replaces ``d`` in one step. Until then ``d`` keeps its old content, whole; a writer that fails or is
    killed leaves ``d`` as it was (a killed one also leaves ``tmp``, which the next writer removes first)."""
    tmp = directory + ".tmp"
    _remove(tmp)  # a leftover of a killed writer (a planted link is unlinked, never followed)
    try:
        yield tmp
        _fsync_tree(tmp)
    except BaseException:
        _remove(tmp)
        raise
    _swap_in(tmp, directory)
    fsync_dir(os.path.dirname(os.path.abspath(directory)))


def _remove(path: str) -> None:
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def _fsync_tree(root: str) -> None:
    for here, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(here, name), os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(here)


def _swap_in(tmp: str, directory: str) -> None:
    """Move the complete ``tmp`` to ``directory``; an existing ``directory`` is exchanged with it in one rename
    (Linux renameat2 RENAME_EXCHANGE) and then removed; elsewhere it is set aside, replaced, then removed."""
    if not os.path.isdir(directory) or os.path.islink(directory):
        os.replace(tmp, directory)  # nothing to keep (a file or a link in the way makes this fail, naming it)
    elif _exchange(tmp, directory):
        shutil.rmtree(tmp)  # now the old content
    else:
        aside = directory + ".old"
        _remove(aside)
        os.replace(directory, aside)
        os.replace(tmp, directory)
        shutil.rmtree(aside)


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically; False where the system or the filesystem cannot."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), b)


def save_checkpoint(directory: str, step: int, state: dict, *, keep_last: int = 2) -> str:
    """Write ``state`` as the checkpoint of ``step`` atomically; keep only the newest ``keep_last``. Returns the path.

    ``keep_last`` >= 1. Older checkpoints are deleted only after the new one is durable.
    """
    if not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last must be an int >= 1 (checkpoints to keep), got {keep_last!r}")
    os.makedirs(directory, exist_ok=True)
    final = checkpoint_path(directory, step)
    fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=".pt", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError) and not isinstance(e.filename, str):  # a failed write() names no file
            raise OSError(e.errno, e.strerror or str(e), final) from e
        raise
    fsync_dir(directory)
    for _, old in list_checkpoints(directory)[:-keep_last]:
        os.unlink(old)
    for name in os.listdir(directory):  # leftovers of a save that was killed mid-write
        if name.startswith(_TMP_PREFIX):
            os.unlink(os.path.join(directory, name))
    return final


def load_checkpoint(path: str) -> dict:
    """The state dict saved at ``path`` (tensors on CPU)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist; list the run's checkpoints/ directory or "
                                "start without resuming")
    with open(path, "rb") as f:
        return safe_load(f, what=f"checkpoint {path!r}")


def safe_load(f, *, what: str):
    """``torch.load`` that never runs code from the file (a planted ``step_*.pt`` must not execute on resume):
    tensors, containers, numbers, strings and the project's own ``RolloutBatch`` / ``Group`` (the filler's groups)."""
    from nemo_dapo.core.dynamic_sampling import Group
    from nemo_dapo.core.types import RolloutBatch

    try:
        with _allowing([RolloutBatch, Group]):
            return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        if not found:  # the weights-only unpickler met bytes that are no pickle at all: damage, not a foreign file
            raise CorruptCheckpoint(f"{what} is corrupt ({_first_line(e)})") from None
        raise CheckpointError(f"{what} holds objects other than tensors and plain data (it references "
                              f"{found.group(1)}), so it was not written by nemo_dapo and is not loaded (nothing in "
                              "it was run). Delete it or resume from another checkpoint.") from None
    except (EOFError, RuntimeError, OSError, ValueError) as e:
        # EOFError: empty file; RuntimeError: the zip container is cut short; OSError/ValueError: bad offsets.
        raise CorruptCheckpoint(f"{what} is truncated or corrupt ({type(e).__name__}: {_first_line(e)})") from None


def _allowing(classes: list):
    """A context in which ``torch.load(weights_only=True)`` accepts ``classes``. torch >= 2.5 scopes the allowlist to
    the context (``safe_globals``); torch 2.4 (the trainer image: PyTorch 24.07) has only the process-wide
    ``add_safe_globals``, which is harmless for the project's own dataclasses."""
    scoped = getattr(torch.serialization, "safe_globals", None)
    if scoped is not None:
        return scoped(classes)
    torch.serialization.add_safe_globals(classes)
    return contextlib.nullcontext()


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else "empty"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded safely or is not ours."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint file that is damaged (truncated, zeroed, not a torch file): resume may fall back past it."""


def rng_state() -> dict:
    """The process-global RNG states that can influence training: torch CPU (and CUDA if used) and Python."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
