#!/usr/bin/env bash
# Device checks for one CUDA GPU: core (fused log-probs, loss), megatron (vocab-parallel, conversion parity,
# reduction, policy), the local backend, partial rollouts across a refit, the training-state offload (its memory drop,
# and its rate in benchmarks/state_offload.py) and, with two GPUs, the NCCL weight group. From the repository root:
#
#     bash tests/gpu/run_device_checks.sh            # logs go to $OUT (default /tmp/gpu_checks)
#
# Packages the machine lacks travel as wheels in the git-ignored folder .whl/, one --target folder per group:
#   .whl/megatron/  megatron-core 0.10.0 (the version the project pins; PyPI has no CPython 3.12 wheel of it: build a
#                   py3-none-any wheel from its sdist with setup.py's ext_modules removed, the optional dataset helper
#                   the checks do not use)
#   .whl/hf447/     transformers 4.47.1, tokenizers 0.21.4, huggingface_hub 0.36.2 (the project's transformers pin)
#   .whl/omegaconf/ omegaconf 2.3.0 and antlr4-python3-runtime 4.9.3 (`pip wheel --no-deps`; the training-offload
#                   worker imports nemo_dapo.aligner.training_offload, which validates configs with omegaconf)
# Pass 1 ($OUT/gpu_checks.log) runs every check, with the pinned transformers when it imports, else with the
# machine's own. Pass 2 ($OUT/gpu_checks_tf_image.log) repeats the conversion and local-backend checks with the
# machine's own transformers, to record what a newer release changes. $OUT/results.txt collects the RESULT lines.
# $OUT/state_offload.log holds the benchmark (~90 s: it checks every byte of 8 GB after each round trip),
# $OUT/eager_launch.log the eager decode step's host time per layer against a CUDA graph's, $OUT/gpu_timeslice.log
# the cost of a spinning kernel in another process to the work beside it (measurements). The exit status is pass
# 1's, else the offload benchmark's. Everything stays under 12 minutes (timeouts 300 s + 180 s + 60 s + 90 s + 90 s;
# the previous release's checks took 213-257 s on one H200).
set -u -o pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
LOG=$OUT/gpu_checks.log
LOG2=$OUT/gpu_checks_tf_image.log
: >"$LOG"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false CUDA_DEVICE_MAX_CONNECTIONS=1
export TRANSFORMERS_OFFLINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error

note() { echo "$*" | tee -a "$LOG"; }

install_group() {  # install_group NAME: prints its --target folder; nothing when the group has no wheels
    local wheels=(.whl/"$1"/*.whl)
    [ -e "${wheels[0]}" ] || return 0
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "/tmp/site_$1" "${wheels[@]}" >>"$LOG" 2>&1 && echo "/tmp/site_$1"
}

versions() {
    PYTHONPATH=$1 python3 - <<'EOF' 2>&1 | tee -a "$LOG"
import sys, torch, transformers
try:
    import megatron.core as mc
    mcv = mc.__version__
except Exception as e:  # noqa: BLE001
    mcv = f"missing ({type(e).__name__}: {e})"
cuda = torch.cuda.is_available()
print(f"python {sys.version.split()[0]} | torch {torch.__version__} cuda {torch.version.cuda} "
      f"({torch.cuda.get_device_name(0) if cuda else 'no device'}, nccl {torch.cuda.nccl.version() if cuda else '-'}) "
      f"| transformers {transformers.__version__} | megatron-core {mcv}")
EOF
}

note "== $(date -u +%FT%TZ) device checks"
nvidia-smi -L 2>&1 | tee -a "$LOG"
SITE_MC=$(install_group megatron)
SITE_HF=$(install_group hf447)
SITE_OC=$(install_group omegaconf)
BASE=$PWD${SITE_MC:+:$SITE_MC}${SITE_OC:+:$SITE_OC}
PINNED=$BASE
if [ -n "$SITE_HF" ]; then
    if PYTHONPATH=$BASE:$SITE_HF python3 -c "import transformers.models.llama.modeling_llama" >>"$LOG" 2>&1; then
        PINNED=$BASE:$SITE_HF
    else
        note "the carried transformers does not import here: pass 1 uses the machine's own"
    fi
fi
note "-- pass 1 stack:"
versions "$PINNED"

# megatron last: its NCCL world and parallel state are process-wide, and a stuck NCCL start costs only its own checks
PYTHONPATH=$PINNED timeout 300 python3 -m pytest tests/gpu/test_core_cuda.py tests/gpu/test_local_cuda.py \
    tests/gpu/test_partial_cuda.py tests/gpu/test_weight_group_nccl.py \
    "tests/aligner/test_training_offload.py::test_offload_frees_the_device_memory" tests/gpu/test_megatron_cuda.py \
    -q -s -p no:cacheprovider 2>&1 | tee -a "$LOG"
rc=$?
note "== pass 1 exit status $rc"
PYTHONPATH=$PINNED timeout 180 python3 benchmarks/state_offload.py 2>&1 | tee "$OUT/state_offload.log"
bench_rc=$?  # non-zero: a round trip changed a byte, the memory was not freed, or the time ran out
note "== state_offload.py exit status $bench_rc"
[ "$rc" -eq 0 ] && rc=$bench_rc
# the host's time per layer of an eager decode step against a CUDA graph's (plan.assume.eager_layer_ms); a measurement,
# never a failure
PYTHONPATH=$PINNED timeout 60 python3 benchmarks/eager_launch.py 2>&1 | tee "$OUT/eager_launch.log"
note "== eager_launch.py exit status $?"
# what a kernel spinning in another process (a rank waiting inside an NCCL collective) costs the GPU work beside it;
# a measurement, never a failure
PYTHONPATH=$PINNED timeout 90 python3 benchmarks/gpu_timeslice.py 2>&1 | tee "$OUT/gpu_timeslice.log"
note "== gpu_timeslice.py exit status $?"

if [ "$PINNED" != "$BASE" ]; then
    LOG=$LOG2
    : >"$LOG"
    note "== pass 2: the machine's own transformers (RoPE base, conversion parity, local backend)"
    versions "$BASE"
    PYTHONPATH=$BASE timeout 90 python3 -m pytest tests/gpu/test_local_cuda.py tests/gpu/test_megatron_cuda.py -q -s \
        -p no:cacheprovider -k "rope or logits_equal_hf or policy_on_cuda or sampler or refit" 2>&1 | tee -a "$LOG"
    note "== pass 2 exit status $?"
fi
# pytest's progress dots can precede a RESULT on its line
grep -ho "RESULT .*" "$OUT/gpu_checks.log" "$OUT/state_offload.log" "$OUT/eager_launch.log" "$OUT/gpu_timeslice.log" \
    "$LOG2" 2>/dev/null \
    >"$OUT/results.txt"
exit $rc
