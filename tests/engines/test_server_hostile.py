"""A real engine server process (the toy engine) under a fuzzing client: failed handshakes, an idle peer, malformed
frames, hostile requests and weights, a second client and the health probe beside a connected trainer, a foreign
user, and a trainer killed with its whole process group mid-transfer. After every hostile case the server still
serves a real generate request, and every wait of the trainer ends within its time-out."""
import io
import os
import signal
import socket
import struct
import subprocess
import sys
import time

import pytest
import torch

from nemo_dapo.engines import protocol as P
from nemo_dapo.engines import server as S
from nemo_dapo.engines import shm
from nemo_dapo.engines.base import EngineError, EngineWeightError, Request
from nemo_dapo.engines.client import EngineBusy, EngineClient
from nemo_dapo.engines.health import main as health_main
from nemo_dapo.engines.health import wait_healthy
from tests.engines.toy_engine import ToyEngine

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOY = "tests.engines.toy_engine:ToyEngine"
KEY = P.new_authkey()
HANDSHAKE_S = 2.0
MAX_IN_FLIGHT = 64


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tmp_path, address, *args, key=KEY, engine=TOY):
    """``python -m nemo_dapo.engines.server`` with the key in its environment; returns once it listens."""
    env = {k: v for k, v in os.environ.items() if k not in (P.AUTHKEY_ENV, P.AUTHKEY_FILE_ENV)}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", **({P.AUTHKEY_ENV: key.decode()} if key else {}))
    log = tmp_path / "server.log"
    proc = subprocess.Popen([sys.executable, "-m", "nemo_dapo.engines.server", "--engine", engine, "--model", "-",
                             "--address", address, "--handshake-timeout-s", str(HANDSHAKE_S), *args],
                            env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while "ready on" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    return proc


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A keyed server on loopback TCP: the address every user of the machine can reach."""
    tmp = tmp_path_factory.mktemp("tcp")
    address = f"tcp://127.0.0.1:{free_port()}"
    proc = start_server(tmp, address, "--max-samples-in-flight", str(MAX_IN_FLIGHT))
    yield proc, address, tmp / "server.log"
    proc.kill()
    proc.wait()


def serves(server, **client_kw):
    """The server is up and answers a real generate request with the toy engine's tokens."""
    proc, address, log = server
    assert proc.poll() is None, log.read_text()[-3000:]
    client = EngineClient(address, authkey=KEY, name="check", connect_timeout_s=30, request_timeout_s=30, **client_kw)
    try:
        rid = f"ok{time.monotonic_ns()}"
        client.submit([Request(id=rid, prompt_ids=[3], max_new_tokens=3, seed=1)])
        got = client.next_completion()
        assert got.id == rid and got.samples[0].token_ids == [4, 7, 10]
    finally:
        client.close()
    return True


def keyed(address) -> P.Channel:
    """A raw channel past the handshake, to send frames the real client never would."""
    return P.client_handshake(P.connect_socket(address, 10), KEY, 10)


def send_raw(ch: P.Channel, body: bytes, length=None) -> None:
    ch._send_all(struct.pack("!Q", len(body) if length is None else length) + body, time.monotonic() + 5)


def _bare(sock):
    pass


def _wrong_key(sock):
    with pytest.raises(P.AuthenticationError):
        P.client_handshake(sock, b"x" * 32, 10)


def _garbage(sock):
    sock.setblocking(True)
    sock.sendall(os.urandom(300))


def _huge_prefix(sock):
    sock.setblocking(True)
    sock.sendall(struct.pack("!Q", 1 << 40) + b"x" * 64)


def _bad_auth(sock):
    ch = P.Channel(sock)
    assert ch.recv(5)["op"] == "challenge"
    ch.send({"op": "auth", "mac": ["not", "a", "string"], "nonce": 7})


def _attack(server, attack) -> None:
    sock = P.connect_socket(server[1], 10)
    try:
        attack(sock)
    finally:
        sock.close()


@pytest.mark.parametrize("attack", [_bare, _wrong_key, _garbage, _huge_prefix, _bad_auth])
def test_a_failed_handshake_never_stops_the_server(server, attack):
    _attack(server, attack)
    assert serves(server)


def test_idle_peers_are_dropped_at_the_handshake_deadline_and_hold_up_no_trainer(server):
    time.sleep(0.3)  # the last test's session has ended (a peer arriving during one is told busy)
    idle = [P.connect_socket(server[1], 10) for _ in range(12)]  # connect, never answer the challenge
    try:
        channels = [P.Channel(sock) for sock in idle]
        assert all(ch.recv(5)["op"] == "challenge" for ch in channels)  # all twelve are in their handshakes now
        t0 = time.monotonic()
        assert serves(server)  # served at once: one after the other, the handshakes held it 12 x 2 s
        assert time.monotonic() - t0 < HANDSHAKE_S
        for ch in channels:
            with pytest.raises(EOFError):  # dropped at the server's handshake deadline
                ch.read_frame(HANDSHAKE_S + 5)
        assert time.monotonic() - t0 < HANDSHAKE_S + 2
    finally:
        for sock in idle:
            sock.close()
    assert serves(server)


MALFORMED = [b"{not json", b"\xff\xfe\xfd", b"[1, 2]", b'"op"', b'{"cmd": 1}', b"", b'{"op": 5}',
             b"[" * 100_000, b'{"op": "nosuch", "cmd": 2}', b'{"op": "submit", "cmd": 3, "requests": "x"}',
             b'{"op": "submit", "cmd": 4, "requests": [7]}', b'{"op": "submit", "cmd": 5, "requests": [{"id": "a", '
             b'"prompt_ids": [1], "n": 1e999}]}', b'{"op": "abort", "cmd": 6, "ids": 5}',
             b'{"op": "sleep", "cmd": 7, "level": "x"}', b'{"op": "update_weights", "cmd": 8, "shm": "../../etc", '
             b'"tensors": []}', b'{"op": "update_weights", "cmd": 9, "shm": 3, "tensors": 4}',
             b'{"op": "hello", "cmd": 10, "version": 2, "shm_token": "nemo_dapo_1_t_000000000000"}']


def test_malformed_frames_get_an_error_reply_and_the_connection_serves_on(server):
    ch = keyed(server[1])
    try:
        for body in MALFORMED:
            send_raw(ch, body)
            reply = ch.recv(10)
            assert reply["op"] == "error" and reply["type"] == "bad_request", (body[:60], reply)
        ch.send({"op": "health", "cmd": 99})
        assert ch.recv(10)["cmd"] == 99  # the same connection still works
        send_raw(ch, b"", length=1 << 40)  # a 2^40-byte frame: refused before any allocation, then closed
        assert "over the limit" in ch.recv(10)["message"]
        with pytest.raises((EOFError, ConnectionError)):
            ch.read_frame(10)
    finally:
        ch.close()
    assert serves(server)


def test_hostile_requests_are_refused_with_a_clear_message(server):
    client = EngineClient(server[1], authkey=KEY, connect_timeout_s=30, request_timeout_s=30)
    try:
        def refused(match, **request):
            with pytest.raises(EngineError, match=match):
                client.call("submit", requests=[{"id": "h", "prompt_ids": [1], **request}])
        refused(r"token id 50 is outside the vocabulary \[0, 50\)", prompt_ids=[1, 50])
        refused("negative token id", prompt_ids=[3, -1])
        refused("need 1 <= n <= 1024", n=5000)
        refused("temperature must be a finite number, got nan", temperature=float("nan"))
        refused("top_p must be a finite number", top_p=float("inf"))
        refused("seed must be an int", seed=2 ** 70)
        refused("temperature 1e-39 is below 0.0001: .* use 0 for greedy", temperature=1e-39)  # NaN log-probs
        refused("temperature must be a finite number", temperature=2 ** 1100)  # no OverflowError unnamed
        refused("logprobs must be true or false, got 'false'", logprobs="false")
        refused("ignore_eos must be true or false", ignore_eos="x")
        # sent, its completion could pass the frame limit: the session would end with every request in flight
        refused(f"request h: n=40 samples of up to 1000000 tokens .* frame \\(at most "
                f"{P.MAX_COMPLETION_TOKENS:,} tokens", n=40, max_new_tokens=10 ** 6)
        with pytest.raises(EngineError, match=f"submit of 40 samples refused: 40 are in flight .* at most "
                                              f"{MAX_IN_FLIGHT} \\(--max-samples-in-flight\\)"):
            client.submit([Request(id="long", prompt_ids=[1], n=40, max_new_tokens=10 ** 5)])
            client.submit([Request(id="more", prompt_ids=[1], n=40, max_new_tokens=2)])
        assert client.abort(["long"]) == 1 and client.next_completion().id == "long"
        assert client.health()["running"] == 0
    finally:
        client.close()
    assert serves(server)


def test_nan_and_inf_weights_are_refused_naming_the_tensor(server):
    client = EngineClient(server[1], authkey=KEY, connect_timeout_s=30, request_timeout_s=30)
    try:
        for bad in (float("nan"), float("inf")):
            with pytest.raises(EngineWeightError, match="weight 'w' holds NaN or inf") as e:
                client.update_weights([[("w", torch.tensor([0.0, bad, 0.0, 0.0]))]])
            assert e.value.name == "w"
            with pytest.raises(EngineError, match="mixed weights"):  # nothing is generated from a broken update
                client.submit([Request(id="after-nan", prompt_ids=[1])])
        client.update_weights([[("w", torch.zeros(4))]])
    finally:
        client.close()
    assert serves(server)


def test_a_weight_beyond_the_engines_dtype_is_refused_and_a_refused_update_cannot_be_declared_done(server):
    client = EngineClient(server[1], authkey=KEY, connect_timeout_s=30, request_timeout_s=30)
    try:
        huge = torch.tensor([0.0, 1e300, 0.0, 0.0], dtype=torch.float64)  # finite, but inf in the engine's float32
        with pytest.raises(EngineWeightError, match="weight 'w' holds 1e\\+300, beyond float32's range") as e:
            client.update_weights([[("w", huge)]])
        assert e.value.name == "w"
        # a client that declares the refused update done anyway: still no generation from mixed weights
        with pytest.raises(EngineError, match="update_weights_done refused: a bucket of this update \\(from 'w'\\)"):
            client.call("update_weights_done")
        with pytest.raises(EngineError, match="mixed weights"):
            client.submit([Request(id="after-refused", prompt_ids=[1])])
        client.update_weights([[("w", torch.zeros(4, dtype=torch.float64))]])  # the whole update again: it begins
    finally:
        client.close()
    assert serves(server)


def _first_bucket(client, block) -> list:
    """The first bucket of an update (w = 1), sent as the client sends it: attach the block, then begins=true."""
    bucket = [("w", torch.ones(4))]
    specs, size = shm.weight_layout(bucket)
    client.call("update_weights", shm=block.reserve(size) or block.name, tensors=[])
    block.fill(bucket, specs)
    client.call("update_weights", shm=block.name, tensors=specs, begins=True)
    return specs


@pytest.mark.parametrize("how", ["a block that cannot be attached", "a malformed bucket that begins",
                                 "the client leaving mid-update"])
def test_an_update_left_partial_in_any_way_cannot_be_declared_done(server, how):
    """After part of an update is loaded, no path lets update_weights_done through (and generation with it) but
    the whole update sent again: a later bucket refused before it reaches the engine, a refused bucket that claims
    to begin a new update, or a new client declaring done what an earlier one left unfinished."""
    client = EngineClient(server[1], authkey=KEY, connect_timeout_s=30, request_timeout_s=30)
    block = shm.WeightBuffer()
    try:
        specs = _first_bucket(client, block)
        if how == "a block that cannot be attached":
            with pytest.raises(EngineError, match="nemo_dapo_1_w_000000000000"):
                client.call("update_weights", shm="nemo_dapo_1_w_000000000000", tensors=specs)
            refused = "a bucket of this update \\(from 'w'\\) was refused"
        elif how == "a malformed bucket that begins":
            with pytest.raises(EngineError, match="NaN"):
                block.fill([("w", torch.full((4,), float("nan")))], specs)
                client.call("update_weights", shm=block.name, tensors=specs)
            with pytest.raises(EngineError, match="via must be 'shm' or 'group'"):
                client.call("update_weights", via="bogus", tensors=[], begins=True)
            refused = "a bucket of this update was refused"
        else:
            block.close()
            client.close()
            client = EngineClient(server[1], authkey=KEY, connect_timeout_s=30, request_timeout_s=30)
            assert client.health()["weights_ok"] is False
            refused = "the previous client left its update unfinished"
        with pytest.raises(EngineError, match=f"update_weights_done refused: {refused}"):
            client.call("update_weights_done")
        with pytest.raises(EngineError, match="mixed weights"):
            client.submit([Request(id="after-partial", prompt_ids=[1])])
        client.update_weights([[("w", torch.zeros(4))]])  # the whole update again
        assert client.health()["weights_ok"] is True
    finally:
        block.close()
        client.close()
    assert serves(server)


def test_a_second_client_and_the_health_probe_beside_a_connected_trainer_answer_busy(server):
    trainer = EngineClient(server[1], authkey=KEY, name="trainer", connect_timeout_s=30, request_timeout_s=30)
    env = {**os.environ, P.AUTHKEY_ENV: KEY.decode(), "PYTHONPATH": ROOT}
    try:
        t0 = time.monotonic()
        with pytest.raises(EngineBusy, match="busy"):
            EngineClient(server[1], authkey=KEY, wait_if_busy=False, connect_timeout_s=5)
        with pytest.raises(EngineError, match="not reachable .* after 1 s .*ServerBusy"):
            EngineClient(server[1], authkey=KEY, connect_timeout_s=1.0)
        assert time.monotonic() - t0 < 6.0
        os.environ[P.AUTHKEY_ENV] = KEY.decode()
        try:
            t0 = time.monotonic()
            assert wait_healthy([server[1]], timeout_s=5.0, interval_s=1.0) == []  # busy = up, answered at once
            assert time.monotonic() - t0 < 10.0
        finally:
            del os.environ[P.AUTHKEY_ENV]
        probe = subprocess.run([sys.executable, "-m", "nemo_dapo.engines.health", "--timeout-s", "5", server[1]],
                               env=env, capture_output=True, text=True, timeout=120)
        assert probe.returncode == 0 and '"busy": true' in probe.stdout, probe.stderr
        trainer.submit([Request(id="t", prompt_ids=[3], max_new_tokens=3, seed=1)])  # the trainer is unaffected
        assert trainer.next_completion().samples[0].token_ids == [4, 7, 10]
    finally:
        trainer.close()
    assert serves(server)


def test_two_clients_proving_the_key_at_the_same_moment_one_is_served_the_other_told_busy_at_once(server):
    """Both handshakes end together: the one admitted first is welcomed, the other gets ``busy`` then and there (it
    was welcomed too and waited unanswered until the first left: a health probe its whole time-out)."""
    import threading

    got, ready = {}, threading.Barrier(2)

    def connect(tag):
        ready.wait()
        t0 = time.monotonic()
        try:
            got[tag] = EngineClient(server[1], authkey=KEY, name=tag, wait_if_busy=False, connect_timeout_s=20,
                                    request_timeout_s=20)
        except EngineBusy:
            got[tag] = "busy"
        got[tag + "_s"] = time.monotonic() - t0

    for _ in range(10):  # overlapping handshakes, or one during the other's session: one served, one busy at once
        threads = [threading.Thread(target=connect, args=(tag,)) for tag in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        served = [got[t] for t in ("a", "b") if got[t] != "busy"]
        assert len(served) == 1 and max(got["a_s"], got["b_s"]) < 5.0, got
        assert served[0].health()["running"] == 0  # the admitted one is served
        served[0].close()
    assert serves(server)  # and the server admits the next client once that one has left


def test_the_health_probe_with_a_wrong_key_stops_at_once_and_the_server_stays_up(server, monkeypatch, capsys):
    monkeypatch.setenv(P.AUTHKEY_ENV, "a-mistyped-key-of-enough-length")
    t0 = time.monotonic()
    assert wait_healthy([server[1]], timeout_s=600.0, interval_s=1.0) == [server[1]]
    assert time.monotonic() - t0 < 10.0  # not the 600 s: retrying cannot fix a key
    assert "refused our engine key" in capsys.readouterr().err
    assert serves(server)


def _as_nobody(fn) -> int:
    """Run fn() in a forked child with uid/gid 65534; its exit code (0: fn returned True)."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            os._exit(0 if fn() else 1)
        except BaseException:  # noqa: BLE001 - the child reports through its exit code only
            os._exit(2)
    return os.waitpid(pid, 0)[1] >> 8


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another user needs root (os.setuid)")
def test_a_foreign_user_can_neither_reach_the_unix_socket_nor_drive_the_tcp_server(server, tmp_path):
    sock_dir = tmp_path / "private"
    sock_dir.mkdir(mode=0o700)
    unix = f"unix:{sock_dir}/e.sock"
    proc = start_server(tmp_path, unix, key=None)  # keyless is allowed: nobody else can enter the directory
    try:
        def reach_unix():
            try:
                P.connect_socket(unix, 5)
            except PermissionError:
                return True
            return False

        def drive_tcp():  # no key (the public constant of old is refused), so no shutdown
            try:
                c = EngineClient(server[1], authkey=b"nemo_dapo-engine", connect_timeout_s=5)
                c.call("shutdown")
            except EngineError as e:
                return "refused our engine key" in str(e)
            return False

        assert _as_nobody(reach_unix) == 0
        assert _as_nobody(drive_tcp) == 0
        own = EngineClient(unix, authkey=b"", connect_timeout_s=30)  # its own user, keyless
        assert own.health()["running"] == 0
        own.close()
    finally:
        proc.kill()
        proc.wait()
    assert serves(server)


TRAINER = """
import sys, torch
from nemo_dapo.engines.client import EngineClient, EngineProcess
proc = EngineProcess(engine={toy!r}, model_dir="-", address="unix:{d}/e.sock", log_path="{d}/engine.log",
                     env={{"PYTHONPATH": {root!r}}}, options={{"load_delay_s": 0.1}})
print("engine", proc.pid, flush=True)
client = EngineClient(proc.address, process=proc, connect_timeout_s=120, request_timeout_s=60)
def buckets():
    for k in range(10_000):
        if k == 3:
            print("mid-transfer", flush=True)
        yield [("w", torch.full((4,), float(k)))]
client.update_weights(buckets())
"""


def ours(pid: int) -> list:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"nemo_dapo_{pid}_")]


def test_a_process_group_kill_mid_transfer_leaves_nothing_in_dev_shm(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER.format(toy=TOY, d=tmp_path, root=ROOT))
    before = sorted(n for n in os.listdir("/dev/shm") if n.startswith("nemo"))
    trainer = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"},
                               start_new_session=True)  # its own process group, as a job step
    engine_pid = None
    try:
        for line in trainer.stdout:
            engine_pid = int(line.split()[1]) if line.startswith("engine") else engine_pid
            if line.startswith("mid-transfer"):
                break
        assert engine_pid and trainer.poll() is None
        assert ours(trainer.pid) == []  # the block in use has no name left: the engine removed it on attach
    finally:
        os.killpg(trainer.pid, signal.SIGKILL)  # what scancel or a cgroup OOM kill does: no finally runs
        trainer.wait()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{engine_pid}") and time.monotonic() < deadline:  # it exits with its parent
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{engine_pid}") or open(f"/proc/{engine_pid}/stat").read().split()[2] == "Z"
    after = sorted(n for n in os.listdir("/dev/shm") if n.startswith("nemo"))
    # other processes on this machine may create and remove their own blocks meanwhile: count the trainer's
    left = [n for n in set(after) - set(before) if n.startswith((f"nemo_dapo_{trainer.pid}_",
                                                                   f"nemo_dapo_{engine_pid}_"))]
    assert left == [], (before, after)


def test_a_partial_wake_readies_the_weights_and_keeps_generation_asleep(server):
    """The refit order of the colocated path: sleep(2) -> wake {tags: ["weights"]} -> update -> wake -> submit."""
    client = EngineClient(server[1], authkey=KEY, connect_timeout_s=30, request_timeout_s=30)
    try:
        assert client.info["sleep_releases"]["2"] == ["kv_cache", "weights"]
        assert client.info["wake_tags"] == ["weights", "kv_cache"]
        client.sleep(2)
        with pytest.raises(EngineError, match="released by sleep"):  # the toy refuses a load into released weights
            client.update_weights([[("w", torch.zeros(4))]])
        client.sleep(2)
        client.call("wake", tags=["weights"])
        client.update_weights([[("w", torch.zeros(4))]])
        with pytest.raises(EngineError, match="asleep"):  # the KV cache is still released: no generation yet
            client.submit([Request(id="half-awake", prompt_ids=[1])])
        for bad in ([], ["model"], "weights", [1]):
            with pytest.raises(EngineError, match="wake tags must be"):
                client.call("wake", tags=bad)
        client.wake()
    finally:
        client.close()
    assert serves(server)


def test_submit_limits_hold_at_their_bounds_and_repeated_ids_are_refused(server):
    client = EngineClient(server[1], authkey=KEY, connect_timeout_s=30, request_timeout_s=30)
    try:
        client.submit([Request(id="all", prompt_ids=[1], n=MAX_IN_FLIGHT, max_new_tokens=10 ** 5)])  # exactly
        with pytest.raises(EngineError, match="cannot sleep with requests running"):
            client.sleep(1)
        with pytest.raises(EngineError, match=f"submit of 1 samples refused: {MAX_IN_FLIGHT} are in flight"):
            client.submit([Request(id="one-more", prompt_ids=[1])])
        assert client.abort(["all"]) == 1 and client.next_completion().id == "all"
        with pytest.raises(EngineError, match="request ids already in flight or repeated"):
            client.submit([Request(id="twin", prompt_ids=[1]), Request(id="twin", prompt_ids=[2])])
        assert client.health()["running"] == 0
        for level in (0, 3, True):
            with pytest.raises(EngineError, match="sleep level must be 1 .* or 2"):
                client.call("sleep", level=level)
        assert not client.health()["sleeping"]
    finally:
        client.close()
    assert serves(server)


def test_many_failed_handshakes_one_after_another_leave_the_server_open_to_the_next(server):
    for _ in range(S.MAX_HANDSHAKES + 6):  # more than may run at once: each gives its place back when it ends
        _attack(server, _wrong_key)
    assert serves(server)


def test_the_health_probe_leaves_and_waits_no_longer_than_its_time_out(server, monkeypatch, capsys):
    monkeypatch.setenv(P.AUTHKEY_ENV, KEY.decode())
    out = io.StringIO()
    time.sleep(0.3)  # the last test's session has ended (a probe arriving during one is told busy: healthy)
    assert wait_healthy([server[1]], timeout_s=30.0, interval_s=1.0, out=out) == []
    assert '"weights_ok": true' in out.getvalue()
    trainer = EngineClient(server[1], authkey=KEY, connect_timeout_s=5)  # the probe has left: the server is free
    try:
        with pytest.raises(EngineWeightError):
            trainer.update_weights([[("w", torch.full((4,), float("nan")))]])  # its weights are not ok now
    finally:
        trainer.close()
    time.sleep(0.3)
    t0 = time.monotonic()
    assert wait_healthy([server[1]], timeout_s=2.0, interval_s=30.0, out=out) == [server[1]]
    assert time.monotonic() - t0 < 20  # the 2 s time-out, not the 30 s pause between rounds
    assert "not healthy after 2 s" in capsys.readouterr().err
    trainer = EngineClient(server[1], authkey=KEY, connect_timeout_s=30)
    trainer.update_weights([[("w", torch.zeros(4))]])
    trainer.close()
    assert serves(server)


def test_the_health_probes_time_out_must_be_positive(capsys):
    with pytest.raises(SystemExit) as e:
        health_main(["--timeout-s", "0", "unix:/nonexistent/e.sock"])
    assert e.value.code == 2 and "must be positive" in capsys.readouterr().err


class _Adapter(ToyEngine):
    """The toy engine with a context length, whose add refuses a prompt that starts with ``refuse``."""

    def __init__(self, max_seq_len=None, refuse=None):
        super().__init__()
        self.max_seq_len, self.refuse, self.aborted = max_seq_len, refuse, []

    def info(self):
        return {**super().info(), "max_seq_len": self.max_seq_len}

    def add(self, request):
        if request.prompt_ids[0] == self.refuse:
            raise EngineError("refused by the engine")
        super().add(request)

    def abort(self, ids):
        self.aborted += list(ids)
        return super().abort(ids)


class _Sent:
    """A server's channel that keeps what is sent on it."""

    def __init__(self):
        self.sent = []

    def send(self, msg, timeout_s=None):
        self.sent.append(msg)


def _submit(adapter, *requests) -> tuple:
    """One submit to an in-process server (no socket): its reply, and the requests running after it."""
    ch, server = _Sent(), S.EngineServer(adapter, listener=None)
    server._handle(ch, {"op": "submit", "cmd": 1, "requests": [r.to_wire() for r in requests]})
    server._handle(ch, {"op": "health", "cmd": 2})
    return ch.sent[0], ch.sent[1]["running"]


def test_a_submit_the_engine_refuses_part_way_runs_none_of_it():
    adapter = _Adapter(refuse=9)
    reply, running = _submit(adapter, Request(id="a", prompt_ids=[1]), Request(id="b", prompt_ids=[9]))
    assert reply["op"] == "error" and "refused by the engine" in reply["message"] and running == 0
    assert adapter.aborted == ["a"] and not adapter.has_work()  # the one already added is taken back


def test_the_completion_bound_counts_only_the_room_the_prompt_leaves():
    per_sample = P.MAX_COMPLETION_TOKENS // 4
    fits = Request(id="fits", prompt_ids=[1] * 100, n=4, max_new_tokens=10 ** 9)
    reply, running = _submit(_Adapter(max_seq_len=per_sample + 100), fits)  # 4 x per_sample tokens at most
    assert reply["op"] == "reply" and running == 1
    reply, running = _submit(_Adapter(max_seq_len=per_sample + 101), fits)  # one token more per sample
    assert reply["op"] == "error" and f"n=4 samples of up to {per_sample + 1} tokens" in reply["message"]
