"""Exit codes of every ``nemo-dapo`` subcommand, in one place (docs/cli.md lists them).

Standard library only: the command line (``cli.py``) and the modules that raise or report these codes
(``local/run_dir.py``, ``local/ablate.py``, ``local/ablate_report.py``) import it without importing each other.
"""
EXIT_OK = 0
EXIT_INTERNAL = 1  # a bug: the traceback is printed
EXIT_BAD_INPUT = 2  # bad config, argument, data file, checkpoint (also argparse's usage errors)
EXIT_BUDGET = 3  # dynamic sampling spent algorithm.dynamic_sampling.max_gen_batches without a full batch
EXIT_ENGINE = 4  # the rollout engine server failed (checkpoint saved)
EXIT_BUSY = 5  # another `nemo-dapo train` holds the run directory (ablate: another `ablate` holds --out)
EXIT_UNWRITABLE = 6  # the run directory or an output cannot be written (disk full, read-only, permissions)
EXIT_DIVERGED = 7  # training diverged (skipped updates in a row, entropy at the uniform limit); checkpoint saved;
# also a rerun of a diverged run, refused without --resume-diverged (local/run_dir.py)
EXIT_RUNS_FAILED = 8  # ablate: some runs failed (each named with its exit code and log); the others finished
EXIT_INTERRUPTED = 130  # Ctrl-C; train: 128 + signal (130 SIGINT, 143 SIGTERM) after saving a checkpoint
EXIT_TERMINATED = 143  # train stopped by SIGTERM after saving a checkpoint

EXIT_CODES = {EXIT_OK: "success", EXIT_INTERNAL: "internal error (bug)", EXIT_BAD_INPUT: "bad input",
              EXIT_BUDGET: "dynamic-sampling budget exhausted", EXIT_ENGINE: "rollout engine error",
              EXIT_BUSY: "run directory busy", EXIT_UNWRITABLE: "cannot write", EXIT_DIVERGED: "training diverged",
              EXIT_RUNS_FAILED: "some ablation runs failed",
              EXIT_INTERRUPTED: "interrupted (SIGINT)", EXIT_TERMINATED: "stopped by SIGTERM"}
