"""The ``nemo-dapo`` command.

    nemo-dapo train [--config-name RECIPE] [key=value ...]     train (default recipe: tiny_cpu), resume automatically
    nemo-dapo eval --model DIR --data FILE [--format F]        avg@k / pass@k / maj@k of a local model on a data set
    nemo-dapo plot RUN_DIR [RUN_DIR ...]                       PNG curves; with several runs also a comparison table

Each subcommand is one entry of ``SUBCOMMANDS``: (name, help, add_arguments(parser), run(args) -> exit code).
Add a subcommand by appending an entry; nothing else needs to change.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional


# ---- train ---------------------------------------------------------------------------------------------------------
def _train_arguments(p: argparse.ArgumentParser) -> None:
    from nemo_dapo.config import DEFAULT_CONFIG

    p.add_argument("--config-name", "-cn", default=DEFAULT_CONFIG,
                   help=f"recipe name in conf/recipes or conf/, or a YAML path (default: {DEFAULT_CONFIG})")
    p.add_argument("--config-path", "-cp", default=None, help="directory to look the config up in (default: conf/)")
    p.add_argument("--print-config", action="store_true", help="print the resolved configuration and exit")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="overrides: key=value (existing key), ++key=value (add or set), +key=value (add), ~key")


def _train(args) -> int:
    from nemo_dapo.config import config_to_yaml, load_config

    cfg = load_config(args.config_name, args.overrides, args.config_path)
    if args.print_config:
        print(config_to_yaml(cfg), end="")
        return 0
    from nemo_dapo.local.run import train

    summary = train(cfg)
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
    from nemo_dapo.local.run_eval import evaluate_model

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
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories written by `nemo-dapo train`")
    p.add_argument("--out", default=None, help="output directory (default: RUN_DIR/plots; with several runs: "
                                               "the first RUN_DIR/compare)")


def _plot(args) -> int:
    from nemo_dapo.plots import compare_runs, plot_run

    for run_dir in args.run_dirs:
        for path in plot_run(run_dir, args.out if len(args.run_dirs) == 1 else None):
            print(path)
    if len(args.run_dirs) > 1:
        table, paths = compare_runs(args.run_dirs, args.out)
        print(table)
        for path in paths:
            print(path)
    return 0


SUBCOMMANDS = [
    ("train", "train a policy with DAPO (default recipe: tiny_cpu)", _train_arguments, _train),
    ("eval", "avg@k / pass@k / maj@k of a local model on a data set", _eval_arguments, _eval),
    ("plot", "PNG curves of run directories (and a comparison table for several)", _plot_arguments, _plot),
]
# The cluster-side subcommands; both modules import neither NeMo nor torch.
from nemo_dapo.aligner import plan as _plan, registry as _registry  # noqa: E402

SUBCOMMANDS += [_plan.CLI, _registry.CLI]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nemo-dapo", description="DAPO for NeMo-Aligner, and on a laptop CPU.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text, add_arguments, run in SUBCOMMANDS:
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(p)
        p.set_defaults(run=run)
    return parser


def main(argv: Optional[list] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help()
        return 2
    from nemo_dapo.config import ConfigError
    from nemo_dapo.core.checkpoint import CheckpointError
    from nemo_dapo.core.dynamic_sampling import BudgetExhausted
    from nemo_dapo.data.readers import DataFormatError
    from nemo_dapo.engines.base import EngineError

    try:
        return args.run(args)
    except (ConfigError, DataFormatError, FileNotFoundError, CheckpointError) as e:
        print(f"nemo-dapo {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BudgetExhausted as e:
        print(f"nemo-dapo {args.command}: error: {e} (keys under algorithm.dynamic_sampling; the checkpoints are "
              "kept, so rerunning with a changed key resumes the run)", file=sys.stderr)
        return 3
    except EngineError as e:
        print(f"nemo-dapo {args.command}: rollout engine error: {e}", file=sys.stderr)
        return 4


if __name__ == "__main__":
    sys.exit(main())
