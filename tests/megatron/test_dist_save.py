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


def test_every_shard_file_is_fsynced_before_the_save_returns(gloo_world_of_one, tmp_path, monkeypatch):
    """megatron's own writer fsyncs each file it writes (``write_preloaded_data(..., use_fsync=True)`` in its
    children); written in this process the files must be flushed to disk just the same, or a crash right after a
    save that "finished" can leave a truncated checkpoint behind."""
    import torch
    from megatron.core.dist_checkpointing import ShardedTensor

    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    megatron_cpu_shim.adapt_checkpoint_writer()
    weights = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(4)}
    dist_save.save_sharded({k: ShardedTensor.from_rank_offsets(k, v, replica_id=0) for k, v in weights.items()},
                           str(tmp_path))
    shards = sorted(str(p) for p in tmp_path.glob("*.distcp"))
    assert shards and sorted(set(synced) & set(shards)) == shards


def test_a_failed_write_is_handed_to_the_finaliser_not_a_partial_result(tmp_path):
    """A bucket whose file cannot be written: the results queue must get that exception (megatron's finaliser then
    raises), not a dict of the buckets that did get written, which would finalise a checkpoint with a hole."""
    import queue

    ok, broken = str(tmp_path / "0.distcp"), str(tmp_path / "missing" / "1.distcp")
    results = queue.Queue()
    dist_save.write_buckets_in_process([(ok, "0.distcp", ([], [])), (broken, "1.distcp", ([], []))], results)
    got = results.get_nowait()
    assert isinstance(got, FileNotFoundError), got
    assert results.empty()
