"""Contract tests: the weight group over NCCL (engines/weight_group.py), our side only. This CPU torch has no
``ProcessGroupNCCL``, so ``FakeNCCL`` stands in for it: the constructor our code calls (store, rank, size, timeout,
as torch 2.4 and 2.9 bind it), over a real gloo group whose work, like NCCL's, is polled. The GPU test beside these
runs the real backend, GPU to GPU: tests/gpu/test_weight_group_nccl.py (two GPUs)."""
import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

from nemo_dapo.engines import shm as S
from nemo_dapo.engines import vllm as V
from nemo_dapo.engines import weight_group as WG
from nemo_dapo.engines.base import EngineError
from nemo_dapo.engines.client import EngineDied


class FakeNCCL:
    made: list = []

    def __init__(self, store, rank, size, timeout):
        assert isinstance(store, dist.PrefixStore) and isinstance(timeout, datetime.timedelta)
        self.inner = dist.ProcessGroupGloo(store, rank, size, timeout)
        FakeNCCL.made.append((rank, size, timeout.total_seconds()))

    def broadcast(self, tensor, root):
        return self.inner.broadcast(tensor, root)


@pytest.fixture
def fake_nccl(monkeypatch):
    FakeNCCL.made = []
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    monkeypatch.setattr(WG, "nccl_problem", lambda: None)
    return FakeNCCL


BUCKET = [("a", torch.arange(6, dtype=torch.bfloat16).view(2, 3)), ("b", torch.tensor([True, False])),
          ("c", torch.empty(0, 5)), ("d", torch.arange(3, dtype=torch.int64)), ("e", torch.randn(7))]


def test_contract_an_nccl_group_moves_every_receivers_bucket_in_the_shared_memory_layout(fake_nccl):
    specs, size = S.weight_layout(BUCKET)
    group = WG.WeightGroup("127.0.0.1", 2, timeout_s=30, backend="nccl", device="cpu")
    messages = [group.join_message(r) for r in (1, 2)]
    assert all(m["backend"] == "nccl" for m in messages)
    got = {}

    def member(msg):
        host, port, rank, world, timeout_s, backend = WG.check_join(msg)
        m = WG.GroupMember(host, port, rank, world, timeout_s, backend, device="cpu")
        got[rank] = m.receive(specs, size)

    threads = [threading.Thread(target=member, args=(m,)) for m in messages]
    for t in threads:
        t.start()
    group.connect()
    group.broadcast(BUCKET, specs, size, check=lambda: None)
    for t in threads:
        t.join(30)
    watchdog = 30.0 + WG.NCCL_WATCHDOG_MARGIN_S  # past the poll's 30 s, which therefore fires first
    assert sorted(fake_nccl.made) == [(0, 3, watchdog), (1, 3, watchdog), (2, 3, watchdog)]
    for rank in (1, 2):
        assert [n for n, _ in got[rank]] == [n for n, _ in BUCKET]
        for (_, t), (_, want) in zip(got[rank], BUCKET):
            assert t.dtype == want.dtype and torch.equal(t, want)


class Never:
    """Work that never completes (a peer that never joined the broadcast)."""

    def __init__(self):
        self.waited = False

    def is_completed(self):
        return False

    def wait(self):
        self.waited = True


def test_an_nccl_broadcast_is_polled_so_a_dead_peer_is_named_before_the_time_out():
    calls = []

    def check():
        calls.append(time.monotonic())
        if len(calls) == 2:
            raise EngineDied("engine 'b' died")
    t0 = time.monotonic()
    with pytest.raises(EngineDied, match="'b'"):
        WG._await(Never(), "nccl", 60.0, check)
    assert 1.5 < time.monotonic() - t0 < 5 and len(calls) == 2  # checked every second, not waited out


def test_an_nccl_broadcast_that_never_completes_times_out_here_and_gloo_waits():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="did not complete within 1 s"):
        WG._await(Never(), "nccl", 1.0)
    assert time.monotonic() - t0 < 3
    work = Never()
    WG._await(work, "gloo", 1.0)
    assert work.waited


def test_contract_a_member_whose_broadcast_times_out_drops_its_group_before_the_nccl_watchdog(fake_nccl, monkeypatch):
    """At its own time-out NCCL's watchdog ends the process; the member's poll fires first, drops the group (whose
    destructor aborts the communicator) and names the failure on the next bucket too."""
    group = WG.WeightGroup("127.0.0.1", 1, timeout_s=1.0, backend="nccl", device="cpu")
    joined = threading.Thread(target=group.connect)
    joined.start()
    host, port, rank, world, timeout_s, backend = WG.check_join(group.join_message(1))
    member = WG.GroupMember(host, port, rank, world, timeout_s, backend, device="cpu")
    joined.join(30)
    monkeypatch.setattr(FakeNCCL, "broadcast", lambda self, tensor, root: Never())
    specs, size = S.weight_layout(BUCKET)
    t0 = time.monotonic()
    with pytest.raises(WG.GroupBroken, match="did not complete within 1 s"):
        member.receive(specs, size)
    assert time.monotonic() - t0 < 1.0 + WG.NCCL_WATCHDOG_MARGIN_S / 2
    assert fake_nccl.made[-1][2] == 1.0 + WG.NCCL_WATCHDOG_MARGIN_S and member._pg is None
    with pytest.raises(WG.GroupBroken, match="failed on an earlier bucket"):
        member.receive(specs, size)
    group.close()


class Client:
    def __init__(self, name, info):
        self.name, self.info = name, info


