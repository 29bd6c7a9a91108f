"""``nemo-dapo ablate``: the DAPO paper's progressive table (Table 1) at toy scale, by one command.

Every row is a list of ``key=value`` overrides over one base recipe, built from :data:`TECHNIQUES`; every row x seed
is one ``nemo-dapo train`` subprocess in ``OUT/<row>/seed<k>``, all starting from the same base model
(``OUT/base_model``, warmed once), all stopped by the same budget of generated responses (``trainer.max_samples``).
``--jobs`` runs go side by side, one core each (``rollout.processes=1``).

Rerunning the same command skips finished runs (``summary.json`` present and ``config.yaml`` equal to the planned
config), resumes killed ones from their checkpoints (``train`` does that by itself), and refuses when the base
recipe, the overrides, the budget, the base model or a row's definition differ from ``OUT/ablation.json``.
The report (``OUT/ablation.md``, ``OUT/ablation.png``, ``OUT/ablation.json``) is written by ablate_report.py.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Optional

from nemo_dapo.exit_codes import EXIT_CODES, EXIT_RUNS_FAILED
from nemo_dapo.local.config import ArgumentError, ConfigError
from nemo_dapo.local.run_log import write_json

# The paper's techniques in the order Table 1 adds them: (name, table label, {key: (value off, value on)}).
# The table is cumulative ("+ X" adds X to the row above; no row takes a technique away), so Overlong Filtering stays
# on in the later rows, DAPO's row included: the paper's 50 is the last row of that table. (The reference code's
# best run used the punishment without the filter; that is the leave-one-out row `dapo-overlong_filter`.)
# The dual clip (clip_c) is not one of the paper's techniques (the reference scripts add it): it is off in every row,
# so that rows differ only in what the paper ablates.
TECHNIQUES = (
    ("overlong_filter", "+ overlong filtering", {"algorithm.overlong_filter": (False, True)}),
    ("clip_higher", "+ clip-higher", {"algorithm.eps_high": (0.2, 0.28)}),
    ("soft_overlong", "+ soft overlong punishment", {"algorithm.overlong.enabled": (False, True)}),
    ("token_level", "+ token-level loss", {"algorithm.agg": ("seq-mean-token-mean", "token-mean")}),
    ("dynamic_sampling", "+ dynamic sampling (DAPO)", {"algorithm.dynamic_sampling.enabled": (False, True)}),
)
COMMON = {"algorithm.eps_low": 0.2, "algorithm.clip_c": None}  # every row: symmetric low side, no dual clip
SKIP_KEY = "algorithm.dynamic_sampling.skip_history.enabled"  # the `dapo+skip` row; only if the config has it

PROGRESSIVE = ["grpo"] + [f"+{name}" for name, _, _ in TECHNIQUES[:-1]] + ["dapo"]
LEAVE_ONE_OUT = [f"dapo-{name}" for name, _, _ in TECHNIQUES]
EXTRA = ["dapo+skip"]
# Keys every run gets from the ablation itself (a user override of one would break the comparison).
RUN_KEYS = ("seed", "run_dir", "name", "resume", "model.path", "trainer.max_samples", "trainer.max_steps",
            "trainer.max_time_s")


def row_settings(row: str) -> dict:
    """{config key: value} of ``row``: every technique key set, on or off (so the base recipe cannot leak in)."""
    if row in PROGRESSIVE:
        on = {name for name, _, _ in TECHNIQUES[:PROGRESSIVE.index(row)]} if row != "dapo" else _all()
    elif row in LEAVE_ONE_OUT:
        on = _all() - {row[len("dapo-"):]}
    elif row == "dapo+skip":
        return {**row_settings("dapo"), SKIP_KEY: True}
    else:
        raise ArgumentError(f"--rows: unknown row {row!r}. Rows: {', '.join(PROGRESSIVE + LEAVE_ONE_OUT + EXTRA)}")
    out = dict(COMMON)
    for name, _, keys in TECHNIQUES:
        out.update({k: pair[name in on] for k, pair in keys.items()})
    return out


def _all() -> set:
    return {name for name, _, _ in TECHNIQUES}


def _yaml(v) -> str:
    return "null" if v is None else "true" if v is True else "false" if v is False else str(v)


def row_overrides(row: str) -> list:
    return [f"{k}={_yaml(v)}" for k, v in row_settings(row).items()]


def row_label(row: str) -> str:
    if row == "grpo":
        return "naive GRPO"
    if row in PROGRESSIVE:
        return dict((f"+{n}", label) for n, label, _ in TECHNIQUES).get(row, TECHNIQUES[-1][1])
    if row in LEAVE_ONE_OUT:
        return f"DAPO without {row[len('dapo-'):].replace('_', ' ')}"
    return "DAPO + history-based prompt skipping"


def row_technique(row: str) -> str:
    """The technique a row is about (its mechanism metric follows from it): added, removed, or ``grpo``."""
    if row == "dapo":
        return "dynamic_sampling"
    if row == "dapo+skip":
        return "skip_history"
    return row.lstrip("+")[len("dapo-"):] if row.startswith("dapo-") else row.lstrip("+")


def reserved_keys() -> set:
    keys = set(RUN_KEYS) | {SKIP_KEY}
    for row in PROGRESSIVE + LEAVE_ONE_OUT:
        keys |= set(row_settings(row))
    return keys


def parse_rows(text: Optional[str], leave_one_out: bool) -> list:
    """The rows named by ``--rows`` (None: the progressive table), plus the leave-one-out rows if asked for."""
    rows = list(PROGRESSIVE) if text is None else [r.strip() for r in text.split(",") if r.strip()]
    if not rows:  # `--rows "$ROWS"` with ROWS unset must not start the whole default table
        raise ArgumentError(f"--rows {text!r} names no row. Fix: name rows separated by commas, e.g. --rows "
                            f"grpo,dapo, or leave --rows out for the progressive table; rows: "
                            f"{', '.join(PROGRESSIVE + LEAVE_ONE_OUT + EXTRA)}")
    if leave_one_out:
        rows += [r for r in LEAVE_ONE_OUT if r not in rows]
    for r in rows:
        if r not in PROGRESSIVE + LEAVE_ONE_OUT + EXTRA:
            row_settings(r)  # raises with the list of rows
    if len(set(rows)) != len(rows):
        raise ArgumentError(f"--rows names a row twice: {','.join(rows)}")
    return rows


def _override_key(raw: str) -> str:
    return raw.lstrip("~+").split("=", 1)[0]


def check_overrides(overrides: list) -> None:
    """Refuse an override of a key the ablation sets (or of a block holding one): it would break the comparison."""
    for raw in overrides:
        key = _override_key(raw)
        hit = sorted(k for k in reserved_keys() if k == key or k.startswith(key + ".") or key.startswith(k + "."))
        if hit:
            why = "use --budget" if key.startswith("trainer.max_") else (
                "use --seeds / --out" if key in ("seed", "run_dir") else "every row sets it")
            raise ArgumentError(f"override {raw!r}: the ablation sets {', '.join(hit)} itself ({why}); an override "
                                "would make the rows differ in more than their technique. Fix: drop it (to change "
                                "the rows' common settings override other keys, or edit the base recipe)")


class Run:
    """One row x seed: its directory, overrides and, while running, its process."""

    def __init__(self, row: str, seed: int, out: str, overrides: list):
        self.row, self.seed = row, seed
        self.run_dir = os.path.join(out, row, f"seed{seed}")
        self.log = os.path.join(self.run_dir, "train.log")
        self.overrides = overrides
        self.config_yaml = ""  # the resolved config the run must have (compared with its config.yaml)
        self.proc, self.started, self.start_samples, self.exit_code = None, 0.0, 0, None

    @property
    def label(self) -> str:
        return f"{self.row}/seed{self.seed}"


def plan_runs(args, out: str) -> tuple:
    """(base config, [Run], plan dict for ablation.json, rows); every run's config is resolved and checked up front
    (a bad key or value fails here, before the warm-up or any run)."""
    from nemo_dapo.local.config import check_trainable, config_to_yaml, load_config
    from nemo_dapo.local.run_model import fingerprint

    for flag, v in (("--seeds", args.seeds), ("--jobs", args.jobs)):
        if v < 1:
            raise ArgumentError(f"{flag} {v}: must be at least 1")
    if not args.progress_every > 0:  # also NaN; inf is allowed and prints no progress line
        raise ArgumentError(f"--progress-every {args.progress_every}: must be a positive number of seconds between "
                            "progress lines (default 30; a large value prints fewer)")
    rows = parse_rows(args.rows, args.leave_one_out)
    check_overrides(args.overrides)
    user = list(args.overrides)
    if not any(_override_key(o) == "rollout.processes" for o in user):
        user.append("rollout.processes=1")  # one core per run; --jobs runs share the machine
    if not any(_override_key(o) == "trainer.plots" for o in user):
        user.append("trainer.plots=false")  # the ablation's own plot covers the runs (`nemo-dapo plot RUN` draws one)
    # Checked on the base config: the runs' model (OUT/base_model, warmed later) is built from its model keys.
    base = check_trainable(load_config(args.config_name, user + [f"run_dir={out}"], args.config_path))
    if "dapo+skip" in rows and not _has_key(base, SKIP_KEY):
        raise ArgumentError(f"--rows dapo+skip needs the config key {SKIP_KEY}, which {args.config_name!r} does not "
                            "have (history-based prompt skipping is not in this version). Fix: drop dapo+skip")
    budget = args.budget if args.budget is not None else base.trainer.max_samples
    if args.budget is not None and args.budget < 1:
        raise ArgumentError(f"--budget {args.budget}: must be a positive number of generated responses per run "
                            f"(or leave it out for the base recipe's trainer.max_samples, "
                            f"{base.trainer.max_samples})")
    if budget is None:
        raise ArgumentError(f"the base recipe {args.config_name!r} sets no trainer.max_samples, so the runs have no "
                            "budget. Fix: give --budget N (generated responses per run)")
    model_path = os.path.join(out, "base_model")
    # max_steps = budget never comes first: a step generates >= group_size responses (>= 2) unless groups carried
    # over from the step before fill it, and that step then generated them. No time limit: the budget ends each run.
    common = [f"trainer.max_samples={budget}", f"trainer.max_steps={budget}", "trainer.max_time_s=null",
              f"model.path={model_path}", "resume=auto"]
    runs = []
    for row in rows:
        for seed in range(1, args.seeds + 1):
            run = Run(row, seed, out, [])
            run.overrides = user + row_overrides(row) + common + [
                f"seed={seed}", f"run_dir={run.run_dir}", f"name=ablate-{row}"]
            run.config_yaml = config_to_yaml(load_config(args.config_name, run.overrides, args.config_path))
            runs.append(run)
    plan = {"config_name": args.config_name, "overrides": list(args.overrides), "budget": budget,
            "base_fingerprint": fingerprint(base), "row_table": {r: row_overrides(r) for r in rows}}
    return base, runs, plan, rows


def _has_key(cfg, key: str) -> bool:
    node = cfg
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else getattr(node, part, None)
        if node is None:
            return False
    return True


def check_resume(out: str, plan: dict) -> None:
    """Refuse to continue OUT/ablation.json's ablation under another plan (rows may be added, not redefined)."""
    path = os.path.join(out, "ablation.json")
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        stored = json.load(f).get("plan", {})
    diffs = [f"{k}: {stored.get(k)!r} -> {plan[k]!r}" for k in ("config_name", "overrides", "budget",
                                                                  "base_fingerprint") if stored.get(k) != plan[k]]
    table = stored.get("row_table", {})
    diffs += [f"row {r}: {table[r]} -> {o}" for r, o in plan["row_table"].items() if r in table and table[r] != o]
    if diffs:
        raise ConfigError(f"{out!r} holds another ablation ({path}); it differs in {'; '.join(diffs)}. Its finished "
                          "runs would be mixed with runs of other settings. Fix: rerun with the arguments it was "
                          "started with, or write this ablation elsewhere with --out NEW_DIR")
    plan["row_table"] = {**table, **plan["row_table"]}


