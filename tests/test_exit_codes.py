"""The exit codes live in one module that the command line and the modules reporting them import, in no circle."""
import json
import subprocess
import sys

from nemo_dapo import exit_codes as codes

PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted(m for m in sys.modules if m.startswith("nemo_dapo"))))
"""


def test_codes_are_distinct_and_each_has_a_meaning():
    named = {k: v for k, v in vars(codes).items() if k.startswith("EXIT_") and k != "EXIT_CODES"}
    assert len(set(named.values())) == len(named)
    assert set(named.values()) == set(codes.EXIT_CODES)
    assert codes.EXIT_INTERRUPTED == 128 + 2 and codes.EXIT_TERMINATED == 128 + 15  # 128 + SIGINT / SIGTERM


def test_the_reporting_modules_do_not_import_the_command_line():
    out = subprocess.run([sys.executable, "-c", PROBE, "nemo_dapo.local.ablate", "nemo_dapo.local.ablate_report",
                          "nemo_dapo.local.run_dir"], capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert "nemo_dapo.exit_codes" in loaded and "nemo_dapo.cli" not in loaded


def test_the_command_line_and_the_run_directory_use_the_same_codes():
    from nemo_dapo import cli
    from nemo_dapo.local import ablate, run_dir

    assert cli.EXIT_CODES is codes.EXIT_CODES and ablate.EXIT_RUNS_FAILED == codes.EXIT_RUNS_FAILED
    assert (run_dir.RunDirBusy.exit_code, run_dir.RunDirUnwritable.exit_code, run_dir.RunDiverged.exit_code) == \
        (codes.EXIT_BUSY, codes.EXIT_UNWRITABLE, codes.EXIT_DIVERGED)
