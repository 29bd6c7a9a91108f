"""A second real loader for the refit: Megatron-core (gloo, 2 ranks) at TP=2, PP=2 and EP=2 -> our refit stream
(refit_gather + refit_hf, small buckets) -> the engine server over shared memory (EngineProcess / EngineClient) ->
vLLM's CPU engine (engines/vllm.py). After the initial push and after one DAPO update on the Megatron side, vLLM's
log-probs of its own samples equal Megatron's and transformers' within 1e-3 (fp32).

Models (tests/support/hf_tiny.py, random, 2 layers, vocabulary 250 padded to 256 by megatron): Qwen2 (QKV bias,
GQA 4:2), Mixtral (4 experts, top-2), Qwen3 (QK-norm, head_dim 32 != hidden / heads, tied embeddings), Qwen3-MoE
(QK-norm, 4 experts top-2 renormalised, router ``mlp.gate``, experts ``mlp.experts.{e}``). This checks, in a loader
that is not ours, the HF names, the QKV split, gate/up order, global expert indices, the vocabulary cut, QK-norm and
fused groups split across buckets. The worker (tests/megatron/workers/refit_vllm_worker.py) runs every family in
one torchrun; transformers 5.x (the vLLM venv's: the main venv's 4.47 has no Qwen3) scores the same samples.

Needs the vLLM venv (``bash scripts/install.sh .venv-vllm engine-vllm``; ``$NEMO_DAPO_VLLM_PYTHON`` or
``.venv-vllm/bin/python``), else skipped.
"""
import json
import os
import struct
from pathlib import Path

import pytest

from tests.support.dist import run_torchrun

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).parent / "workers" / "refit_vllm_worker.py"
VLLM_PYTHON = os.environ.get("NEMO_DAPO_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
LAYOUTS = {"qwen2": ("tp2", "pp2"), "mixtral": ("ep2", "tp2", "pp2"), "qwen3": ("tp2", "pp2"),
           "qwen3_moe": ("ep2", "tp2", "pp2")}
MOE = ("mixtral", "qwen3_moe")
CASES = [f"{family}/{layout}" for family, layouts in LAYOUTS.items() for layout in layouts]
# MoE at TP=2 is pushed but not trained: megatron-core 0.10's MoELayer trains under TP only with sequence
# parallelism, which its torch norms (no TE / apex here) refuse; the update is checked at EP=2 and PP=2
UPDATED = [c for c in CASES if not (c.split("/")[0] in MOE and c.endswith("/tp2"))]
TOL = 1e-3  # fp32 on every side; measured 1e-6 to 2e-6 (see the readme notes)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (os.path.isfile(VLLM_PYTHON) and os.access(VLLM_PYTHON, os.X_OK)),
                       reason=f"no vLLM interpreter at {VLLM_PYTHON}: make the venv with `bash scripts/install.sh "
                              ".venv-vllm engine-vllm` or set NEMO_DAPO_VLLM_PYTHON"),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("refit_vllm")
    args = [f"{family}:{','.join(layouts)}" for family, layouts in LAYOUTS.items()]
    run_torchrun(WORKER, *args, nproc=2, out_dir=out, env={"VLLM_PYTHON": VLLM_PYTHON}, timeout=3600)
    res = json.loads((out / "result.json").read_text())
    res["dir"] = out
    return res


def layout_result(results, case):
    family, layout = case.split("/")
    fam = results["families"][family]
    assert "error" not in fam, f"{family}: {fam['error']}"
    res = fam["layouts"][layout]
    assert "error" not in res, f"{case}: {res['error']}"
    return res


def checkpoint_names(path):
    """Tensor names in a safetensors file's header (transformers 5's save_pretrained wrote it)."""
    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    return sorted(n for n in header if n != "__metadata__")


@pytest.mark.parametrize("case", CASES)
def test_unpushed_weights_are_seen(results, case):
    """Negative control: before the push the engine holds another model, and the comparison shows it."""
    assert layout_result(results, case)["before"]["vllm_vs_megatron"] > 10 * TOL


PHASES = [(c, "initial") for c in CASES] + [(c, "updated") for c in UPDATED]


@pytest.mark.parametrize("case,phase", PHASES)
def test_vllm_logprobs_equal_megatron_and_transformers(results, case, phase):
    res = layout_result(results, case)
    assert ("updated" in res) == (case in UPDATED), (case, sorted(res))
    r = res[phase]
    assert len(r["vllm"]) == 8 and all(len(x) == 8 for x in r["vllm"])
    for pair in ("vllm_vs_megatron", "vllm_vs_transformers", "megatron_vs_transformers"):
        assert r[pair] < TOL, (case, phase, pair, r[pair])


@pytest.mark.parametrize("case", UPDATED)
def test_the_update_moved_the_model(results, case):
    """The update changed Megatron's log-probs of the post-update samples by far more than the tolerance, so an
    engine that kept the pushed-before weights would fail the comparison."""
    res = layout_result(results, case)
    assert res["train"]["skipped"] == 0.0 and res["train"]["grad_norm"] > 0
    assert res["updated"]["update_moved"] > 10 * TOL


@pytest.mark.parametrize("case", CASES)
def test_every_checkpoint_tensor_crossed_in_small_buckets(results, case):
    """The stream's names are exactly those of the HF checkpoint (as transformers 5 saves it), in many buckets,
    with the fused groups the engine assembles (q/k/v, gate/up or w1/w3, per expert) split across buckets."""
    family, layout = case.split("/")
    res = layout_result(results, case)
    want = checkpoint_names(results["dir"] / f"{family}-1000" / "model.safetensors")
    for phase in ("initial", "updated") if case in UPDATED else ("initial",):
        r = res[phase]
        assert r["names"] == want, (case, phase, sorted(set(r["names"]) ^ set(want))[:6])
        assert r["push"]["tensors"] == len(want) and r["push"]["buckets"] == r["buckets"] > 10
        assert max(r["bucket_tensors"]) > 1  # small tensors share buckets
        kinds = ("qkv", "fc1_expert") if family in MOE else ("qkv", "fc1")
        for kind in kinds:
            split, total = r["split"][kind]
            assert split > 0, (case, phase, kind, r["split"])


@pytest.mark.parametrize("family", MOE)
def test_moe_layers_run_on_vllm_cpu_fused_moe(results, family):
    lines = results["families"][family].get("engine_moe_backend", [])
    assert any("CPU" in ln for ln in lines), lines
