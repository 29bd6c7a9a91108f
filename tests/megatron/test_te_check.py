"""nemo_dapo.megatron.te_check: the installed megatron-core 0.10 has the TE-wrapper names the refit relies on (read
here, for real); TE itself is not installed here, so its side is checked on texts, and the trainer image runs the
whole check at build time."""
from pathlib import Path

import pytest

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
    # NeMo-Aligner 0.7.0's image: TE 1.8.0.dev0 has no grouped linear (no grouped_linear.py): not an image error
    assert te_check.check({MEGATRON: files[MEGATRON], TE: None}, "1.8.0.dev0") == []
    assert "not installed" in " ".join(te_check.check({MEGATRON: files[MEGATRON], TE: None}, "1.9.0"))
    renamed = te_check.check({**files, TE: TE_TEXT.replace("weight{i}", "weights_{i}")}, "2.0.0")
    assert len(renamed) == 1 and TE in renamed[0]
    assert te_check.check({MEGATRON: None, TE: TE_TEXT}, "2.0.0") == [f"{MEGATRON} is not installed"]


def test_the_trainer_image_runs_the_check():
    assert "python -m nemo_dapo.megatron.te_check" in (ROOT / "containers" / "Dockerfile").read_text()


@pytest.mark.parametrize("version, grouped, apex_qk", [
    ("1.8.0.dev0", False, True), ("1.8.0", False, True), ("1.9.0.dev0", True, True),  # as megatron-core compares
    ("1.9.0", True, False), ("1.13.0+7d576ed", True, False), ("2.1.0", True, False)])
def test_te_1_9_gates_grouped_gemm_and_te_qk_norm_as_megatron_core_does(version, grouped, apex_qk):
    assert (te_check.grouped_gemm_problem(version) == "") is grouped
    assert te_check.qk_norm_is_apex(version) is apex_qk
    line = te_check.report(version)
    assert ("grouped-GEMM experts available" in line) is grouped and ("torch norm" in line) is apex_qk


def test_grouped_gemm_is_refused_without_te_or_below_1_9():
    assert "moe_grouped_gemm=False" in te_check.grouped_gemm_problem(None)
    assert "found 1.8.0.dev0" in te_check.grouped_gemm_problem("1.8.0.dev0")
    assert te_check.qk_norm_is_apex(None) is False  # no TE: no TE spec to fix (check names the missing TE)
