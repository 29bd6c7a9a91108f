"""What the DAPO actor takes from ``model.dapo`` and NeMo's parallel keys when NeMo 2.1 builds it (one process,
tests/aligner/workers/actor_config_worker.py). The loss tests (test_actor_loss.py) sample at temperature 1 and run
without sequence or context parallelism, where a wrong temperature or sequence multiple changes nothing."""
import pytest

from tests.aligner.conftest import needs_nemo
from tests.support.dist import ROOT, run_json

pytestmark = [needs_nemo, pytest.mark.nemo, pytest.mark.slow]
WORKER = ROOT / "tests/aligner/workers/actor_config_worker.py"


def test_the_actor_reads_its_sampling_temperature_pads_to_megatrons_split_and_scores_the_last_column():
    out = run_json(str(WORKER))
    # log pi is taken at the temperature the rollouts were sampled at (logits / T), as the reference does
    assert out["logprob_temperature"] == 0.6
    assert (out["forward_micro_batch_size"], out["logprob_chunk_size"]) == (3, 5)
    assert out["loss_fn"] is None  # the trainer hands over the loss its builder made
    # 8 x TP with sequence parallelism, else 16; times CP (the worker's LAYOUTS: (TP, SP, CP))
    assert out["multiples"] == [16, 8 * 2, 8 * 4 * 2, 16 * 2] and out["seq_len_multiple"] == 16
    assert "model.dapo is missing" in out["missing_dapo"]
    # a row that fills the batch width (a truncated response after the longest prompt) has a log-prob for its last
    # token, the one it gets when the batch is one padding column wider (causal attention: padding after it
    # changes nothing)
    assert all(x < 0 for x in out["last_logp"])
    assert out["last_logp"] == pytest.approx(out["last_logp_padded"], abs=1e-5)
