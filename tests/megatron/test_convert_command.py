"""``nemo-dapo convert`` itself under torchrun (2 ranks, gloo, CPU): HF -> NeMo checkpoint at TP=2 and back at
TP=2 gives the original tensors exactly (fp32)."""
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the tiny HF model comes from transformers")
from safetensors.torch import load_file  # noqa: E402

from tests.megatron.workers.convert_models import tiny_model  # noqa: E402
from tests.support.dist import run_torchrun  # noqa: E402

WORKER = Path(__file__).parent / "workers" / "convert_cli_worker.py"


@pytest.mark.slow
def test_convert_command_round_trip_under_torchrun(tmp_path):
    hf = tmp_path / "hf"
    tiny_model("qwen2").save_pretrained(hf, safe_serialization=True)
    nemo, back = tmp_path / "nemo", tmp_path / "back"
    out = run_torchrun(WORKER, "hf-to-nemo", "--hf", str(hf), "--out", str(nemo), "--tp", "2", "--dtype", "fp32",
                       nproc=2, timeout=900)
    assert f"wrote {nemo}" in out.stdout
    assert (nemo / "model_config.yaml").is_file() and (nemo / "model_weights").is_dir()
    run_torchrun(WORKER, "nemo-to-hf", "--nemo", str(nemo), "--out", str(back), "--tp", "2", nproc=2, timeout=900)
    want = load_file(hf / "model.safetensors")
    got = {}
    for f in sorted(back.glob("*.safetensors")):
        got.update(load_file(f))
    assert set(got) == set(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
