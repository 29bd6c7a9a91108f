"""The weight group's rendezvous store (nemo_dapo/engines/rendezvous.py): torch's own HashStore as the reference for
every operation, blocking reads across threads, a real gloo group formed through it without torch's TCPStore, and a
hostile client that leaves the server up."""
import datetime
import gc
import os
import socket
import subprocess
import struct
import threading
import time

import pytest
import torch
import torch.distributed as dist

from nemo_dapo.engines import rendezvous as R
from nemo_dapo.engines import shm as S
from nemo_dapo.engines import weight_group as WG


@pytest.fixture
def server():
    s = R.RendezvousServer("127.0.0.1")
    yield s
    s.close()


def _ops(store):
    """One sequence of every operation torch's process groups may call; the results, in order."""
    out = []
    store.set("a", b"1")
    store.set("s", "text")
    out.append(store.get("a"))
    out.append(store.get("s"))
    out.append(store.add("n", 5))
    out.append(store.add("n", -2))
    out.append(store.get("n"))
    out.append(store.check(["a", "n"]))
    out.append(store.check(["a", "missing"]))
    out.append(store.compare_set("c", b"", b"first"))  # absent, expected empty: set
    out.append(store.compare_set("c", b"wrong", b"second"))  # mismatch: the current value
    out.append(store.compare_set("c", b"first", b"third"))
    out.append(store.compare_set("absent", b"x", b"y"))  # absent, expected not empty: expected back
    out.append(store.num_keys())
    out.append(store.delete_key("a"))
    out.append(store.delete_key("a"))
    out.append(store.check(["a"]))
    store.wait(["n", "c"])
    out.append(store.num_keys())
    return out


def test_every_operation_answers_as_torchs_own_hashstore(server):
    ours = R.RendezvousStore("127.0.0.1", server.port, 5.0)
    assert _ops(ours) == _ops(dist.HashStore())


def test_a_clone_made_by_torch_is_its_own_connection_to_the_same_keys(server):
    """torch clones a store from C++ (a PrefixStore's clone clones the store under it; ProcessGroup's split does):
    the clone, which only C++ references, answers from the same keys on a connection of its own, and closing the
    store closes its clones."""
    ours = R.RendezvousStore("127.0.0.1", server.port, 5.0)
    ours.set("p/k", b"v")
    twin = dist.PrefixStore("p", ours).clone()
    gc.collect()
    assert twin.get("k") == b"v"
    twin.set("k2", b"w")
    assert ours.get("p/k2") == b"w" and len(ours._clones) == 1
    assert ours._clones[0]._sock is not ours._sock
    ours.close()
    with pytest.raises(R.RendezvousError, match="failed during get"):
        twin.get("k")


def test_get_and_wait_block_until_another_client_sets_the_key(server):
    reader, writer = (R.RendezvousStore("127.0.0.1", server.port, 10.0) for _ in range(2))
    threading.Timer(0.3, lambda: writer.set("late", b"v")).start()
    t0 = time.monotonic()
    assert reader.get("late") == b"v" and time.monotonic() - t0 >= 0.25
    threading.Timer(0.3, lambda: writer.set("later", b"w")).start()
    reader.wait(["late", "later"], datetime.timedelta(seconds=5))
    with pytest.raises(R.RendezvousError, match="not set within"):
        reader.wait(["never"], datetime.timedelta(seconds=0.3))


def test_a_gloo_group_forms_through_it_without_torchs_tcpstore(monkeypatch):
    """Two ranks in threads of this process; torch's TCPStore is made to fail, so only our store can serve."""
    def refuse(*args, **kwargs):
        raise AssertionError("TCPStore used")
    monkeypatch.setattr(dist, "TCPStore", refuse)
    group = WG.WeightGroup("127.0.0.1", 1, timeout_s=30)
    bucket = [("w", torch.arange(6.0).reshape(2, 3))]
    specs, size = S.weight_layout(bucket)
    got = {}

    def member():
        m = WG.GroupMember("127.0.0.1", int(group.address.rsplit(":", 1)[1]), 1, 2, 30)
        got.update(m.receive(specs, size))
    t = threading.Thread(target=member)
    t.start()
    group.connect()
    group.broadcast(bucket, specs, size)
    t.join(30)
    group.close()
    assert torch.equal(got["w"], bucket[0][1])


