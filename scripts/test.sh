#!/usr/bin/env bash
# The README's test command: installs (or completes) the CPU test stack when needed, then runs the whole suite (CPU,
# incl. the multi-process megatron-core / NeMo-Aligner tests). Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
# Install (or upgrade to) the full stack unless this venv was installed in full mode from the current install inputs
# (a venv made by the README's first command, `install.sh VENV core`, lacks megatron-core and NeMo).
want="full $(cat requirements/*.txt setup.py scripts/install.sh | sha256sum | cut -c1-16)"
if [ "$(cat "$VENV/.nemo_dapo_install" 2>/dev/null)" != "$want" ]; then
  bash scripts/install.sh "$VENV" full || exit 1
fi
export OMP_NUM_THREADS=1
# Two pytest workers (TEST_WORKERS=0: one process): much of the suite waits on processes it starts, so a second
# worker fills the idle core. --dist loadfile keeps a module's tests (and its module-scoped fixtures) on one worker.
# --durations: the slowest tests are where the suite's time goes; the list is printed at the end of every run.
"$VENV/bin/python" -m pytest -n "${TEST_WORKERS:-2}" --dist loadfile --durations=25 "$@"
rc=$?
# pytest exit code 5 means "no tests collected": an empty run is a failure here, never a silent pass.
[ $rc -eq 5 ] && echo "pytest collected no tests: failing on purpose" >&2
exit $rc
