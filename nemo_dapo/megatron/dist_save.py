"""``dist_checkpointing.save`` with the shards written in the calling process.

megatron-core 0.10 forks twice on every rank at every ``torch_dist`` save, even a synchronous one:
``AsyncSaveShardedStrategy.save`` runs the write through ``DistributedAsyncCaller`` (a ``fork`` child), and that
child's ``FileSystemWriterAsync.write_preloaded_data_multiproc`` forks one more process per write bucket. The rank is
multi-threaded by then (gloo's or NCCL's threads, torch's pools), and a child forked while another thread holds a
lock inherits that lock held forever; the parent then polls ``is_alive`` / waits on ``count_queue`` with no timeout.
It is intermittent and likelier on a loaded machine (one CI run of the Qwen3 conversion test, ~20 saves, hung until
killed); a public report of the same failure cites Megatron-LM PR #3633 replacing these processes with threads
(not read here: the pin is 0.10). Here the request megatron builds is run with its own
``AsyncRequest.execute_sync`` and the buckets go through the same ``write_preloaded_data`` (same files, same
format, same results) one after another in this process: nothing forks. Nor does anything spawn: megatron's writer
takes its results queue from a module cache that, when empty, starts a ``multiprocessing`` Manager, a spawned process
that imports the launcher's main module (14 s of NeMo imports on a CPU) before the first save can finish; written in
this process, a plain queue serves.
"""
from __future__ import annotations

import inspect
import queue
from contextlib import contextmanager

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy


def write_buckets_in_process(write_buckets: list, results_queue) -> None:
    """Write every bucket with megatron's own ``write_preloaded_data`` and put ``{bucket index: [WriteResult]}``
    (or the first exception) on ``results_queue``, as ``write_preloaded_data_multiproc`` does from its children."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the writer's D2H copies are non_blocking; megatron's caller syncs before its fork
    local, count = queue.Queue(), queue.Queue()  # count: the JoinableQueue protocol (get, task_done) in-process
    results = {}
    for index, bucket in enumerate(write_buckets):
        count.put(index)
        FileSystemWriterAsync.write_preloaded_data(index, bucket, local, count, True)
        done, out = local.get_nowait()
        if isinstance(out, Exception):
            results = out
            break
        results[done] = out
    results_queue.put(results)


class InProcessTorchDistSave(TorchDistSaveShardedStrategy):
    """megatron-core 0.10's ``torch_dist`` save strategy, its writer's processes replaced by
    :func:`write_buckets_in_process` (the plan, metadata and finalisation are megatron's)."""

    def __init__(self, thread_count: int = 2):
        super().__init__("torch_dist", 1, thread_count=thread_count)

    def save(self, sharded_state_dict, checkpoint_dir) -> None:
        self.async_save(sharded_state_dict, checkpoint_dir).execute_sync()  # write, barrier, finalise: no fork

    def async_save(self, sharded_state_dict, checkpoint_dir) -> AsyncRequest:
        with _results_queue_in_process():
            return super().async_save(sharded_state_dict, checkpoint_dir)

    def _get_save_and_finalize_callbacks(self, writer, save_state_dict_ret) -> AsyncRequest:
        request = super()._get_save_and_finalize_callbacks(writer, save_state_dict_ret)
        if request.async_fn is None:  # nothing to write on this rank
            return request
        return AsyncRequest(write_buckets_in_process, (writer.write_buckets, writer.results_queue),
                            request.finalize_fns)


@contextmanager
def _results_queue_in_process():
    """A plain queue where megatron's writer would fetch (or start) its Manager queue; the cache is put back after,
    so a forking save elsewhere in the process still gets a queue its children can reach."""
    cached = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = cached


def save_sharded(sharded_state_dict: dict, checkpoint_dir: str) -> None:
    """``dist_checkpointing.save`` in megatron-core's default format (``torch_dist``), writing in this process."""
    dist_checkpointing.save(sharded_state_dict, checkpoint_dir, sharded_strategy=InProcessTorchDistSave())


# What this module calls of megatron-core's private save path (0.10.0), checked by check_megatron_api()
MEGATRON_API = {
    (TorchDistSaveShardedStrategy, "_get_save_and_finalize_callbacks"): ["self", "writer", "save_state_dict_ret"],
    (TorchDistSaveShardedStrategy, "async_save"): ["self", "sharded_state_dict", "checkpoint_dir"],
    (FileSystemWriterAsync, "write_preloaded_data"): ["local_proc_idx", "write_bucket", "results_queue", "count_queue",
                                                      "use_fsync"],
    (AsyncRequest, "execute_sync"): ["self"],
}


def check_megatron_api() -> list:
    """The differences between the installed megatron-core and what this module calls (empty: it matches). The
    trainer image runs it at build time (containers/Dockerfile)."""
    problems = []
    for (owner, name), params in MEGATRON_API.items():
        fn = getattr(owner, name, None)
        if fn is None:
            problems.append(f"megatron-core lacks {owner.__name__}.{name}")
            continue
        got = list(inspect.signature(inspect.unwrap(fn)).parameters)
        if got != params:
            problems.append(f"megatron-core {owner.__name__}.{name} takes {got}, nemo_dapo.megatron.dist_save calls "
                            f"it with {params}")
    if not hasattr(filesystem_async, "_results_queue") or \
            "_get_write_results_queue()" not in inspect.getsource(FileSystemWriterAsync.prepare_write_data):
        problems.append("megatron-core's FileSystemWriterAsync no longer takes its results queue from "
                        "filesystem_async._results_queue (_get_write_results_queue)")
    if list(AsyncRequest._fields[:3]) != ["async_fn", "async_fn_args", "finalize_fns"]:
        problems.append(f"megatron-core AsyncRequest fields are {AsyncRequest._fields}")
    return problems


if __name__ == "__main__":
    import sys

    found = check_megatron_api()
    print("\n".join(found) or "nemo_dapo.megatron.dist_save: the installed megatron-core matches")
    sys.exit(1 if found else 0)