def _raw(port):
    return socket.create_connection(("127.0.0.1", port), timeout=5)


@pytest.mark.parametrize("frame", [
    b"\xff\xff\xff\xff",  # a length over the limit
    struct.pack(">I", 5) + b"nope!",  # not JSON
    struct.pack(">I", 2) + b"[]",  # JSON, not an object
    struct.pack(">I", 10) + b"{",  # closed mid-frame
])
def test_a_malformed_frame_ends_that_connection_and_the_server_stays_up(server, frame):
    bad = _raw(server.port)
    bad.sendall(frame)
    bad.shutdown(socket.SHUT_WR)
    assert bad.recv(16) == b""  # closed, no reply
    good = R.RendezvousStore("127.0.0.1", server.port, 5.0)
    good.set("k", b"v")
    assert good.get("k") == b"v"


@pytest.mark.parametrize("request_, fragment", [
    ({"op": "drop_tables"}, "unknown op"),
    ({"op": "set", "key": "", "value": ""}, "non-empty string"),
    ({"op": "set", "key": "k", "value": "***"}, "Error"),  # not base64
    ({"op": "add", "key": "k", "amount": "1"}, "integer"),
    ({"op": "wait", "keys": "k", "timeout_s": 1}, "list"),
    ({"op": "get", "key": "k", "timeout_s": -1}, "timeout_s"),
    ({"op": "wait", "keys": ["k"], "timeout_s": float("nan")}, "finite"),
    ({"op": "wait", "keys": ["k"], "timeout_s": float("inf")}, "finite"),
])
def test_a_bad_request_gets_an_error_reply_and_the_connection_goes_on(server, request_, fragment):
    conn = _raw(server.port)
    R._send(conn, request_)
    reply = R._recv(conn)
    assert fragment in reply["error"]
    R._send(conn, {"op": "num_keys"})
    assert R._recv(conn) == {"ok": True, "value": 0}


def test_what_a_client_may_store_is_bounded(server, monkeypatch):
    monkeypatch.setattr(R, "MAX_BYTES", 1000)
    store = R.RendezvousStore("127.0.0.1", server.port, 5.0)
    store.set("small", b"x" * 100)
    with pytest.raises(R.RendezvousError, match="at most"):
        store.set("big", b"x" * 2000)
    assert store.get("small") == b"x" * 100 and store.num_keys() == 1


def test_a_closed_server_fails_a_waiting_client_at_once():
    server = R.RendezvousServer("127.0.0.1")
    store = R.RendezvousStore("127.0.0.1", server.port, 60.0)
    threading.Timer(0.3, server.close).start()
    t0 = time.monotonic()
    with pytest.raises(R.RendezvousError):
        store.get("never")
    assert time.monotonic() - t0 < 10


def test_a_host_that_stops_answering_fails_the_call_and_the_connection(monkeypatch):
    """A rendezvous host that accepts and then never replies (a partitioned node): the call fails after the wait it
    asked for plus REPLY_S, not never (torch 2.9's NCCL heartbeat thread calls in, and a group's destructor joins
    that thread), and the connection, whose framing a late reply would break, fails every later call at once."""
    monkeypatch.setattr(R, "REPLY_S", 0.3)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        store = R.RendezvousStore("127.0.0.1", listener.getsockname()[1], 1.0)
        t0 = time.monotonic()
        with pytest.raises(R.RendezvousError, match="during check: TimeoutError"):
            store.check(["k"])
        assert 0.25 < time.monotonic() - t0 < 3
        t0 = time.monotonic()
        with pytest.raises(R.RendezvousError, match="during wait"):
            store.wait(["k"], datetime.timedelta(seconds=0.5))
        assert time.monotonic() - t0 < 0.2


def test_an_unreachable_rendezvous_is_named():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once closed
    with pytest.raises(R.RendezvousError, match=f"127.0.0.1:{port}"):
        R.RendezvousStore("127.0.0.1", port, 1.0)


CROSS = "NEMO_DAPO_CROSS_TORCH_PYTHONS"  # "python-a,python-b": two interpreters with different torch releases


@pytest.mark.skipif(not os.environ.get(CROSS), reason=f"set {CROSS}=PY_A,PY_B (two torch releases, e.g. 2.4 and 2.9: "
                                                      "the trainer and engine images'; 12 GB of wheels, not in CI)")
