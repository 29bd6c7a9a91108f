"""The DAPO actor on Qwen3 (QK-norm, GQA, head_dim != hidden/heads) and Qwen3-MoE through NeMo-Aligner on CPU.

A tiny transformers-5 checkpoint (tests/megatron/workers/qwen3_hf_worker.py, in the vLLM venv: this venv's
transformers 4.47 has no Qwen3; skipped without it) is converted by ``convert_ckpt.hf_to_nemo`` and restored the
launcher's way (``load_and_override_model_config`` + ``load_from_nemo``), so NeMo builds the model through the
actor's ``model_provider_func`` with ``model.qk_layernorm`` from the checkpoint's model_config.yaml. The worker
(workers/qwen3_actor_worker.py) checks the actor's log-probs against transformers' and trains one step.
Layouts: dense at TP=2; MoE at PP=2 (NeMo 2.1 refuses EP without megatron_amp_O2, and MoE with TP without sequence
parallelism, which the CPU local spec's norm does not run; the conversion itself is checked at EP=2 in
tests/megatron/test_qwen3_convert.py).
"""
import json

import pytest

from tests.aligner.conftest import needs_nemo
from tests.megatron.test_qwen3_convert import HAVE_HF5, HF_PYTHON, hf_worker
from tests.support.dist import ROOT, run_torchrun

pytestmark = [needs_nemo, pytest.mark.nemo, pytest.mark.slow,
              pytest.mark.skipif(not HAVE_HF5, reason=f"no transformers-5 interpreter at {HF_PYTHON} (the Qwen3 "
                                 "reference): make it with `bash scripts/install.sh .venv-vllm engine-vllm`")]
WORKER = ROOT / "tests/aligner/workers/qwen3_actor_worker.py"


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3_hf")
    hf_worker("make", out)
    return out


@pytest.mark.parametrize("family,tp,pp", [("qwen3", 2, 1), ("qwen3_moe", 1, 2)])
def test_actor_restores_converted_qwen3_and_trains_one_step(hf_models, tok_dir, tmp_path, family, tp, pp):
    run_torchrun(WORKER, nproc=2, out_dir=tmp_path, timeout=900,
                 env={"FAMILY": family, "TP": str(tp), "PP": str(pp), "TOK_DIR": tok_dir,
                      "HF_DIR": str(hf_models / family / "hf"), "HF_LOGITS": str(hf_models / family / "hf_logits.pt")})
    for rank in (0, 1):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert res["checkpoint_qk_layernorm"] is True
        assert res["q_layernorm"] == ["RMSNorm", [16]]  # torch.nn.RMSNorm over head_dim, built by NeMo + our spec
        assert res["extra_state"]["persistent"] == 0 and res["extra_state"]["local"] > 0, res["extra_state"]
        assert res["logp_max_diff"] < 1e-4, res["logp_max_diff"]  # the actor's log-probs are transformers'
        assert res["skipped"] == 0.0 and abs(res["loss"]) < 10
        assert res["unchanged"] == [], res["unchanged"]  # every parameter of this stage took the step
        assert res["qk_norm_params"] and all(changed for _, changed in res["qk_norm_params"])
        assert res["mean_logp_after"] > res["mean_logp_before"] + 0.1  # advantage +1: the samples got likelier
    if tp > 1:  # every TP rank holds the QK-norm weights whole: their gradients are summed over TP, so the copies
        # stay equal (without the sum each rank trained on its own heads' part and they drifted ~0.03 apart)
        a, b = (json.loads((tmp_path / f"rank{r}.json").read_text())["qk_norm_values"] for r in (0, 1))
        assert a and a.keys() == b.keys()
        drift = max(abs(x - y) for n in a for x, y in zip(a[n], b[n]))
        print(f"QK-norm copies on the two TP ranks after one step: max difference {drift:.3g}")  # pytest -s
        assert drift == 0.0, drift


def test_qk_norm_step_at_tp2_equals_the_one_rank_step(hf_models, tok_dir, tmp_path):
    """The QK-norm weights after one step at TP=2 (each rank's gradient a partial sum over its heads, summed over
    TP: ``actor.finish_training_step``) equal those of the same step on one rank."""
    values = {}
    for tp in (1, 2):
        out = tmp_path / f"tp{tp}"
        out.mkdir()
        hf = hf_models / "qwen3"
        run_torchrun(WORKER, nproc=tp, out_dir=out, timeout=900,
                     env={"FAMILY": "qwen3", "TP": str(tp), "PP": "1", "TOK_DIR": tok_dir, "HF_DIR": str(hf / "hf"),
                          "HF_LOGITS": str(hf / "hf_logits.pt")})
        values[tp] = json.loads((out / "rank0.json").read_text())["qk_norm_values"]
    assert values[1] and values[1].keys() == values[2].keys()
    worst = max(abs(a - b) for n, one in values[1].items() for a, b in zip(one, values[2][n]))
    print(f"QK-norm weights after one step, TP=2 against one rank: max difference {worst:.3g}")  # pytest -s
    assert worst < 1e-5, worst  # fp32; without the sum: ~0.03
