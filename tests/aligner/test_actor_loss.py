"""The DAPO actor's loss equals the core loss on the same inputs, under TP=1 (DP=2), TP=2 and PP=2 (torchrun, gloo).

The worker (workers/actor_loss_worker.py) builds the real NeMo-Aligner actor on CPU and compares, per rank, against a
plain reference (full-vocabulary log_softmax + core.loss.dapo_policy_loss on the whole batch in one micro-batch):
old log-probs and entropies, the loss, every parameter gradient, and the clip metrics. The DP=2 case gives the two
ranks 3 and 5 samples, rank 0's all truncated: with overlong filtering it trains on zero tokens yet must still
contribute exactly nothing while joining every collective. The same processes check the debug sampler
(generation.MegatronSampler) under each layout.
"""
import json

import pytest

from tests.aligner.conftest import needs_nemo
from tests.support.dist import ROOT, run_torchrun

pytestmark = [needs_nemo, pytest.mark.nemo, pytest.mark.slow]
WORKER = ROOT / "tests/aligner/workers/actor_loss_worker.py"


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)], ids=["tp1-dp2", "tp2", "pp2"])
def test_actor_loss_matches_core_reference(tp, pp, tok_dir, tmp_path):
    run_torchrun(WORKER, nproc=2, out_dir=tmp_path, env={"TP": str(tp), "PP": str(pp), "TOK_DIR": tok_dir})
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    # the debug sampler: one seed, same tokens on every rank (model-parallel peers must agree token by token)
    assert results[0]["sampler_tokens"] == results[1]["sampler_tokens"]
    for res in results:
        assert res["dp"] == 2 // (tp * pp)
        assert res["logp_max_abs_diff"] < 1e-5, res
        assert res["entropy_max_abs_diff"] < 1e-4, res
        cases = {c["case"]: c for c in res["cases"]}
        assert set(cases) == {"filter+dualclip", "tis"}
        for c in cases.values():
            assert c["loss"] == pytest.approx(c["ref_loss"], rel=1e-5, abs=1e-7), c
            assert c["grad_max_abs"] > 1e-3, "the test batch must produce a gradient"
            assert c["grad_max_abs_diff"] < 1e-5 * max(1.0, c["grad_max_abs"]), c
            for k, v in c["ref_metrics"].items():
                assert c["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), (k, c)
        # every clip branch must have fired somewhere, or the comparison proves little
        f = cases["filter+dualclip"]["metrics"]
        assert f["clip_frac_low"] > 0 and f["clip_frac_high"] > 0 and f["dual_clip_frac"] > 0
        # overlong filtering removed the 3 truncated rows' tokens from the global count (45 -> 31)
        assert cases["filter+dualclip"]["metrics"]["num_tokens"] < cases["tis"]["metrics"]["num_tokens"]
        # entropy metric (no filtering) is the token mean of the reference entropy
        assert cases["tis"]["metrics"]["entropy"] == pytest.approx(res["ref_entropy_mean"], rel=1e-5)
        # sampler log-probs = the model's distribution over the tokenizer's vocabulary (padding ids never drawn)
        assert res["sampler_logp_max_abs_diff"] < 1e-5, res["sampler_logp_max_abs_diff"]
        assert res["sampler_max_id"] < res["vocab_size"]
        assert all(1 <= n <= 5 for n in res["sampler_lengths"])