@pytest.mark.parametrize("order", ["a-trains", "b-trains"])
def test_a_group_across_two_torch_releases(tmp_path, order):
    """The trainer image's torch and the engine image's, each as rank 0: torch's TCPStore failed here (2.4 server,
    2.9 client), the rendezvous of our own must not."""
    a, b = os.environ[CROSS].split(",")
    trainer, member = (a, b) if order == "a-trains" else (b, a)
    worker = os.path.join(os.path.dirname(__file__), "cross_torch_worker.py")
    port = str(tmp_path / "port")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}
    t = subprocess.Popen([trainer, worker, "trainer", port], stdout=subprocess.PIPE, text=True, env=env)
    m = subprocess.run([member, worker, "member", port], stdout=subprocess.PIPE, text=True, env=env, timeout=120)
    out = t.communicate(timeout=120)[0] + m.stdout
    print(out)
    assert t.returncode == 0 and m.returncode == 0, out


def test_the_key_count_is_bounded_and_an_overwrite_adds_no_key(server, monkeypatch):
    monkeypatch.setattr(R, "MAX_KEYS", 2)
    store = R.RendezvousStore("127.0.0.1", server.port, 5.0)
    store.set("a", b"1")
    store.set("b", b"2")  # exactly MAX_KEYS
    store.set("b", b"3")  # an existing key: still two
    with pytest.raises(R.RendezvousError, match="at most 2 keys"):
        store.set("c", b"4")
    assert store.delete_key("a")
    store.set("c", b"4")  # a deleted key frees its place
    assert store.num_keys() == 2


def test_overwritten_and_deleted_values_give_their_bytes_back(server, monkeypatch):
    monkeypatch.setattr(R, "MAX_BYTES", 1000)
    store = R.RendezvousStore("127.0.0.1", server.port, 5.0)
    for _ in range(5):  # 5 x 600 bytes, but only one value is ever held
        store.set("k", b"x" * 600)
    assert store.delete_key("k")
    store.set("j", b"y" * 600)
    assert store.get("j") == b"y" * 600


def test_closed_connections_give_their_place_back(server, monkeypatch):
    monkeypatch.setattr(R, "MAX_CONNECTIONS", 2)
    for k in range(4):  # twice the limit, one after the other
        store = R.RendezvousStore("127.0.0.1", server.port, 5.0)
        store.set(f"k{k}", b"v")
        store.close()
        deadline = time.monotonic() + 5
        while server._conns and time.monotonic() < deadline:  # the server sees the close a moment later
            time.sleep(0.01)
    assert R.RendezvousStore("127.0.0.1", server.port, 5.0).num_keys() == 4


def test_closing_the_server_ends_a_request_that_waits_in_it():
    server = R.RendezvousServer("127.0.0.1")
    failed = []

    def wait():
        try:
            server._handle({"op": "get", "key": "never", "timeout_s": 60})
        except R.RendezvousError as e:
            failed.append(str(e))
    t = threading.Thread(target=wait, daemon=True)
    t.start()
    time.sleep(0.2)
    server.close()
    t.join(5)
    assert not t.is_alive() and failed == ["the rendezvous closed"]


def test_the_server_bounds_how_long_a_request_may_wait():
    server = R.RendezvousServer("127.0.0.1", max_wait_s=0.3)
    try:
        store = R.RendezvousStore("127.0.0.1", server.port, 60.0)
        t0 = time.monotonic()
        with pytest.raises(R.RendezvousError, match="not set within"):
            store.get("never")  # asks for 60 s
        assert time.monotonic() - t0 < 30  # the server's 0.3 s, with room for a loaded machine
    finally:
        server.close()


def test_a_long_wait_is_not_cut_by_the_reply_deadline(server, monkeypatch):
    """The socket's time-out is the wait the request asks for plus REPLY_S, not REPLY_S alone."""
    monkeypatch.setattr(R, "REPLY_S", 0.2)
    reader, writer = (R.RendezvousStore("127.0.0.1", server.port, 5.0) for _ in range(2))
    threading.Timer(0.8, lambda: writer.set("late", b"v")).start()
    assert reader.get("late") == b"v"
