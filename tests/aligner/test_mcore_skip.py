"""With megatron-core's distributed optimizer (``mcore_distributed_optim``: every MoE recipe) NeMo-Aligner's
``clip_gradients`` returns no norm and megatron-core 0.10's bf16 step neither checks nor refuses a NaN gradient, so
the trainer reads the norm itself before the step (megatron/step.megatron_grad_norm): a NaN gradient with a finite
loss skips the update and the weights stay as they were. Runs tests/aligner/workers/mcore_skip_worker.py (the real
actor, NeMo's optimizer wrapper and ActorPolicy on CPU)."""
import json
import math
import os
import subprocess
import sys

from tests.aligner.conftest import needs_nemo
from tests.support.dist import ROOT

WORKER = ROOT / "tests/aligner/workers/mcore_skip_worker.py"


@needs_nemo
def test_a_nan_gradient_skips_the_update_under_megatrons_distributed_optimizer():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, str(WORKER)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["optimizer"] == "McoreDistributedOptimizer"
    one, two = out["step1"], out["step2"]
    assert one["skipped"] == 0.0 and one["grad_norm"] > 0 and math.isfinite(one["grad_norm"])  # now logged too
    assert math.isfinite(two["loss"]) and not math.isfinite(two["grad_norm"])
    assert two["skipped"] == 1.0 and out["weights_unchanged"]
