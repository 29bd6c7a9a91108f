"""The DAPO actor's loss equals the core loss on the same inputs, under TP=1 (DP=2), TP=2 and PP=2 (torchrun, gloo).

The worker (workers/actor_loss_worker.py) builds the real NeMo-Aligner actor on CPU and compares, per rank, against a
plain reference (full-vocabulary log_softmax + core.loss.dapo_policy_loss on the whole batch in one micro-batch):
old log-probs and entropies, the loss, every parameter gradient, and the clip metrics. The actor takes its
log-probs from the final hidden states through the output-layer shard (no [b, S, V/tp] logits); the same batch also
goes through the former logits path (``logprobs_from_logits``), which must give the same log-probs, loss, metrics and
gradients, and through micro-batches packed by a token budget (``model.dapo.micro_batch_tokens``), which must not
change the update. The DP=2 case gives the two
ranks 3 and 5 samples, rank 0's all truncated: with overlong filtering it trains on zero tokens yet must still
contribute exactly nothing while joining every collective. What the trainer LOGS for the same update
(ActorPolicy.train_step on each rank's share, combined over DP by the step loop) must equal the full-batch
reference too. The same processes check the debug sampler
(generation.MegatronSampler) under each layout. At TP=2 the worker also runs with sequence parallelism on a batch of
odd sequence length (megatron-core splits the sequence over TP): the actor pads it, and loss, metrics and old
log-probs equal those of the same run without sequence parallelism.
"""
import json

import pytest

from tests.aligner.conftest import needs_nemo
from tests.support.dist import ROOT, run_torchrun

pytestmark = [needs_nemo, pytest.mark.nemo, pytest.mark.slow]
WORKER = ROOT / "tests/aligner/workers/actor_loss_worker.py"


