"""With megatron-core's distributed optimizer (``mcore_distributed_optim``: every MoE recipe) NeMo-Aligner's
``clip_gradients`` returns no norm and megatron-core 0.10's bf16 step neither checks nor refuses a NaN gradient, so
the trainer reads the norm itself before the step (megatron/step.megatron_grad_norm): a NaN gradient with a finite
loss skips the update and the weights stay as they were. Runs tests/aligner/workers/mcore_skip_worker.py (the real
actor, NeMo's optimizer wrapper and ActorPolicy on CPU)."""
import math

from tests.aligner.conftest import needs_nemo
from tests.support.dist import ROOT, run_json

WORKER = ROOT / "tests/aligner/workers/mcore_skip_worker.py"


@needs_nemo
def test_a_nan_gradient_skips_the_update_under_megatrons_distributed_optimizer():
    out = run_json(str(WORKER))
    assert out["optimizer"] == "McoreDistributedOptimizer"
    one, two = out["step1"], out["step2"]
    assert one["skipped"] == 0.0 and one["grad_norm"] > 0 and math.isfinite(one["grad_norm"])  # now logged too
    assert math.isfinite(two["loss"]) and not math.isfinite(two["grad_norm"])
    assert two["skipped"] == 1.0 and out["weights_unchanged"]
