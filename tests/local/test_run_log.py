"""The console handler follows sys.stderr: set up under one stream (a test's capture, later closed), it must still
write to the stream that is current when a line is logged."""
import io
import logging
import sys

from nemo_dapo.local.run_log import log, setup_console_logging


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