def _run(tmp_path, tok_dir, tp, pp, sp=False) -> list:
    out = tmp_path / f"tp{tp}pp{pp}sp{int(sp)}"
    out.mkdir()
    run_torchrun(WORKER, nproc=2, out_dir=out,
                 env={"TP": str(tp), "PP": str(pp), "SP": str(int(sp)), "TOK_DIR": tok_dir})
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def _check_against_reference(results, tp, pp, sampler=True):
    for res in results:
        assert res["dp"] == 2 // (tp * pp)
        assert res["logp_max_abs_diff"] < 1e-5, res
        assert res["entropy_max_abs_diff"] < 1e-4, res
        # the hidden-state log-probs equal those from NeMo's full logits, at every position (fp32 on both sides)
        assert res["paths_logp_max_abs_diff"] < 1e-5 and res["paths_entropy_max_abs_diff"] < 1e-5, res
        # micro-batches trimmed to their own longest row give the same response log-probs
        assert res["trimmed_logp_max_abs_diff"] < 1e-5 and res["trimmed_entropy_max_abs_diff"] < 1e-5, res
        cases = {c["case"]: c for c in res["cases"]}
        assert set(cases) == {"filter+dualclip", "tis", "tis+reject", "tis-seq"}
        for c in cases.values():
            assert c["loss"] == pytest.approx(c["ref_loss"], rel=1e-5, abs=1e-7), c
            assert c["grad_max_abs"] > 1e-3, "the test batch must produce a gradient"
            assert c["grad_max_abs_diff"] < 1e-5 * max(1.0, c["grad_max_abs"]), c
            for k, v in c["ref_metrics"].items():
                assert c["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), (k, c)
            # hidden-state path vs the former logits path: same loss, metrics, gradients
            lg = c["logits_path"]
            assert c["loss"] == pytest.approx(lg["loss"], rel=1e-6, abs=1e-8), c
            assert lg["grad_max_abs_diff"] < 1e-6 * max(1.0, c["grad_max_abs"]), c
            assert lg["metrics"] == pytest.approx(c["metrics"], rel=1e-6, abs=1e-7), c
            # token-budget packing regroups rows only: the update is still the full-batch reference
            pk = c["packed"]
            assert pk["loss"] == pytest.approx(c["ref_loss"], rel=1e-5, abs=1e-7), c
            assert pk["grad_max_abs_diff"] < 1e-5 * max(1.0, c["grad_max_abs"]), c
            for k, v in c["ref_metrics"].items():
                assert pk["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), (k, c)
            # what the trainer logs (ActorPolicy.train_step + the loop's DP combination) is the full-batch value
            assert c["logged"]["loss"] == pytest.approx(c["ref_loss"], rel=1e-5, abs=1e-7), c
            assert set(c["logged"]) == set(c["ref_metrics"]) | {"loss"}, c
            for k, v in c["ref_metrics"].items():
                assert c["logged"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), (k, c)
        # every clip branch must have fired somewhere, or the comparison proves little
        f = cases["filter+dualclip"]["metrics"]
        assert f["clip_frac_low"] > 0 and f["clip_frac_high"] > 0 and f["dual_clip_frac"] > 0
        # overlong filtering removed the 3 truncated rows' tokens from the global count (45 -> 31)
        assert cases["filter+dualclip"]["metrics"]["num_tokens"] < cases["tis"]["metrics"]["num_tokens"]
        # the rejection left about half the rows, whole, out of the loss and the global count
        assert 0 < cases["tis+reject"]["metrics"]["num_tokens"] < cases["tis"]["metrics"]["num_tokens"]
        # one weight per response moves the loss off the per-token one (the same rows, tokens and ratios)
        assert cases["tis-seq"]["ref_loss"] != pytest.approx(cases["tis"]["ref_loss"], rel=1e-3)
        # entropy metric (no filtering) is the token mean of the reference entropy
        assert cases["tis"]["metrics"]["entropy"] == pytest.approx(res["ref_entropy_mean"], rel=1e-5)
        if not sampler:
            continue
        # sampler log-probs = the model's distribution over the tokenizer's vocabulary (padding ids never drawn)
        assert res["sampler_logp_max_abs_diff"] < 1e-5, res["sampler_logp_max_abs_diff"]
        assert res["sampler_max_id"] < res["vocab_size"]
        assert all(1 <= n <= 5 for n in res["sampler_lengths"])


@pytest.mark.parametrize("tp,pp", [(1, 1), (1, 2)], ids=["tp1-dp2", "pp2"])
def test_actor_loss_matches_core_reference(tp, pp, tok_dir, tmp_path):
    results = _run(tmp_path, tok_dir, tp, pp)
    # the debug sampler: one seed, same tokens on every rank (model-parallel peers must agree token by token)
    assert results[0]["sampler_tokens"] == results[1]["sampler_tokens"]
    _check_against_reference(results, tp, pp)


def test_actor_loss_tp2_with_and_without_sequence_parallelism(tok_dir, tmp_path):
    plain, sp = _run(tmp_path, tok_dir, 2, 1), _run(tmp_path, tok_dir, 2, 1, sp=True)
    assert plain[0]["sampler_tokens"] == plain[1]["sampler_tokens"]
    _check_against_reference(plain, 2, 1)
    _check_against_reference(sp, 2, 1, sampler=False)
    for a, b in zip(plain, sp):
        assert b["sp"] and not a["sp"]
        assert b["seq_len"] % 2 == 1, "the batch must not already fit the sequence split"
        assert b["ref_entropy_mean"] == pytest.approx(a["ref_entropy_mean"], rel=1e-5)
        for ca, cb in zip(a["cases"], b["cases"]):
            assert cb["loss"] == pytest.approx(ca["loss"], rel=1e-5, abs=1e-7), (ca, cb)
            assert cb["grad_max_abs"] == pytest.approx(ca["grad_max_abs"], rel=1e-4)
            for k, v in ca["metrics"].items():
                assert cb["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), (k, ca, cb)