def test_an_nccl_group_needs_nccl_here_and_the_same_release_in_every_engine(monkeypatch):
    if WG.nccl_problem() is not None:  # this CPU machine: refused before any engine is asked to join
        with pytest.raises(EngineError, match="this trainer cannot join an NCCL group"):
            WG.check_nccl_peers([Client("a", {"nccl": "2.21.5"})])
    monkeypatch.setattr(WG, "nccl_problem", lambda: None)
    monkeypatch.setattr(WG, "nccl_version", lambda: "2.21.5")
    WG.check_nccl_peers([Client("a", {"nccl": "2.21.5"}), Client("b", {"nccl": "2.21.5"})])
    with pytest.raises(EngineError, match=r"engine 'b' has NCCL 2\.27\.3, this trainer 2\.21\.5"):
        WG.check_nccl_peers([Client("a", {"nccl": "2.21.5"}), Client("b", {"nccl": "2.27.3"})])
    with pytest.raises(EngineError, match="engine 'a' has NCCL none"):  # a CPU engine, or one receiving itself
        WG.check_nccl_peers([Client("a", {})])
    monkeypatch.setattr(WG, "torch_version", lambda: "2.4.0a0+3bcc3cd")
    WG.check_nccl_peers([Client("a", {"nccl": "2.21.5", "torch": "2.4.1"})])  # the same major.minor
    with pytest.raises(EngineError, match=r"engine 'b' runs torch 2\.9\.0, this trainer 2\.4\.0a0"):
        WG.check_nccl_peers([Client("a", {"nccl": "2.21.5"}), Client("b", {"nccl": "2.21.5", "torch": "2.9.0"})])


def test_contract_vllms_workers_join_over_nccl_on_their_own_gpu(monkeypatch):
    joined = []
    monkeypatch.setattr(WG, "GroupMember", lambda *args: joined.append(args) or "member")

    class Worker:  # vLLM's GPU worker: rank in the engine, device = cuda:local_rank
        rank, device = 1, torch.device("cuda", 3)
    worker = Worker()
    V._rpc_group(worker, "join", ("10.0.0.1", 5000, 4, 9, 30.0, "nccl"))
    V._rpc_group(worker, "join", ("10.0.0.1", 5000, 4, 9, 30.0, "gloo"))
    assert joined == [("10.0.0.1", 5000, 5, 9, 30.0, "nccl", torch.device("cuda", 3)),
                      ("10.0.0.1", 5000, 5, 9, 30.0, "gloo", None)]
    assert worker.nemo_dapo_weight_group == "member"


def test_contract_tensorrt_llms_workers_join_over_nccl_on_their_own_gpu(monkeypatch):
    from nemo_dapo.engines import trtllm_worker as TW
    joined = []
    monkeypatch.setattr(WG, "GroupMember", lambda *args: joined.append(args) or "member")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    class Worker:  # TensorRT-LLM's RayGPUWorker: global_rank in the engine's world, device_id its GPU
        global_rank, device_id = 1, 2
    worker = Worker()
    TW._join(worker, "10.0.0.1", 5000, 4, 9, 30.0, "nccl")
    TW._join(worker, "10.0.0.1", 5000, 4, 9, 30.0)
    assert joined == [("10.0.0.1", 5000, 5, 9, 30.0, "nccl", torch.device("cuda", 2)),
                      ("10.0.0.1", 5000, 5, 9, 30.0, "gloo", None)]
    assert worker.nemo_dapo_group == "member"


# torch 2.4.0's bindings, as its wheel prints them (2.9 adds names to the options overload and a broadcast timeout)
DOC_INIT_24 = ("__init__(*args, **kwargs)\nOverloaded function.\n\n1. __init__(self: ProcessGroupNCCL, arg0: Store, "
               "arg1: int, arg2: int, arg3: c10d::ProcessGroupNCCL::Options) -> None\n\n2. __init__(self: "
               "ProcessGroupNCCL, store: Store, rank: int, size: int, timeout: datetime.timedelta = "
               "datetime.timedelta(seconds=600)) -> None\n")
DOC_BROADCAST_24 = ("broadcast(*args, **kwargs)\nOverloaded function.\n\n1. broadcast(self: Backend, tensors: "
                    "list[torch.Tensor], opts: BroadcastOptions = ...) -> c10d::Work\n\n2. broadcast(self: Backend, "
                    "tensor: torch.Tensor, root: int) -> c10d::Work\n")


def test_the_images_nccl_api_check_names_what_a_torch_lacks(monkeypatch):
    if not dist.is_nccl_available():
        assert WG.nccl_api_problems() == [f"torch {torch.__version__} is built without NCCL"]
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)

    def nccl_class(init_doc, broadcast_doc):
        init = lambda self, *a: None  # noqa: E731
        init.__doc__ = init_doc
        broadcast = lambda self, *a: None  # noqa: E731
        broadcast.__doc__ = broadcast_doc
        return type("ProcessGroupNCCL", (), {"__init__": init, "broadcast": broadcast})
    monkeypatch.setattr(dist, "ProcessGroupNCCL", nccl_class(DOC_INIT_24, DOC_BROADCAST_24), raising=False)
    assert WG.nccl_api_problems() == []
    monkeypatch.setattr(dist, "ProcessGroupNCCL", nccl_class(DOC_INIT_24.split("\n\n2.")[0], "broadcast(tensors)"),
                        raising=False)
    assert WG.nccl_api_problems() == ["ProcessGroupNCCL has no (store, rank, size, timeout: timedelta) constructor",
                                      "ProcessGroupNCCL has no broadcast(tensor, root)"]
