"""Run logging: one JSON line per record in ``metrics.jsonl``, TensorBoard scalars, and a one-line console summary.

Records carry ``kind`` ("train", "val", "eval") and ``step`` (the rollout step). On resume, records after the
checkpoint's step are dropped from the JSONL file (they belong to the part of the run that is replayed), and the
TensorBoard writer purges them too, so a resumed run's logs read as if it had never been interrupted.
"""
from __future__ import annotations

import json
import logging as _logging
import math
import os
import sys
import time
from typing import Optional

from nemo_dapo.core.durable import fsync_dir

log = _logging.getLogger("nemo_dapo")

METRICS_FILE = "metrics.jsonl"

# Console columns: (label, metric key, format).
_CONSOLE = (
    ("reward", "train/reward", "{:+.3f}"),
    ("acc", "train/acc", "{:.3f}"),
    ("val", "val/accuracy", "{:.3f}"),
    ("ent", "actor/entropy", "{:.3f}"),
    ("len", "response/length_mean", "{:.1f}"),
    ("pass", "filter/pass_rate", "{:.2f}"),
    ("gen", "filter/num_gen_batches", "{:.0f}"),
    ("clip", "actor/clip_frac_high", "{:.3f}"),
    ("step_s", "timing/step_s", "{:.1f}"),
)


class _CurrentStderr(_logging.StreamHandler):
    """A stream handler on whatever ``sys.stderr`` is at each record, not the one it was made with: the handler
    outlives a redirect (a test's captured stderr, closed afterwards), and writing to a closed stream loses lines."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


def setup_console_logging(level: int = _logging.INFO) -> None:
    """Plain ``HH:MM:SS message`` lines on stderr for the ``nemo_dapo`` logger (idempotent)."""
    if any(getattr(h, "_nemo_dapo", False) for h in log.handlers):
        return
    handler = _CurrentStderr()
    handler.setFormatter(_logging.Formatter("%(asctime)s %(levelname).1s %(message)s", "%H:%M:%S"))
    handler._nemo_dapo = True
    log.addHandler(handler)
    log.setLevel(level)
    log.propagate = False


def write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically and durably; on failure (disk full) no temporary file is left behind."""
    # A fresh name, created exclusively: a file or link planted under a fixed temporary name is never written through.
    tmp = f"{path}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)  # mode as open() gives, by umask
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())  # else a crash soon after the rename can leave the final name empty
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))  # the rename itself, as core/checkpoint.py does


def write_json(path: str, obj: dict) -> None:
    write_text(path, json.dumps(obj, indent=1))


def read_metrics(run_dir: str, kind: Optional[str] = None) -> list:
    """Records of ``run_dir/metrics.jsonl`` (optionally of one kind), in file order."""
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no {METRICS_FILE} in {run_dir!r}: is this a run directory written by "
                                "`nemo-dapo train`?")
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                # A process killed mid-write can leave a partial last line; anything else is corruption.
                log.warning("%s line %d is not valid JSON (interrupted write?); skipped", path, n)
                continue
            if kind is None or rec.get("kind") == kind:
                out.append(rec)
    return out


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN/inf
    return v


class RunLogger:
    """Writes metrics of one run directory. ``resume_step``: keep only records with step <= it."""

    def __init__(self, run_dir: str, *, resume_step: Optional[int] = None, tensorboard: bool = True,
                 total_steps: Optional[int] = None, total_samples: Optional[int] = None):
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir, self.total_steps, self.total_samples = run_dir, total_steps, total_samples
        self.path = os.path.join(run_dir, METRICS_FILE)
        self._t0 = time.time()
        self._truncate(resume_step)
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is an optional extra of the CPU path
                log.warning("tensorboard is not installed; metrics go to %s only", self.path)
            else:
                purge = None if resume_step is None else resume_step + 1
                self._tb = SummaryWriter(os.path.join(run_dir, "tb"), purge_step=purge)

    def _truncate(self, resume_step: Optional[int]) -> None:
        if not os.path.isfile(self.path):
            return
        if resume_step is None:
            os.unlink(self.path)  # a fresh run in an existing directory starts a fresh log
            return
        keep = []
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if rec.get("step", 0) <= resume_step and rec.get("kind") != "final":
                    keep.append(json.dumps(rec) + "\n")
        write_text(self.path, "".join(keep))

    def write(self, kind: str, step: int, metrics: dict) -> None:
        rec = {"kind": kind, "step": int(step), "wall_s": round(time.time() - self._t0, 3)}
        rec.update({k: _clean(float(v)) if isinstance(v, (int, float)) else v for k, v in metrics.items()})
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(float(v)):
                    self._tb.add_scalar(k if "/" in k else f"{kind}/{k}", float(v), int(step))

    def console(self, step: int, metrics: dict, elapsed_s: float) -> None:
        parts = [f"step {step}" + (f"/{self.total_steps}" if self.total_steps else "")]
        for label, key, fmt in _CONSOLE:
            if key in metrics and metrics[key] is not None and math.isfinite(float(metrics[key])):
                parts.append(f"{label} {fmt.format(float(metrics[key]))}")
        if self.total_samples and "counters/consumed_samples" in metrics:
            parts.append(f"responses {int(metrics['counters/consumed_samples'])}/{self.total_samples}")
        parts.append(f"t {int(elapsed_s) // 60:02d}:{int(elapsed_s) % 60:02d}")
        log.info(" | ".join(parts))

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