def is_finished(run: Run) -> bool:
    try:
        with open(os.path.join(run.run_dir, "config.yaml"), encoding="utf-8") as f:
            same = f.read() == run.config_yaml
    except OSError:
        return False
    return same and os.path.isfile(os.path.join(run.run_dir, "summary.json"))


def warm_base(base) -> str:
    """OUT/base_model: the base recipe's warm-up (cached in OUT like a run directory's) that every run starts from."""
    from nemo_dapo.local.run import set_threads
    from nemo_dapo.local.run_model import prepare_base_model
    from nemo_dapo.local.run_log import setup_console_logging

    setup_console_logging()
    set_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the runs are forked after the tokenizer was used
    prepare_base_model(base)
    return os.path.join(base.run_dir, "base_model")


def _pdeath_signal() -> None:
    """In the child: get SIGTERM when the ablation dies (even by SIGKILL), so no run outlives it holding its lock."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass


def _consumed(run: Run) -> int:
    """Responses generated so far by a run (the last train record of its metrics.jsonl; 0 before the first)."""
    try:
        with open(os.path.join(run.run_dir, "metrics.jsonl"), "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("kind") == "train":
            return int(rec.get("counters/consumed_samples", 0))
    return 0


def _clock(s: float) -> str:
    s = int(max(0, s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Scheduler:
    """Runs the pending runs, ``jobs`` at a time, with progress lines; a signal stops them with checkpoints."""

    def __init__(self, runs: list, budget: int, jobs: int, progress_every: float = 30.0, say=print):
        self.pending, self.running, self.failed = list(runs), [], []
        self.total, self.done, self.budget, self.jobs = len(runs), 0, budget, jobs
        self.progress_every, self.say, self.signum = progress_every, say, None
        self.t0, self.work_done = time.time(), 0

    def _start(self, run: Run) -> None:
        os.makedirs(run.run_dir, exist_ok=True)
        run.start_samples, run.started = _consumed(run), time.time()
        # Not through a link (a shared OUT): the run's own checks (run_dir.check_no_links) come after this open.
        try:
            fd = os.open(run.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        except OSError as e:
            self.failed.append(run)
            self.running.remove(run)
            run.exit_code = 2
            self.say(f"[ablate] FAILED {run.label}: cannot open its log {run.log} ({e.strerror}; a symbolic link "
                     "is not written through). Fix: remove it and rerun")
            return
        logf = os.fdopen(fd, "a", encoding="utf-8")
        logf.write(f"==== nemo-dapo ablate: {run.label} started {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        logf.flush()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "nemo_dapo.cli", "train", "--config-name", self.config_name,
               *(["--config-path", self.config_path] if self.config_path else []), *run.overrides]
        # Own session: a Ctrl-C at the terminal reaches the ablation only, which passes one SIGTERM to each run.
        run.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                    preexec_fn=_pdeath_signal)
        logf.close()
        resumed = f" (resuming at {run.start_samples} responses)" if run.start_samples else ""
        self.say(f"[ablate] start {run.label}{resumed}; log {run.log}")

    def _finish(self, run: Run) -> None:
        run.exit_code = run.proc.returncode
        self.running.remove(run)
        self.work_done += max(0, self.budget - run.start_samples)
        took = _clock(time.time() - run.started)
        if run.exit_code == 0:
            self.done += 1
            self.say(f"[ablate] done {run.label} in {took} ({self._overall()})")
        else:
            self.failed.append(run)
            what = EXIT_CODES.get(run.exit_code, "see the log")
            self.say(f"[ablate] FAILED {run.label}: exit code {run.exit_code} ({what}) after {took}; log {run.log}")

    def _overall(self) -> str:
        elapsed = time.time() - self.t0
        live = sum(max(0, _consumed(r) - r.start_samples) for r in self.running)
        remaining = sum(self.budget - r.start_samples for r in self.pending)
        remaining += sum(max(0, self.budget - _consumed(r)) for r in self.running)
        done = self.work_done + live
        eta = _clock(remaining * elapsed / done) if done else "?"
        return (f"runs {self.done}/{self.total} done, {len(self.failed)} failed, {len(self.running)} running; "
                f"elapsed {_clock(elapsed)}, ETA {eta}")

    def _on_signal(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
            self.say(f"[ablate] {signal.Signals(signum).name}: stopping the running runs (each saves a checkpoint); "
                     "rerun the same command to continue")
            for r in self.running:
                r.proc.send_signal(signal.SIGTERM)

    def run(self, config_name: str, config_path: Optional[str]) -> None:
        self.config_name, self.config_path = config_name, config_path
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        last = time.time()
        try:
            while self.pending or self.running:
                while self.signum is None and self.pending and len(self.running) < self.jobs:
                    run = self.pending.pop(0)
                    self.running.append(run)
                    self._start(run)
                time.sleep(0.2)
                for r in [r for r in self.running if r.proc.poll() is not None]:
                    self._finish(r)
                if self.signum is not None and not self.running:
                    break
                if self.running and time.time() - last >= self.progress_every:
                    last = time.time()
                    each = ", ".join(f"{r.label} {min(100, 100 * _consumed(r) // self.budget)}%"
                                     for r in self.running)
                    self.say(f"[ablate] {each} | {self._overall()}")
        finally:
            for s, h in previous.items():
                signal.signal(s, h)


def ablate(args) -> int:
    """The ``nemo-dapo ablate`` subcommand; returns the exit code."""
    from nemo_dapo.local.run_dir import RunDirLock

    out = os.path.abspath(args.out or os.path.join("runs", f"ablate_{os.path.basename(args.config_name)}"))
    _check_out(out)
    base, runs, plan, rows = plan_runs(args, out)
    os.makedirs(out, exist_ok=True)
    with RunDirLock(out, what="ablation output directory", fix="write this ablation elsewhere with --out NEW_DIR"):
        return _ablate_locked(args, out, base, runs, plan, rows)


def _check_out(out: str) -> None:
    """``--out`` must be a directory or creatable as one (checked before any work)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ArgumentError(f"--out {out!r} is a file, not a directory. Fix: name a directory (created if missing), "
                            "e.g. --out runs/ablate_NAME")
    parent = os.path.dirname(out)
    while not os.path.exists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ArgumentError(f"--out {out!r}: {parent!r} is a file, so the directory cannot be created there. Fix: "
                            "name a directory elsewhere")


