"""The ``nemo-dapo`` command.

    nemo-dapo train [--config-name RECIPE] [key=value ...]     train (default recipe: tiny_cpu), resume automatically
    nemo-dapo eval --model DIR --data FILE [--format F]        avg@k / pass@k / maj@k of a local model on a data set
    nemo-dapo plot RUN_DIR [RUN_DIR ...]                       PNG curves; with several runs also a comparison table
    nemo-dapo ablate [--rows ROW,...] [--seeds N] [key=value]  the paper's progressive table at toy scale (resumable)

Each subcommand is one entry of ``SUBCOMMANDS``: (name, help, add_arguments(parser), run(args) -> exit code).
Add a subcommand by appending an entry; nothing else needs to change.
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import traceback
from typing import Optional

# Exit codes of every subcommand (nemo_dapo/exit_codes.py); importers of the names from here keep working.
from nemo_dapo.exit_codes import (EXIT_BAD_INPUT, EXIT_BUDGET, EXIT_BUSY, EXIT_CODES, EXIT_DIVERGED,  # noqa: F401
                                  EXIT_ENGINE, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_OK, EXIT_RUNS_FAILED,
                                  EXIT_UNWRITABLE)
_NO_SPACE = (errno.ENOSPC, errno.EROFS, errno.EDQUOT)


# ---- train ---------------------------------------------------------------------------------------------------------
def _train_arguments(p: argparse.ArgumentParser) -> None:
    from nemo_dapo.local.config import DEFAULT_CONFIG

    p.add_argument("--config-name", "-cn", default=DEFAULT_CONFIG,
                   help=f"recipe name in conf/recipes or conf/, or a YAML path (default: {DEFAULT_CONFIG})")
    p.add_argument("--config-path", "-cp", default=None, help="directory to look the config up in (default: conf/)")
    p.add_argument("--print-config", action="store_true", help="print the resolved configuration and exit")
    p.add_argument("--allow-config-change", action="store_true",
                   help="resume even if the config differs from the checkpoint's in keys that change the run "
                        "(seed, data, model, algorithm, optimizer, ...); without it such a resume is refused")
    p.add_argument("--resume-diverged", action="store_true",
                   help="continue a run that stopped because it diverged (exit 7); without it a rerun refuses "
                        "(exit 7 again). The run stays marked diverged (run_dir/diverged.json)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="overrides: key=value (existing key), ++key=value (add or set), +key=value (add), ~key")


def _train(args) -> int:
    from nemo_dapo.local.config import check_trainable, config_to_yaml, load_config

    cfg = load_config(args.config_name, args.overrides, args.config_path)
    if args.print_config:
        print(config_to_yaml(cfg), end="")
        return 0
    check_trainable(cfg)  # before any work starts (the run directory is not touched yet)
    from nemo_dapo.local.run import train
    from nemo_dapo.local.run_dir import RunDirError, RunInterrupted

    try:
        summary = train(cfg, allow_config_change=args.allow_config_change, resume_diverged=args.resume_diverged)
    except RunDirError as e:  # busy (5), unwritable (6), diverged before (7), a signal (128 + signum: 130, 143)
        kind = "stopped" if isinstance(e, RunInterrupted) else "error"
        print(f"nemo-dapo train: {kind}: {e}", file=sys.stderr)
        return e.exit_code
    print(json.dumps({k: summary[k] for k in ("base_accuracy", "final_accuracy", "gain_points", "heldout_size",
                                              "wall_seconds")}))
    return 0


# ---- eval ----------------------------------------------------------------------------------------------------------
def _eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local model directory (save_pretrained layout with tokenizer), "
                                                  "e.g. RUN_DIR/final_model or RUN_DIR/base_model")
    p.add_argument("--data", required=True, help="data file (parquet / jsonl)")
    p.add_argument("--format", default="aime2024", help="reader: aime2024 (default; 30 problems x 32 copies), "
                                                         "dapo_math, verl, aime2025, math500, gsm8k")
    p.add_argument("--samples", type=int, default=1, help="samples per row (AIME-2024 x32 rows: 1 gives avg@32)")
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N rows")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (paper: 1.0)")
    p.add_argument("--top-p", type=float, default=0.7, help="nucleus threshold (paper: 0.7)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="generation cap in tokens")
    p.add_argument("--verifier", default="dapo", help="dapo | tolerant | math_verify")
    p.add_argument("--batch-size", type=int, default=256, help="responses per generate call")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--out", default=None, help="also write the results as JSON here")


def _eval(args) -> int:
    from nemo_dapo.local.config import ArgumentError
    from nemo_dapo.local.run_eval import evaluate_model

    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        raise ArgumentError(f"--out {args.out!r}: directory {os.path.dirname(os.path.abspath(args.out))!r} does not "
                            "exist. Fix: create it or write elsewhere (checked before the evaluation runs)")
    if args.out and os.path.isdir(args.out):
        raise ArgumentError(f"--out {args.out!r} is a directory; it names the JSON file to write. Fix: a file name, "
                            f"e.g. {os.path.join(args.out, 'eval.json')!r}")
    result = evaluate_model(args.model, args.data, fmt=args.format, samples=args.samples, limit=args.limit,
                            temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                            verifier=args.verifier, batch_size=args.batch_size, seed=args.seed, threads=args.threads)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


# ---- plot ----------------------------------------------------------------------------------------------------------
def _plot_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories written by `nemo-dapo train` (or "
                                                                  "one directory of `nemo-dapo ablate`)")
    p.add_argument("--out", default=None, help="output directory (default: RUN_DIR/plots; with several runs: "
                                               "the first RUN_DIR/compare)")


def _plot(args) -> int:
    from nemo_dapo.local.ablate_report import is_ablation_dir, redraw
    from nemo_dapo.local.plots import compare_runs, plot_run

    if len(args.run_dirs) == 1 and is_ablation_dir(args.run_dirs[0]):  # OUT/ablation.json: the ablation's report
        for path in redraw(args.run_dirs[0]):
            print(path)
        return 0
    for run_dir in args.run_dirs:
        for path in plot_run(run_dir, args.out if len(args.run_dirs) == 1 else None):
            print(path)
    if len(args.run_dirs) > 1:
        table, paths = compare_runs(args.run_dirs, args.out)
        print(table)
        for path in paths:
            print(path)
    return 0


# ---- ablate --------------------------------------------------------------------------------------------------------
def _ablate_arguments(p: argparse.ArgumentParser) -> None:
    from nemo_dapo.local.ablate import EXTRA, LEAVE_ONE_OUT, PROGRESSIVE

    p.add_argument("--config-name", "-cn", default="tiny_cpu_long", help="base recipe (default: tiny_cpu_long)")
    p.add_argument("--config-path", "-cp", default=None, help="directory to look the recipe up in (default: conf/)")
    p.add_argument("--seeds", type=int, default=3, help="seeds per row: seed=1..N (default 3)")
    p.add_argument("--budget", type=int, default=None,
                   help="generated responses per run (trainer.max_samples; default: the base recipe's)")
    p.add_argument("--rows", default=None, help=f"comma-separated rows (default: {','.join(PROGRESSIVE)}); also "
                                                f"{', '.join(LEAVE_ONE_OUT + EXTRA)}")
    p.add_argument("--leave-one-out", action="store_true", help="also run DAPO minus each technique")
    p.add_argument("--jobs", type=int, default=2, help="runs side by side, one core each (default 2)")
    p.add_argument("--out", default=None, help="output directory (default: runs/ablate_<config-name>)")
    p.add_argument("--progress-every", type=float, default=30.0,
                   help="seconds between progress lines (> 0; default 30)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="overrides of the base recipe for every run (not of the keys the rows set)")


def _ablate(args) -> int:
    from nemo_dapo.local.ablate import ablate

    return ablate(args)


SUBCOMMANDS = [
    ("train", "train a policy with DAPO (default recipe: tiny_cpu)", _train_arguments, _train),
    ("eval", "avg@k / pass@k / maj@k of a local model on a data set", _eval_arguments, _eval),
    ("plot", "PNG curves of run directories (and a comparison table for several)", _plot_arguments, _plot),
    ("ablate", "the DAPO paper's ablation table: rows x seeds of train runs, one report", _ablate_arguments, _ablate),
]
# The cluster-side subcommands; both modules import neither NeMo nor torch.
from nemo_dapo.cluster import plan as _plan, registry as _registry  # noqa: E402

from nemo_dapo.megatron import convert_command as _convert  # noqa: E402  (imports torch only when run)

SUBCOMMANDS += [_plan.CLI, _registry.CLI, _convert.CLI]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nemo-dapo", description="DAPO for NeMo-Aligner, and on a laptop CPU.")
    debug_help = "print the traceback of an error too (or set NEMO_DAPO_DEBUG=1)"
    parser.add_argument("--debug", action="store_true", help=debug_help)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text, add_arguments, run in SUBCOMMANDS:
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(p)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
        p.set_defaults(run=run)
    return parser


def _exit_code_and_message(command: str, e: BaseException) -> Optional[tuple]:
    """(exit code, one-line message) for an anticipated error; None for anything else (a bug: traceback)."""
    from nemo_dapo.local.config import ConfigError
    from nemo_dapo.core.checkpoint import CheckpointError
    from nemo_dapo.core.dynamic_sampling import BudgetExhausted
    from nemo_dapo.core.health import TrainingDiverged
    from nemo_dapo.data.readers import DataFormatError
    from nemo_dapo.engines.base import EngineError

    from nemo_dapo.local.run_dir import RunDirError

    head = f"nemo-dapo {command}"
    if isinstance(e, RunDirError):  # ablate's output directory: busy (5), a link where it writes (2)
        return e.exit_code, f"{head}: error: {e}"
    if isinstance(e, (ConfigError, DataFormatError, FileNotFoundError, CheckpointError)):
        return EXIT_BAD_INPUT, f"{head}: error: {e}"
    if isinstance(e, BudgetExhausted):
        return EXIT_BUDGET, (f"{head}: error: {e} (keys under algorithm.dynamic_sampling; the checkpoints are "
                             "kept, so rerunning with a changed key resumes the run)")
    if isinstance(e, EngineError):
        return EXIT_ENGINE, f"{head}: rollout engine error: {e}"
    if isinstance(e, TrainingDiverged):
        return EXIT_DIVERGED, f"{head}: stopped: {e}"
    if isinstance(e, ImportError) and "pip install" in str(e):
        return EXIT_BAD_INPUT, f"{head}: error: {e}"  # an optional package, named with its install command
    if isinstance(e, OSError) and e.errno in _NO_SPACE:
        return EXIT_UNWRITABLE, (f"{head}: error: cannot write {e.filename or ''}: {e.strerror}. Fix: free disk "
                                 "space or choose a writable directory")
    if isinstance(e, (PermissionError, IsADirectoryError, NotADirectoryError)):
        return EXIT_BAD_INPUT, f"{head}: error: {e.strerror}: {e.filename!r}"
    if isinstance(e, KeyboardInterrupt):
        return EXIT_INTERRUPTED, f"{head}: interrupted"
    return None


def main(argv: Optional[list] = None) -> int:
    """Run one subcommand; every anticipated error becomes one ``error:`` line on stderr and its exit code
    (:data:`EXIT_CODES`). ``--debug`` (or ``NEMO_DAPO_DEBUG=1``) also prints the traceback."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help()
        return EXIT_BAD_INPUT
    debug = bool(getattr(args, "debug", False)) or os.environ.get("NEMO_DAPO_DEBUG", "") not in ("", "0")
    try:
        return args.run(args)
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - sorted into anticipated errors and bugs below
        known = _exit_code_and_message(args.command, e)
        if known is None:
            traceback.print_exc()
            print(f"nemo-dapo {args.command}: internal error ({type(e).__name__}: {e}); this is a bug, please "
                  "report it with the traceback above", file=sys.stderr)
            return EXIT_INTERNAL
        if debug:
            traceback.print_exc()
        print(known[1], file=sys.stderr)
        return known[0]


if __name__ == "__main__":
    sys.exit(main())
