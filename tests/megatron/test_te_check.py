"""nemo_dapo.megatron.te_check: the installed megatron-core 0.10 has the TE-wrapper names the refit relies on (read
here, for real); TE itself is not installed here, so its side is checked on texts, and the trainer image runs the
whole check at build time."""
from pathlib import Path

from nemo_dapo.megatron import te_check

ROOT = Path(__file__).resolve().parents[2]
MEGATRON = "megatron/core/extensions/transformer_engine.py"
TE = "transformer_engine/pytorch/module/grouped_linear.py"
TE_TEXT = 'for i in range(self.num_gemms):\n    self.register_parameter(f"weight{i}", ...)\n'


def test_the_installed_megatron_core_names_grouped_weights_weight_i():
    files = te_check.installed_files()
    assert files[MEGATRON] is not None and te_check.FILES[MEGATRON] in files[MEGATRON]
    assert te_check.check({**files, TE: TE_TEXT}, "1.14.0+a1b2c3") == []


def test_each_mismatch_is_named():
    files = {MEGATRON: te_check.installed_files()[MEGATRON], TE: TE_TEXT}
    assert "not installed" in " ".join(te_check.check(files, None))
    assert "< 1.9" in " ".join(te_check.check(files, "1.8.0"))
    renamed = te_check.check({**files, TE: TE_TEXT.replace("weight{i}", "weights_{i}")}, "2.0.0")
    assert len(renamed) == 1 and TE in renamed[0]
    assert te_check.check({MEGATRON: None, TE: TE_TEXT}, "2.0.0") == [f"{MEGATRON} is not installed"]


def test_the_trainer_image_runs_the_check():
    assert "python -m nemo_dapo.megatron.te_check" in (ROOT / "containers" / "Dockerfile").read_text()
