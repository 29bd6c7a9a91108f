"""Qwen3 / Qwen3-MoE: the HF config map, the router rule, refusals; and (slow) logit parity with transformers 5.x in
both conversion directions through the checkpoint files of the conversion command, at TP=2, PP=2 and EP=2.

transformers 4.47 (this venv) has no Qwen3, so the reference runs in the vLLM venv's interpreter (transformers 5.x;
``$NEMO_DAPO_VLLM_PYTHON`` or ``.venv-vllm/bin/python``) through tests/megatron/workers/qwen3_hf_worker.py, tensors
exchanged as files; skipped when there is none. Tolerance: fp32, max |logit diff| < 1e-4 (logits of order 4).
"""
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from nemo_dapo.megatron.convert import (conversion_rules, gpt_model_kwargs_from_hf, hf_arch, load_hf_config,
                                        megatron_config_from_hf)
from tests.support.dist import run_torchrun

ROOT = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).parent / "workers"
HF_PYTHON = os.environ.get("NEMO_DAPO_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
HAVE_HF5 = os.path.isfile(HF_PYTHON) and os.access(HF_PYTHON, os.X_OK)

# Qwen3-235B-A22B's config.json (Hugging Face Qwen/Qwen3-235B-A22B), the keys the conversion reads
QWEN3_235B = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=4096, num_hidden_layers=94,
                  num_attention_heads=64, num_key_value_heads=4, head_dim=128, intermediate_size=12288,
                  moe_intermediate_size=1536, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                  decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1000000.0, rms_norm_eps=1e-6,
                  vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=False, attention_bias=False,
                  hidden_act="silu", rope_scaling=None, use_sliding_window=False)
# Qwen3-32B (Qwen/Qwen3-32B)
QWEN3_32B = dict(model_type="qwen3", hidden_size=5120, num_hidden_layers=64, num_attention_heads=64,
                 num_key_value_heads=8, head_dim=128, intermediate_size=25600, rope_theta=1000000.0,
                 rms_norm_eps=1e-6, vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=False,
                 attention_bias=False, hidden_act="silu")


def config(tmp_path, raw):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return load_hf_config(str(tmp_path))


def test_qwen3_235b_maps_to_megatron(tmp_path):
    cfg = config(tmp_path, QWEN3_235B)
    kw, model_kw = megatron_config_from_hf(cfg), gpt_model_kwargs_from_hf(cfg)
    assert kw["qk_layernorm"] is True and kw["kv_channels"] == 128 != 4096 // 64
    assert (kw["num_attention_heads"], kw["num_query_groups"]) == (64, 4)
    assert not kw["add_qkv_bias"] and not kw["add_bias_linear"]
    assert (kw["num_moe_experts"], kw["moe_router_topk"], kw["moe_ffn_hidden_size"]) == (128, 8, 1536)
    assert kw["moe_router_pre_softmax"] is False  # norm_topk_prob: renormalised top-k = top-k then softmax
    assert "moe_shared_expert_intermediate_size" not in kw
    assert model_kw["rotary_base"] == 1e6 and model_kw["vocab_size"] == 151936
    assert not model_kw["share_embeddings_and_output_weights"]
    names = [r.mc for r in conversion_rules(hf_arch(cfg))]
    assert names.count("decoder.layers.93.self_attention.q_layernorm.weight") == 1
    assert "decoder.layers.0.mlp.experts.local_experts.127.linear_fc2.weight" in names
    hf = {h for r in conversion_rules(hf_arch(cfg)) for h in r.hf}
    assert {"model.layers.5.self_attn.k_norm.weight", "model.layers.5.mlp.gate.weight",
            "model.layers.5.mlp.experts.127.up_proj.weight"} <= hf


def test_qwen3_32b_is_dense_with_qk_norm(tmp_path):
    cfg = config(tmp_path, QWEN3_32B)
    kw = megatron_config_from_hf(cfg)
    assert kw["qk_layernorm"] and "num_moe_experts" not in kw and kw["ffn_hidden_size"] == 25600
    assert (kw["kv_channels"], kw["num_query_groups"]) == (128, 8)
    assert gpt_model_kwargs_from_hf(cfg)["rotary_percent"] == 1.0


@pytest.mark.parametrize("spec", ["local", "te"])
@pytest.mark.parametrize("raw", [QWEN3_32B, QWEN3_235B], ids=["dense", "moe"])
def test_query_norm_is_q_norm_and_key_norm_is_k_norm(tmp_path, raw, spec):
    """A swapped pair would still round-trip exactly (the map is used both ways), and only the logit parity, which
    needs transformers 5, would see it: megatron's ``q_layernorm`` normalises the query heads as HF's ``q_norm``
    does, ``k_layernorm`` the key heads as ``k_norm``. Likewise ``linear_fc1`` is [gate; up]: megatron's SwiGLU
    is silu(first half) * second half, HF's silu(gate_proj) * up_proj."""
    rules = {r.mc: r.hf for r in conversion_rules(hf_arch(config(tmp_path, raw)), spec)}
    for i in (0, raw["num_hidden_layers"] - 1):
        for p in "qk":
            assert rules[f"decoder.layers.{i}.self_attention.{p}_layernorm.weight"] == \
                (f"model.layers.{i}.self_attn.{p}_norm.weight",)
    fc1 = [hf for mc, hf in rules.items() if mc.endswith("linear_fc1.weight")]
    assert fc1 and all(hf[0].endswith("gate_proj.weight") and hf[1].endswith("up_proj.weight") for hf in fc1)