def _ablate_locked(args, out: str, base, runs: list, plan: dict, rows: list) -> int:
    """The ablation itself, while it holds OUT/.lock (one ablation per output directory)."""
    from nemo_dapo.local import ablate_report

    check_resume(out, plan)
    todo = [r for r in runs if not is_finished(r)]
    print(f"[ablate] {len(rows)} rows x {args.seeds} seeds = {len(runs)} runs of {plan['budget']} responses each in "
          f"{out}; {len(runs) - len(todo)} already finished, {len(todo)} to run ({args.jobs} at a time)", flush=True)
    meta = {"plan": plan, "rows": rows, "seeds": args.seeds, "labels": {r: row_label(r) for r in rows},
            "techniques": {r: row_technique(r) for r in rows}}
    write_json(os.path.join(out, "ablation.json"), meta)  # on disk before any run starts: a rerun checks against it
    if todo:
        warm_base(base)
    sched = Scheduler(todo, plan["budget"], args.jobs, progress_every=args.progress_every,
                      say=lambda s: print(s, flush=True))
    t0 = time.time()
    sched.run(args.config_name, args.config_path)
    failed = {r.label: {"exit_code": r.exit_code, "log": r.log} for r in sched.failed}
    if sched.signum is not None:
        print(f"[ablate] stopped by {signal.Signals(sched.signum).name} after {_clock(time.time() - t0)}; rerun the "
              "same command to resume", file=sys.stderr)
        return 128 + sched.signum
    paths = ablate_report.write_report(out, meta, failed)
    with open(paths[0], encoding="utf-8") as f:
        print(f.read(), flush=True)
    for p in paths:
        print(p)
    with open(paths[-1], encoding="utf-8") as f:
        bad = [r for r in json.load(f)["runs"] if r["status"] in ("failed", "diverged")]
    for r in bad:
        label = f"{r['row']}/seed{r['seed']}"
        if r["status"] == "diverged":
            print(f"nemo-dapo ablate: run {label} diverged ({r.get('diverged')}); not counted in the table. Its "
                  f"run directory {os.path.join(out, r['run_dir'])} stays diverged (rerunning it exits 7)",
                  file=sys.stderr)
        else:
            print(f"nemo-dapo ablate: run {label} failed with exit code {r.get('exit_code')}; log {r.get('log')}",
                  file=sys.stderr)
    return EXIT_RUNS_FAILED if bad else 0
