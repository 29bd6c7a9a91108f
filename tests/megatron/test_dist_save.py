"""nemo_dapo.megatron.dist_save: the private megatron-core save path it calls is the installed one, the check says
so when it is not, and the trainer image runs the check at build time. (The save itself runs in the conversion
tests under torchrun, where ``os.fork`` raises: tests/megatron/test_convert_command.py, test_qwen3_convert.py.)"""
import os
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


def test_a_save_starts_no_process_and_loads_back(gloo_world_of_one, tmp_path, monkeypatch):
    """Without the in-process queue, megatron's writer starts a Manager (a spawned process) on the first save."""
    import multiprocessing.process

    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    def refuse(*_args, **_kwargs):
        raise AssertionError("the save started a process")

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    monkeypatch.setattr(os, "fork", refuse)
    megatron_cpu_shim.adapt_checkpoint_writer()
    cached = filesystem_async._results_queue
    weights = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(4)}
    for step in ("1", "2"):  # the second save takes megatron's cached plan
        (tmp_path / step).mkdir()
        dist_save.save_sharded({k: ShardedTensor.from_rank_offsets(k, v, replica_id=0) for k, v in weights.items()},
                               str(tmp_path / step))
    assert filesystem_async._results_queue is cached  # megatron's own cache is left as it was
    loaded = dist_checkpointing.load({k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v), replica_id=0)
                                      for k, v in weights.items()}, str(tmp_path / "2"))
    assert all(torch.equal(loaded[k], v) for k, v in weights.items())
