"""The collective weight transport (engines/weight_group.py) between a trainer and real server processes over gloo:
one broadcast feeds several servers, the bytes equal the shared-memory path's, refusals and deaths end the update
with a clear error and never a hang, and a hostile join or bucket leaves the server serving."""
import os
import signal
import socket
import time

import pytest
import torch

from nemo_dapo.engines import shm as S
from nemo_dapo.engines import weight_group as WG
from nemo_dapo.engines.base import EngineError, EngineWeightError, Request
from nemo_dapo.engines.client import EngineClient, EngineDied, EngineProcess
from nemo_dapo.engines.generator import EngineGenerator
from tests.engines.test_protocol import ENV, TOY, expected, start
from tests.support.dist import free_port


@pytest.fixture
def two(tmp_path):
    servers = [start(tmp_path, name) for name in ("a", "b")]
    yield servers
    for proc, client in servers:
        proc.stop(client if client.alive else None)


def first_tokens(client, req):
    client.submit([req])
    return client.next_completion().samples[0].token_ids


def test_one_broadcast_updates_every_server_and_the_group_is_reused(two):
    clients = [c for _, c in two]
    stats, group = WG.update_over_group(clients, [[("w", torch.tensor([1.0, 2.0, 3.0, 4.0]))]])
    assert stats["buckets"] == 1 and stats["tensors"] == 1 and stats["transport"] == "group"
    req = Request(id="x", prompt_ids=[5], max_new_tokens=4, seed=2)
    for c in clients:
        assert first_tokens(c, req) == expected(req, 0, offset=10)
        assert c.health()["weight_group"] == "joined"
    again, same = WG.update_over_group(clients, [[("w", torch.zeros(4))]], group=group)
    assert same is group and again["buckets"] == 1
    assert all(first_tokens(c, Request(id="y", prompt_ids=[5], max_new_tokens=4, seed=2)) == expected(req, 0)
               for c in clients)


def test_group_bytes_equal_the_shared_memory_layout_for_mixed_dtypes():
    bucket = [("a", torch.arange(6, dtype=torch.bfloat16).view(2, 3)), ("b", torch.tensor([True, False])),
              ("c", torch.empty(0, 5)), ("d", torch.arange(3, dtype=torch.int64))]
    specs, size = S.weight_layout(bucket)
    flat = torch.zeros(size, dtype=torch.uint8)
    for (_, view), (_, t) in zip(WG._views(flat, specs), bucket):
        view.copy_(t)
    shm = S.WeightBuffer()
    try:
        name, shm_specs = shm.pack(bucket)
        assert shm_specs == specs
        assert bytes(shm._shm.buf[:size]) == flat.numpy().tobytes()
    finally:
        shm.close()
    for (name, got), (want_name, want) in zip(WG._views(flat, specs), bucket):
        assert name == want_name and got.dtype == want.dtype and torch.equal(got, want)


def test_a_refused_tensor_names_itself_drops_the_group_and_the_next_update_forms_a_new_one(two):
    clients = [c for _, c in two]
    _, group = WG.update_over_group(clients, [[("w", torch.ones(4))]])
    t0 = time.monotonic()
    with pytest.raises(EngineWeightError, match="'model.bogus.weight'"):
        WG.update_over_group(clients, [[("w", torch.ones(4))], [("model.bogus.weight", torch.ones(4))]], group=group)
    assert time.monotonic() - t0 < 10  # the servers still in the broadcast saw the group close
    with pytest.raises(EngineError, match="mixed weights"):
        clients[1].submit([Request(id="z", prompt_ids=[1])])
    stats, fresh = WG.update_over_group(clients, [[("w", torch.zeros(4))]])
    assert fresh is not group and stats["buckets"] == 1
    req = Request(id="z", prompt_ids=[5], max_new_tokens=3, seed=1)
    assert [first_tokens(c, req) for c in clients] == [expected(req, 0)] * 2


def test_a_server_killed_mid_transfer_raises_engine_died_and_the_other_stays_usable(tmp_path):
    slow, fast = start(tmp_path, "slow", load_delay_s=3.0), start(tmp_path, "fast")
    try:
        clients = [slow[1], fast[1]]
        _, group = WG.update_over_group(clients, [[("w", torch.ones(4))]])

        def buckets():
            yield [("w", torch.ones(4))]
            os.kill(slow[0].pid, signal.SIGKILL)  # the slow server is loading bucket 1
            yield [("w", torch.zeros(4))]
        t0 = time.monotonic()
        with pytest.raises(EngineDied, match="'slow'"):
            WG.update_over_group(clients, buckets(), group=group)
        assert time.monotonic() - t0 < 30
        stats, _ = WG.update_over_group([fast[1]], [[("w", torch.zeros(4))]])
        assert stats["buckets"] == 1 and fast[1].health()["weights_ok"]
    finally:
        for proc, client in (slow, fast):
            proc.stop(client if client.alive else None)


