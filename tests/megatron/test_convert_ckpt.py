"""nemo_dapo.megatron.convert_ckpt in one process: NeMo's precision spellings, and the output directory that only
appears complete (written under ``<out>.partial``, renamed at the end; a former interrupted run's leftovers cleared).
The conversion itself runs under torchrun in tests/megatron/test_convert_command.py."""
import pytest

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
