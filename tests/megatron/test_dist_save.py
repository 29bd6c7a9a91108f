"""nemo_dapo.megatron.dist_save: the private megatron-core save path it calls is the installed one, the check says
so when it is not, and the trainer image runs the check at build time. (The save itself runs in the conversion
tests under torchrun, where ``os.fork`` raises: tests/megatron/test_convert_command.py, test_qwen3_convert.py.)"""
from pathlib import Path

from tests.support import megatron_cpu_shim  # noqa: F401  (before megatron)
from nemo_dapo.megatron import dist_save  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_the_installed_megatron_core_has_what_the_writer_calls():
    assert dist_save.check_megatron_api() == []


def test_a_changed_signature_or_a_missing_method_is_named(monkeypatch):
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    monkeypatch.setattr(FileSystemWriterAsync, "write_preloaded_data",
                        staticmethod(lambda transform_list, local_proc_idx, write_bucket, results_queue: None))
    monkeypatch.delattr(TorchDistSaveShardedStrategy, "_get_save_and_finalize_callbacks")
    problems = dist_save.check_megatron_api()
    assert len(problems) == 2
    assert "lacks TorchDistSaveShardedStrategy._get_save_and_finalize_callbacks" in problems[0]
    assert "FileSystemWriterAsync.write_preloaded_data takes ['transform_list'" in problems[1]


def test_the_trainer_image_runs_the_check():
    assert "python -m nemo_dapo.megatron.dist_save" in (ROOT / "containers" / "Dockerfile").read_text()
