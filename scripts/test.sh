#!/usr/bin/env bash
# The README's test command: installs the CPU test stack on first use, then runs the whole suite (CPU, incl. the
# multi-process megatron-core / NeMo-Aligner tests). Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/nemo-dapo" ] || bash scripts/install.sh "$VENV" full || exit 1
export OMP_NUM_THREADS=1
"$VENV/bin/python" -m pytest "$@"
rc=$?
# pytest exit code 5 means "no tests collected": an empty run is a failure here, never a silent pass.
[ $rc -eq 5 ] && echo "pytest collected no tests: failing on purpose" >&2
exit $rc
