"""Device check of the weight group over NCCL (engines/weight_group.py), GPU to GPU, without an engine: the trainer's
rank on cuda:0 broadcasts a mixed-dtype bucket to a receiving process on cuda:1 (skipped with fewer than two GPUs:
NCCL refuses two ranks of one group on one GPU). On one GPU: a one-rank group of the real ProcessGroupNCCL over our
Python rendezvous store (its unique id set from C++, this torch's heartbeat thread left to poll the store) broadcasts
and is dropped without a hang. The CPU contract tests beside it: tests/engines/test_weight_group_nccl.py; into the
engines' own workers: tests/gpu/test_trtllm_engine.py.

    python -m pytest tests/gpu/test_weight_group_nccl.py -q -s
"""
import multiprocessing as mp
import time

import pytest
import torch

from nemo_dapo.engines import shm as S
from nemo_dapo.engines import rendezvous as R
from nemo_dapo.engines import weight_group as WG

pytestmark = pytest.mark.gpu
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


def test_a_one_rank_nccl_group_over_the_python_store_broadcasts_and_drops_cleanly():
    torch.cuda.set_device(0)
    server = R.RendezvousServer("127.0.0.1")
    store = R.RendezvousStore("127.0.0.1", server.port, 30.0)
    pg = WG._process_group("nccl", store, 0, 1, 30.0)
    x = torch.arange(1000, dtype=torch.float32, device="cuda")
    WG._await(pg.broadcast(x, 0), "nccl", 30.0)
    assert torch.equal(x.cpu(), torch.arange(1000, dtype=torch.float32))
    time.sleep(2.5)  # torch 2.9's heartbeat thread, where it runs, polls the store about once a second meanwhile
    keys = store.num_keys()
    t0 = time.monotonic()
    pg = None
    store.close()
    server.close()
    print(f"RESULT nccl_python_store torch {torch.__version__}: one-rank group formed, broadcast, dropped in "
          f"{time.monotonic() - t0:.2f} s ({keys} keys in the store)")
    assert keys >= 1 and time.monotonic() - t0 < 30  # the unique id was set through our store; no hang on drop


def bucket():
    g = torch.Generator().manual_seed(3)
    return [("a", torch.randn(64, 33, generator=g).to(torch.bfloat16)), ("b", torch.tensor([True, False, True])),
            ("c", torch.empty(0, 5)), ("d", torch.arange(9, dtype=torch.int64)),
            ("e", torch.randn(1000, generator=g))]


def receiver(msg, specs, size, out, leave_early):
    host, port, rank, world, timeout_s, backend = WG.check_join(msg)
    member = WG.GroupMember(host, port, rank, world, timeout_s, backend, device="cuda:1")
    if leave_early:  # joined, then dies before the broadcast
        return
    got = member.receive(specs, size)
    out.put([(n, t.device.type, t.cpu()) for n, t in got])


def joined(leave_early: bool, timeout_s: float):
    """(bucket, specs, size, the trainer's group on cuda:0, the receiving process on cuda:1, its queue)."""
    pairs = bucket()
    specs, size = S.weight_layout(pairs)
    torch.cuda.set_device(0)
    group = WG.WeightGroup("127.0.0.1", 1, timeout_s=timeout_s, backend="nccl")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=receiver, args=(group.join_message(1), specs, size, out, leave_early))
    proc.start()
    group.connect()
    return pairs, specs, size, group, proc, out


@two_gpus
def test_an_nccl_bucket_arrives_bit_exact_on_the_other_gpu():
    pairs, specs, size, group, proc, out = joined(False, 60)
    t0 = time.perf_counter()
    group.broadcast([(n, t.cuda()) for n, t in pairs], specs, size)
    got = out.get(timeout=60)
    proc.join(30)
    print(f"nccl bucket of {size} bytes in {time.perf_counter() - t0:.3f} s (first broadcast: communicator set-up)")
    assert [n for n, _, _ in got] == [n for n, _ in pairs]
    for (_, device, t), (_, want) in zip(got, pairs):
        assert device == "cuda" and t.dtype == want.dtype and torch.equal(t, want)


@two_gpus
def test_a_receiver_that_died_is_named_long_before_the_time_out():
    pairs, specs, size, group, proc, _ = joined(True, 120)
    proc.join(60)

    def check():
        if not proc.is_alive():
            raise RuntimeError("the receiver died")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="the receiver died"):
        group.broadcast([(n, t.cuda()) for n, t in pairs], specs, size, check=check)
    assert time.monotonic() - t0 < 10
