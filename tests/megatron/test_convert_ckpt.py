"""nemo_dapo.megatron.convert_ckpt in one process: NeMo's precision spellings, the output directory that only
appears complete (written under ``<out>.partial``, renamed at the end; a former interrupted run's leftovers
cleared), and which rank exports which HF tensors. The conversion itself runs under torchrun in
tests/megatron/test_convert_command.py."""
import pytest
import torch

from tests.support import megatron_cpu_shim  # noqa: F401  (before megatron)
from nemo_dapo.megatron import convert_ckpt  # noqa: E402


@pytest.mark.parametrize("precision,want", [(16, "fp16"), ("16-mixed", "fp16"), ("bf16", "bf16"),
                                            ("bf16-mixed", "bf16"), (32, "fp32"), ("32-true", "fp32"),
                                            ("fp16", "fp16")])
def test_nemo_precision_names_the_checkpoint_dtype(precision, want):
    """model_config.yaml writes NeMo's ``precision`` (16, bf16, 32, or Lightning's '-mixed' forms); reading it back
    must give the dtype the weights were saved in (fp16 read as fp32 would double the exported files)."""
    assert convert_ckpt.dtype_of_precision(precision) == want


def test_an_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="precision"):
        convert_ckpt.dtype_of_precision("8")


def test_the_output_appears_only_complete_and_old_leftovers_are_cleared(gloo_world_of_one, tmp_path):
    out = tmp_path / "converted"
    stale = tmp_path / "converted.partial"
    stale.mkdir()
    (stale / "model-rank00001.safetensors").write_text("from an interrupted run")
    partial = convert_ckpt._start(str(out))
    assert partial == str(stale) and list(stale.iterdir()) == []  # nothing of the former run is kept
    assert not out.exists()  # not visible while being written
    (stale / "config.json").write_text("{}")
    convert_ckpt._finish(partial, str(out))
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]
    assert not stale.exists()  # renamed, not copied: no second copy of the weights left behind
    with pytest.raises(FileExistsError, match="exists"):
        convert_ckpt._start(str(out))


@pytest.mark.parametrize("ep_rank", [0, 1])
def test_each_hf_tensor_is_exported_by_exactly_one_rank(tmp_path, monkeypatch, ep_rank):
    """nemo_to_hf: every rank writes the HF tensors it owns into a file of its own, and the index maps each name to
    one file. At EP=2 (TP=PP=1) EP rank e owns its experts; the replicated tensors (embedding, attention, norms,
    router) are written by EP rank 0 only, so no tensor is written twice. Expected names: a Mixtral of 4 experts,
    2 per EP rank, named in HF's terms by hand."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from nemo_dapo.megatron.convert_shard import Parallel, hf_to_megatron_shard
    from tests.megatron.workers.convert_models import PADDED_VOCAB, configs, tiny_model

    cfg = configs()["mixtral"]
    hf = {n: t.detach() for n, t in tiny_model("mixtral").state_dict().items()}
    local = hf_to_megatron_shard(hf, cfg, Parallel(ep=2), ep_rank=ep_rank, padded_vocab=PADDED_VOCAB)
    model = type("Rank", (), {"state_dict": lambda self: dict(local)})()
    monkeypatch.setattr(convert_ckpt, "_parallel", lambda: Parallel(ep=2))
    monkeypatch.setattr(convert_ckpt, "_coords", lambda: (0, 0, ep_rank))
    monkeypatch.setattr(convert_ckpt, "_gather_tp", lambda name, tensor, expert: tensor)  # TP = 1
    monkeypatch.setattr(convert_ckpt.dist, "get_rank", lambda: ep_rank)
    written = dict(convert_ckpt.export_rank_hf(model, cfg, str(tmp_path)))
    mine = {f"experts.{2 * ep_rank}.", f"experts.{2 * ep_rank + 1}."}
    want = {n for n in hf if any(e in n for e in mine) or (ep_rank == 0 and ".experts." not in n)}
    assert set(written) == want
    got = load_file(str(tmp_path / f"model-rank{ep_rank:05d}.safetensors"))
    assert set(got) == want and all(torch.equal(got[n], hf[n]) for n in want)