def test_a_server_stuck_loading_a_bucket_fails_the_update_at_the_weight_deadline(tmp_path):
    stuck = start(tmp_path, "stuck", load_delay_s=30.0)
    stuck[1].weight_timeout_s = 2.0
    try:
        t0 = time.monotonic()
        with pytest.raises(EngineError, match="'stuck' did not answer 'update_weights(_done)?' within 2 s"):
            WG.update_over_group([stuck[1]], [[("w", torch.ones(4))], [("w", torch.zeros(4))]])
        assert time.monotonic() - t0 < 10 and stuck[1].request_timeout_s == 20
    finally:
        stuck[0].stop()


@pytest.mark.parametrize("fields, message", [
    ({"address": "http://x:1", "rank": 1, "world_size": 2}, "tcp://HOST:PORT"),
    ({"address": "tcp://127.0.0.1:99999", "rank": 1, "world_size": 2}, "tcp://HOST:PORT"),
    ({"address": "tcp://127.0.0.1:5", "rank": 0, "world_size": 2}, "rank must be"),
    ({"address": "tcp://127.0.0.1:5", "rank": 2, "world_size": 2}, "rank must be"),  # ranks are 0 .. world - 1
    ({"address": "tcp://127.0.0.1:65536", "rank": 1, "world_size": 2}, "tcp://HOST:PORT"),
    ({"address": "tcp://127.0.0.1:5", "rank": 1, "world_size": 10 ** 9}, "world_size must be"),
    ({"address": "tcp://127.0.0.1:5", "rank": 1, "world_size": 2, "group_timeout_s": "soon"},
     "group_timeout_s must be"),
    ({"address": "tcp://127.0.0.1:5", "rank": 1, "world_size": 2, "backend": "mpi"}, "backend must be one of"),
    # this engine receives in its server process, on the CPU
    ({"address": "tcp://127.0.0.1:5", "rank": 1, "world_size": 2, "backend": "nccl"}, "nccl needs an engine whose"),
])
def test_a_bad_join_is_refused_by_name_and_the_server_serves_on(two, fields, message):
    client = two[0][1]
    with pytest.raises(EngineError, match=message):
        client.call("join_weights", **fields)
    assert client.health()["weight_group"] == "none"


def test_a_join_to_an_address_where_no_trainer_listens_fails_at_the_connect_deadline_not_the_groups(two):
    client = two[0][1]
    # a port held bound but not listening refuses every connection, and no other test's server can take it meanwhile
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        t0 = time.monotonic()
        client.call("join_weights", address=f"tcp://127.0.0.1:{held.getsockname()[1]}", rank=1, world_size=2,
                    group_timeout_s=3600)
        state = client.health()["weight_group"]  # answered once the join behind the reply gave up
    assert time.monotonic() - t0 < WG.JOIN_CONNECT_S + 15
    assert state.startswith("failed to join") and "cannot reach the weight group's rendezvous" in state
    req = Request(id="z", prompt_ids=[5], max_new_tokens=3, seed=1)
    assert first_tokens(client, req) == expected(req, 0)  # serving on


def test_a_group_bucket_without_a_group_is_refused(two):
    client = two[0][1]
    with pytest.raises(EngineError, match="no weight group"):
        client.call("update_weights", via="group", size=16,
                    tensors=[{"name": "w", "dtype": "float32", "shape": [4], "offset": 0}])
    with pytest.raises(EngineError, match="via must be"):
        client.call("update_weights", via="carrier-pigeon", tensors=[])
    assert client.health()["running"] == 0


def test_a_bucket_past_its_size_or_too_large_is_refused_before_anything_blocks(two):
    clients = [c for _, c in two]
    _, group = WG.update_over_group(clients, [[("w", torch.ones(4))]])
    client = clients[0]
    spec = {"name": "w", "dtype": "float32", "shape": [4], "offset": 0}
    for size, tensors, message in ((8, [spec], "ends past"), (WG.MAX_BUCKET_BYTES + 1, [spec], "size must be"),
                                   (16, [{**spec, "shape": ["4"]}], "shape must be"), (16, "w", "a list"),
                                   (24, [{**spec, "offset": 2}], "not aligned")):
        with pytest.raises(EngineError, match=message):
            client.call("update_weights", via="group", size=size, tensors=tensors)
    stats, _ = WG.update_over_group(clients, [[("w", torch.zeros(4))]], group=group)  # still joined, still serving
    assert stats["buckets"] == 1


def test_a_trainer_chooses_a_transport_by_name():
    assert EngineGenerator(None, eos_id=2, pad_id=0, weight_transport="nccl").weight_transport == "nccl"
    with pytest.raises(ValueError, match="must be one of"):
        EngineGenerator(None, eos_id=2, pad_id=0, weight_transport="pigeon")