@pytest.mark.parametrize("change,match", [({"mlp_only_layers": [3]}, "mlp_only_layers"),
                                          ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
                                          ({"attention_bias": True}, "attention_bias"),
                                          ({"model_type": "qwen3_next"}, "model_type")])
def test_unsupported_qwen3_configs_are_refused(tmp_path, change, match):
    with pytest.raises(ValueError, match=match):
        hf_arch(config(tmp_path, dict(QWEN3_235B, **change)))


def test_missing_config_is_one_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_config(str(tmp_path))


def hf_router(logits, k, norm_topk_prob):
    """HF Qwen3-MoE's rule (transformers 5.x Qwen3MoeTopKRouter): softmax over all experts, top-k, renormalise."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top, idx = torch.topk(probs, k, dim=-1)
    if norm_topk_prob:
        top = top / top.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter(1, idx, top)


@pytest.mark.parametrize("experts,k", [(128, 8), (8, 2), (4, 2)])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_megatron_router_equals_hf_router(experts, k, norm_topk_prob):
    """megatron-core 0.10's routing with the pre_softmax the conversion sets gives HF's expert weights: top-k of the
    logits then softmax over them == softmax, top-k, renormalise (softmax is monotone, and p_i / sum_S p_j =
    e^l_i / sum_S e^l_j); without renormalisation, pre-softmax top-k."""
    from tests.support import megatron_cpu_shim  # noqa: F401
    from megatron.core.transformer.moe.moe_utils import topk_softmax_with_capacity

    logits = torch.randn(64, experts, generator=torch.Generator().manual_seed(experts + k)) * 3
    probs, routing_map, _ = topk_softmax_with_capacity(logits, k, use_pre_softmax=not norm_topk_prob)
    want = hf_router(logits, k, norm_topk_prob)
    assert torch.equal(routing_map, want > 0)
    assert (probs - want).abs().max() < 1e-6
    if norm_topk_prob:  # the other rule would be wrong: the check can fail
        wrong, _, _ = topk_softmax_with_capacity(logits, k, use_pre_softmax=True)
        assert (wrong - want).abs().max() > 1e-2


# ---------------------------------------------------------------------------------------------------------------
# logit parity with transformers 5.x, both directions, through the conversion command's files
# ---------------------------------------------------------------------------------------------------------------

def hf_worker(mode, out):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    proc = subprocess.run([HF_PYTHON, str(WORKERS / "qwen3_hf_worker.py"), mode, str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, f"{mode}: rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    report = json.loads(lines[-1])
    if int(report["transformers"].split(".")[0]) < 5:
        pytest.skip(f"{HF_PYTHON} has transformers {report['transformers']}, which has no Qwen3")
    return report[mode]


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    if not HAVE_HF5:
        pytest.skip(f"no transformers-5 interpreter at {HF_PYTHON}: make the vLLM venv with `bash scripts/install.sh "
                    ".venv-vllm engine-vllm` or set NEMO_DAPO_VLLM_PYTHON")
    out = tmp_path_factory.mktemp("qwen3_parity")
    made = hf_worker("make", out)
    run_torchrun(WORKERS / "qwen3_parity_worker.py", nproc=2, out_dir=out, timeout=900)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return made, ranks, hf_worker("check", out)


@pytest.mark.slow
def test_hf_to_megatron_logits_equal_transformers(parity):
    made, ranks, _ = parity
    for family, r in made.items():
        assert r["reload_max_diff"] == 0.0 and r["logit_scale"] > 2.0, (family, r)
    cases = [k for k in ranks[0] if "/direct/" in k or "/nemo_" in k]
    assert len(cases) == 3 + 2 * 3 + 4 + 3 * 4  # per family: direct (one per layout) + saved x load layouts
    for family in ("qwen3", "qwen3_moe"):
        assert {k.split("/")[-1] for k in cases if k.startswith(family + "/direct/")} >= {"tp2", "pp2"}
    assert "qwen3_moe/direct/ep2" in cases and "qwen3_moe/nemo_ep2/load_tp2" in cases
    for key in cases:
        diffs = [res[key] for res in ranks if res[key] is not None]  # None: a first pipeline stage (no logits)
        assert diffs and max(diffs) < 1e-4, (key, diffs)


@pytest.mark.slow
def test_megatron_to_hf_logits_equal_transformers(parity):
    _, ranks, checked = parity
    assert sorted(checked) == ["qwen3/mc_pp2", "qwen3/mc_tp2", "qwen3_moe/mc_ep2", "qwen3_moe/mc_pp2",
                               "qwen3_moe/mc_tp2"]
    for case, r in checked.items():
        assert r["max_diff"] < 1e-4 and r["logit_scale"] > 2.0, (case, r)
        assert ranks[0][f"{case}/export_layout"] != case.split("_")[-1]  # exported in another layout


@pytest.mark.slow
def test_qk_norm_is_an_rmsnorm_over_head_dim_and_matters(parity):
    _, ranks, _ = parity
    for family in ("qwen3", "qwen3_moe"):
        assert ranks[0][f"{family}/qk_norm"] == ["RMSNorm", [16], 1e-6]  # torch.nn.RMSNorm(head_dim)
        assert ranks[0][f"mutation/{family}/no_qk_norm"] > 0.1  # a conversion without QK-norm is caught

