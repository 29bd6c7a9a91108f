"""Durable renames: the directory entry of a file renamed into place survives a crash once its directory is fsync'ed.

Stdlib only, so that torch-free modules (the run log) write their files the way checkpoints are written.
"""
from __future__ import annotations

import os


def fsync_dir(directory: str) -> None:
    """fsync ``directory`` so that a rename into it is on disk; a no-op where the filesystem cannot open one."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some filesystems do not allow opening a directory; the rename is still atomic there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
