"""The console handler follows sys.stderr: set up under one stream (a test's capture, later closed), it must still
write to the stream that is current when a line is logged."""
import errno
import io
import json
import logging
import os
import sys

import pytest

from nemo_dapo.local import run_log
from nemo_dapo.local.run_log import METRICS_FILE, RunLogger, log, read_metrics, setup_console_logging, write_text


def test_console_lines_go_to_the_current_stderr_after_the_first_is_closed(monkeypatch):
    saved = list(log.handlers)
    for h in saved:
        log.removeHandler(h)
    try:
        first = io.StringIO()
        monkeypatch.setattr(sys, "stderr", first)
        setup_console_logging()
        log.info("one")
        first.close()  # as pytest closes a captured stream after its test
        second = io.StringIO()
        monkeypatch.setattr(sys, "stderr", second)
        setup_console_logging()  # idempotent: keeps the handler made under the first stream
        log.info("two")
        assert second.getvalue().rstrip().endswith("I two"), second.getvalue()
        assert "Logging error" not in second.getvalue()
    finally:
        for h in list(log.handlers):
            log.removeHandler(h)
        for h in saved:
            log.addHandler(h)
        log.setLevel(logging.INFO)


class _DiskFull:
    """A file whose write stops half-way with ENOSPC, as a full disk does."""

    def __init__(self, f):
        self.f = f

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def write(self, text):
        self.f.write(text[:len(text) // 2])
        self.f.flush()
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_rewrite_that_fails_half_way_leaves_the_old_file_whole_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    write_text(str(path), '{"old": 1}')
    real = os.fdopen
    with monkeypatch.context() as m:
        m.setattr(run_log.os, "fdopen", lambda fd, *a, **k: _DiskFull(real(fd, *a, **k)))
        with pytest.raises(OSError, match="No space left"):
            write_text(str(path), '{"new": 2}' * 100)
    assert path.read_text() == '{"old": 1}' and os.listdir(tmp_path) == ["summary.json"]


def test_a_rewrite_is_synced_to_disk_before_and_after_its_rename(tmp_path, monkeypatch):
    """The file's data before the rename and the directory after it, as checkpoints are: a crash right after
    write_text returns must not leave summary.json empty or missing."""
    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", "dir" if os.path.isdir(f"/proc/self/fd/{fd}") else os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(run_log.os, "replace", lambda a, b: (events.append(("replace", b)), real_replace(a, b)))
    write_text(str(tmp_path / "summary.json"), '{"done": 1}')
    assert [e[0] for e in events] == ["fsync", "replace", "fsync"]
    assert events[0][1].endswith(".tmp") and events[2][1] == "dir"
    assert (tmp_path / "summary.json").read_text() == '{"done": 1}'


def test_resume_keeps_the_records_up_to_its_step_and_a_fresh_run_starts_a_fresh_log(tmp_path):
    logger = RunLogger(str(tmp_path), tensorboard=False)
    for step in (0, 1, 2, 3):
        logger.write("train", step, {"x": step})
    logger.close()
    RunLogger(str(tmp_path), resume_step=2, tensorboard=False).close()  # steps after the checkpoint are replayed
    assert [(r["kind"], r["step"]) for r in read_metrics(str(tmp_path))] == [("train", 0), ("train", 1), ("train", 2)]
    logger = RunLogger(str(tmp_path), resume_step=2, tensorboard=False)
    logger.write("final", 2, {"acc": 0.5})  # a finished run, continued with a raised budget: its final record goes
    logger.close()
    RunLogger(str(tmp_path), resume_step=2, tensorboard=False).close()
    assert [r["kind"] for r in read_metrics(str(tmp_path))] == ["train"] * 3
    RunLogger(str(tmp_path), tensorboard=False).close()  # no checkpoint to resume: a fresh log
    assert read_metrics(str(tmp_path)) == []


def test_each_record_is_on_disk_when_written_and_non_finite_values_are_null(tmp_path):
    logger = RunLogger(str(tmp_path), tensorboard=False)
    try:
        logger.write("train", 1, {"loss": float("nan"), "grad_norm": float("inf"), "reward": 0.5})
        rec = json.loads((tmp_path / METRICS_FILE).read_text(), parse_constant=lambda c: pytest.fail(c))
    finally:
        logger.close()  # a killed run loses no written line: read back before close
    assert (rec["loss"], rec["grad_norm"], rec["reward"]) == (None, None, 0.5)