def test_the_rendezvous_is_the_trainers_end_of_its_engine_connection(two, tmp_path):
    """The generator hosts the group at ``client.local_host()``: the address the engine's host reaches it at."""
    assert two[0][1].local_host() == "127.0.0.1"  # a unix socket
    proc = EngineProcess(engine=TOY, model_dir="-", address=f"tcp://127.0.0.1:{free_port()}",
                         log_path=str(tmp_path / "tcp.log"), env=ENV)
    client = EngineClient(proc.address, name="tcp", connect_timeout_s=60, request_timeout_s=20, process=proc)
    try:
        host = client.local_host()
        assert host == client._ch.sock.getsockname()[0] == "127.0.0.1"
        stats, group = WG.update_over_group([client], [[("w", torch.ones(4))]], host=host)
        assert group.address.startswith(f"tcp://{host}:") and stats["buckets"] == 1
        req = Request(id="t", prompt_ids=[5], max_new_tokens=4, seed=2)
        assert first_tokens(client, req) == expected(req, 0, offset=4)
    finally:
        proc.stop(client if client.alive else None)


def test_the_largest_bucket_and_the_highest_port_are_accepted():
    assert WG.check_bucket([], WG.MAX_BUCKET_BYTES) == WG.MAX_BUCKET_BYTES
    assert WG.parse_store("tcp://127.0.0.1:65535") == ("127.0.0.1", 65535)
    assert WG.check_join({"address": "tcp://127.0.0.1:5", "rank": 2, "world_size": 3})[2:4] == (2, 3)


def test_closing_a_group_closes_its_rendezvous():
    group = WG.WeightGroup("127.0.0.1", 1, timeout_s=5)
    port = int(group.address.rsplit(":", 1)[1])
    socket.create_connection(("127.0.0.1", port), timeout=5).close()  # listening
    group.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5)


class FakeClient:
    """An EngineClient whose server agrees to every command (the join messages are recorded)."""

    def __init__(self, name, ranks):
        self.name, self.info, self.weight_timeout_s, self.joins = name, {"weight_group_ranks": ranks}, 5.0, []

    def send(self, op, **fields):
        self.joins.append(fields)
        return len(self.joins)

    def reply(self, cmd, op, timeout_s=None):
        return {}


def test_a_server_with_several_receiving_workers_gets_a_rank_for_each(monkeypatch):
    monkeypatch.setattr(WG.WeightGroup, "connect", lambda self: None)  # no rank joins: only the messages count
    clients = [FakeClient("tp2", 2), FakeClient("one", 1), FakeClient("tp4", 4)]
    group = WG._form(clients, "127.0.0.1", 5.0)
    try:
        assert [c.joins[0]["rank"] for c in clients] == [1, 3, 4]  # after the trainer's rank 0, none shared
        assert {c.joins[0]["world_size"] for c in clients} == {1 + 2 + 1 + 4}
    finally:
        group.close()


def test_a_broken_broadcast_on_any_worker_outranks_a_refused_tensor_on_another():
    assert WG.workers_failure([None, None]) is None
    assert WG.workers_failure([None, ("nan", "w")]) == ("nan", "w")
    assert WG.workers_failure([("nan", "w"), ("broken", "peer closed")]) == ("broken", "peer closed")


def test_a_generator_drops_its_group_after_a_failed_update_and_forms_a_new_one(two):
    client = two[0][1]
    gen = EngineGenerator(client, eos_id=49, pad_id=0, weight_transport="gloo")

    class Policy:
        def __init__(self, buckets):
            self.buckets = buckets

        def hf_weight_buckets(self, bucket_bytes):
            yield from self.buckets
    gen.update_weights(Policy([[("w", torch.ones(4))]]))
    first = gen._group
    with pytest.raises(EngineWeightError, match="'model.bogus.weight'"):
        gen.update_weights(Policy([[("w", torch.ones(4))], [("model.bogus.weight", torch.ones(4))]]))
    assert gen._group is None
    assert first._pg is None and first._store is None  # closed, not just forgotten: its rendezvous port let go
    gen.update_weights(Policy([[("w", torch.zeros(4))]]))
    assert gen._group is not None and gen._group is not first and gen.last_update["buckets"] == 1
    req = Request(id="g", prompt_ids=[5], max_new_tokens=3, seed=1)
    assert first_tokens(client, req) == expected(req, 0)


def test_the_next_client_of_a_server_starts_without_the_last_ones_group(two):
    proc, client = two[0]
    _, group = WG.update_over_group([client], [[("w", torch.ones(4))]])
    assert client.health()["weight_group"] == "joined"
    client.close()
    group.close()
    after = EngineClient(proc.address, name="a", connect_timeout_s=30, request_timeout_s=20, process=proc)
    try:
        assert after.health()["weight_group"] == "none"  # its trainer forms a group of its own
        with pytest.raises(EngineError, match="no weight group is joined"):
            after.call("update_weights", via="group", size=16,
                       tensors=[{"name": "w", "dtype": "float32", "shape": [4], "offset": 0}])
    finally:
        after.shutdown()
