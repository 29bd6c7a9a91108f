"""The engine server and client over a real socket and a real server process (the engine itself is a toy), and the
protocol's own checks at their bounds (frames, handshake, keys, addresses: no server)."""
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch

from nemo_dapo.engines import protocol as P
from nemo_dapo.engines.base import Completion, EngineError, EngineWeightError, Request, Sample
from nemo_dapo.engines.client import EngineClient, EngineDied, EngineProcess
from nemo_dapo.engines.generator import EngineGenerator, completions_to_generation, weight_buckets

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOY = "tests.engines.toy_engine:ToyEngine"
ENV = {"PYTHONPATH": ROOT}


def start(tmp_path, name="toy", **options):
    proc = EngineProcess(engine=TOY, model_dir="-", address=f"unix:{tmp_path}/{name}.sock", options=options,
                         log_path=str(tmp_path / f"{name}.log"), env=ENV)
    client = EngineClient(proc.address, name=name, connect_timeout_s=60, request_timeout_s=20, process=proc)
    return proc, client


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """One server for the tests that leave it as they found it (weights zero, awake, idle)."""
    proc, client = start(tmp_path_factory.mktemp("toy"))
    yield proc, client
    proc.stop(client if client.alive else None)


def expected(req, j, offset=0):
    toks = []
    for t in range(req.max_new_tokens):
        tok = ((req.seed or 0) + 7 * j + 3 * t + req.prompt_ids[-1] + offset) % 50
        toks.append(tok)
        if tok in req.stop_token_ids:
            break
    return toks


def collect(client, n):
    return {c.id: c for c in (client.next_completion() for _ in range(n))}


def test_hello_reports_engine_and_info(toy):
    _, client = toy
    assert client.engine == TOY and client.info == {
        "model": "toy", "vocab_size": 50, "sleep_releases": {"1": ["kv_cache"], "2": ["kv_cache", "weights"]},
        "wake_tags": ["weights", "kv_cache"], "torch": torch.__version__}
    assert client.health()["running"] == 0


def test_submit_streams_completions_with_tokens_logprobs_and_finish_reasons(toy):
    _, client = toy
    reqs = [Request(id="a", prompt_ids=[1, 2], n=2, max_new_tokens=5, seed=3),
            Request(id="b", prompt_ids=[4], n=1, max_new_tokens=30, seed=1, stop_token_ids=[11])]
    client.submit(reqs)
    done = collect(client, 2)
    for r in reqs:
        for j, s in enumerate(done[r.id].samples):
            assert s.token_ids == expected(r, j)
            assert s.logprobs == [-0.5] * len(s.token_ids)
    assert [s.finish_reason for s in done["a"].samples] == ["length", "length"]
    b = done["b"].samples[0]
    assert b.finish_reason == "stop" and b.token_ids[-1] == 11  # the stop token is kept


def test_in_flight_completions_arrive_in_finish_order_not_submit_order(toy):
    _, client = toy
    client.submit([Request(id=f"q{k}", prompt_ids=[1], max_new_tokens=m) for k, m in enumerate([9, 2, 5])])
    order = [client.next_completion().id for _ in range(3)]
    assert order == ["q1", "q2", "q0"]


def test_abort_returns_partial_samples_marked_aborted(tmp_path):
    proc, client = start(tmp_path, step_delay_s=0.02)
    try:
        client.submit([Request(id="long", prompt_ids=[1], n=2, max_new_tokens=10_000),
                       Request(id="short", prompt_ids=[1], max_new_tokens=2)])
        assert client.next_completion().id == "short"
        time.sleep(0.1)
        assert client.abort(["long", "unknown"]) == 1
        c = client.next_completion()
        assert c.id == "long" and all(s.finish_reason == "aborted" for s in c.samples)
        assert 0 < len(c.samples[0].token_ids) < 10_000
        assert client.health()["running"] == 0
    finally:
        proc.stop(client)


def test_weight_update_through_shared_memory_changes_generation(toy):
    _, client = toy
    req = Request(id="x", prompt_ids=[5], max_new_tokens=4, seed=2)
    stats = client.update_weights([[("w", torch.tensor([1.0, 2.0, 3.0, 4.0]))]])
    assert stats["buckets"] == 1 and stats["tensors"] == 1 and stats["bytes"] == 16
    client.submit([req])
    assert client.next_completion().samples[0].token_ids == expected(req, 0, offset=10)
    client.update_weights([[("w", torch.zeros(4))]])


def test_rejected_weight_names_the_tensor_and_blocks_generation_until_a_full_update(toy):
    _, client = toy
    with pytest.raises(EngineWeightError, match="'model.bogus.weight'") as e:
        client.update_weights([[("w", torch.ones(4))], [("model.bogus.weight", torch.ones(4))]])
    assert e.value.name == "model.bogus.weight"
    with pytest.raises(EngineWeightError, match=r"shape \(5,\)"):
        client.update_weights([[("w", torch.ones(5))]])
    with pytest.raises(EngineError, match="mixed weights"):
        client.submit([Request(id="y", prompt_ids=[1])])
    client.update_weights([[("w", torch.zeros(4))]])
    client.submit([Request(id="y", prompt_ids=[1])])
    assert client.next_completion().id == "y"


def test_update_refused_while_requests_run(tmp_path):
    proc, client = start(tmp_path, step_delay_s=0.05)
    try:
        client.submit([Request(id="r", prompt_ids=[1], max_new_tokens=1000)])
        with pytest.raises(EngineError, match="still running"):
            client.update_weights([[("w", torch.ones(4))]])
    finally:
        proc.stop(client)


def test_sleep_refuses_requests_until_wake(toy):
    _, client = toy
    client.sleep(2)
    assert client.health()["sleeping"]
    with pytest.raises(EngineError, match="asleep"):
        client.submit([Request(id="s", prompt_ids=[1])])
    client.wake()
    client.submit([Request(id="s", prompt_ids=[1])])
    assert client.next_completion().id == "s"


def test_wrong_protocol_version_is_refused_at_connect(tmp_path):
    sock = f"unix:{tmp_path}/old.sock"
    code = ("import sys, nemo_dapo.engines.protocol as P; P.PROTOCOL_VERSION = 99; "
            "from nemo_dapo.engines.server import main; sys.exit(main(sys.argv[1:]))")
    key = P.new_authkey()
    proc = subprocess.Popen([sys.executable, "-c", code, "--engine", TOY, "--model", "-", "--address", sock],
                            env={**os.environ, **ENV, P.AUTHKEY_ENV: key.decode()}, stderr=subprocess.DEVNULL)
    try:
        with pytest.raises(EngineError, match=f"protocol version mismatch: client speaks {P.PROTOCOL_VERSION}, .* "
                                              "speaks 99"):
            EngineClient(sock, name="old", connect_timeout_s=60, authkey=key)
    finally:
        proc.kill()
        proc.wait()


def test_unreachable_engine_is_a_clear_error_not_a_hang(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="not reachable at unix:.*nobody.sock after 1 s"):
        EngineClient(f"unix:{tmp_path}/nobody.sock", connect_timeout_s=1.0)
    assert time.monotonic() - t0 < 10


def test_engine_killed_mid_generation_raises_engine_died_promptly(tmp_path):
    proc, client = start(tmp_path, step_delay_s=0.05)
    client.submit([Request(id="r", prompt_ids=[1], max_new_tokens=100_000)])
    time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(EngineDied, match="connection to engine 'toy' .* lost.*exit code -9"):
        client.next_completion(timeout_s=30)
    assert time.monotonic() - t0 < 10
    with pytest.raises(EngineDied):  # every later call fails the same way, at once
        client.health()
    proc.stop()


def test_engine_crash_inside_step_is_reported_with_its_cause(tmp_path):
    proc, client = start(tmp_path, fail_after_steps=3)
    client.submit([Request(id="r", prompt_ids=[1], max_new_tokens=100)])
    with pytest.raises(EngineDied, match="failed while generating: RuntimeError\\('toy engine crashed on purpose'"):
        client.next_completion()
    assert proc.proc.wait(timeout=10) == 1
    proc.stop()


def _misbehaving_server(address: str, key: bytes, after_hello: dict) -> threading.Thread:
    """A server of one connection that answers hello, then sends ``after_hello`` (what no nemo_dapo server sends)."""
    listener = P.Listener(address)

    def serve():
        sock = None
        while sock is None:
            sock = listener.accept(1.0)
        ch = P.server_handshake(sock, key)
        hello = ch.recv(10)
        ch.send({"op": "reply", "cmd": hello["cmd"], "version": P.PROTOCOL_VERSION, "engine": "odd", "info": {}})
        ch.send(after_hello)
        ch.recv(30)  # until the client closes
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_a_completion_the_client_cannot_read_ends_its_waits_at_once_naming_the_cause(tmp_path):
    key = P.new_authkey()
    _misbehaving_server(f"unix:{tmp_path}/odd.sock", key, {"op": "completion", "samples": []})  # no id
    client = EngineClient(f"unix:{tmp_path}/odd.sock", authkey=key, name="odd", connect_timeout_s=30,
                          check_shared_memory=False)
    t0 = time.monotonic()
    with pytest.raises(EngineDied, match="engine 'odd' .* sent a message this client cannot read \\(KeyError\\('id'"):
        client.next_completion(timeout_s=30)
    assert time.monotonic() - t0 < 10  # not the 30 s time-out, reported as a stuck engine
    client.close()


def test_a_refused_submit_leaves_nothing_counted_in_flight(toy):
    _, client = toy
    idle = client.idle_seconds()
    with pytest.raises(EngineError, match="outside the vocabulary"):
        client.submit([Request(id="bad", prompt_ids=[1, 10 ** 6])])
    time.sleep(0.2)
    assert client.idle_seconds() >= idle + 0.2  # still idle: the refused request never ran


def test_a_stuck_engine_times_out(tmp_path):
    proc, client = start(tmp_path, step_delay_s=0.5)
    try:
        client.submit([Request(id="r", prompt_ids=[1], max_new_tokens=100)])
        with pytest.raises(EngineError, match="no completion in 1 s"):
            client.next_completion(timeout_s=1.0)
    finally:
        proc.stop(client)


def test_a_stuck_weight_load_fails_at_the_weight_deadline_not_the_request_one(tmp_path):
    """A trainer's other ranks wait in the refit's collectives while an owner sends a bucket: a stuck engine must
    fail the owner within ``weight_timeout_s``, not the long ``request_timeout_s`` of a generation."""
    proc, client = start(tmp_path, load_delay_s=30.0)
    client.weight_timeout_s = 1.0
    try:
        t0 = time.monotonic()
        with pytest.raises(EngineError, match="did not answer 'update_weights' within 1 s"):
            client.update_weights([[("w", torch.ones(4))]])
        assert time.monotonic() - t0 < 5 and client.request_timeout_s == 20
    finally:
        proc.stop()


def test_generator_batch_and_stream_agree_and_stream_abort_counts_tokens(tmp_path):
    proc, client = start(tmp_path, lengths=[3, 3, 3, 40])
    try:
        gen = EngineGenerator(client, eos_id=49, pad_id=0)
        ids = torch.tensor([[0, 0, 7], [0, 8, 9]])
        mask = (torch.arange(3) >= torch.tensor([[2], [1]])).long()
        out = gen.generate(ids, mask, max_new_tokens=6, temperature=1.0, seed=5)
        assert out.response_ids.shape[0] == 2 and out.logprobs is not None
        assert torch.equal(out.response_mask.sum(-1), torch.tensor([3.0, 3.0]))
        stream = gen.stream(ids, mask, n=2, max_new_tokens=50, seed=5)
        first_k, first = next(iter(stream))
        assert first.response_ids.shape[0] == 2
        stream.abort()
        assert stream.done and stream.aborted_requests == 1 and stream.aborted_tokens > 0
        assert stream.generated_tokens == int(first.response_mask.sum()) + stream.aborted_tokens
    finally:
        proc.stop(client)


def test_closing_a_client_frees_the_server_for_the_next_one(tmp_path):
    # the server serves one client at a time: a closed client must end its session at once, not when the
    # process exits (its reader thread would otherwise hold the socket open and the next client hang)
    proc, first = start(tmp_path)
    try:
        first.close()
        assert not first.alive
        second = EngineClient(proc.address, name="toy", connect_timeout_s=10, request_timeout_s=5, process=proc)
        assert second.health()["running"] == 0
    finally:
        proc.stop(second if "second" in locals() and second.alive else None)


def test_idle_seconds_count_only_the_time_with_no_request_in_flight(tmp_path):
    proc, client = start(tmp_path, "idle", step_delay_s=0.05)
    try:
        time.sleep(0.3)
        t0, idle0 = time.perf_counter(), client.idle_seconds()
        assert idle0 >= 0.3  # nothing submitted since the connection
        client.submit([Request(id="busy", prompt_ids=[1], n=1, max_new_tokens=12, seed=1)])  # ~0.6 s of steps
        client.next_completion()
        busy = time.perf_counter() - t0
        idle1 = client.idle_seconds()
        assert busy >= 0.5 and idle1 - idle0 < 0.5 * busy  # the engine was busy all along
        time.sleep(0.4)
        assert client.idle_seconds() - idle1 >= 0.35  # and idle again once the completion came back
    finally:
        proc.stop(client)


def test_a_frame_one_byte_over_the_limit_is_refused():
    a, b = socket.socketpair()
    try:
        ch = P.Channel(a, max_frame=10)
        body = b'{"op":"x"}'  # exactly 10 bytes: accepted
        b.sendall(struct.pack("!Q", len(body)) + body)
        assert ch.recv(2.0) == {"op": "x"}
        b.sendall(struct.pack("!Q", 11) + b'{"op":"xy"}')
        with pytest.raises(P.FrameTooLarge):
            ch.read_frame(2.0)
    finally:
        a.close()
        b.close()


def test_an_empty_client_nonce_is_refused_at_the_handshake():
    key = b"k" * 32
    a, b = socket.socketpair()
    result = {}

    def serve():
        try:
            result["ch"] = P.server_handshake(a, key, timeout_s=5.0)
        except Exception as e:  # noqa: BLE001
            result["error"] = e

    t = threading.Thread(target=serve)
    t.start()
    try:
        client = P.Channel(b, P.HANDSHAKE_MAX_BYTES)
        challenge = client.recv(5.0)
        client.send({"op": "auth", "mac": P._mac(key, "client", challenge["nonce"]), "nonce": ""}, 5.0)
        t.join(10.0)
        assert isinstance(result.get("error"), P.ProtocolError), result
    finally:
        a.close()
        b.close()


def test_a_key_file_its_group_can_read_is_refused(tmp_path):
    path = tmp_path / "key"
    path.write_text("k" * 32)
    os.chmod(path, 0o640)
    with pytest.raises(P.KeyConfigError, match="chmod 600"):
        P.read_authkey({P.AUTHKEY_FILE_ENV: str(path)})
    os.chmod(path, 0o600)
    assert P.read_authkey({P.AUTHKEY_FILE_ENV: str(path)}) == b"k" * 32


def test_a_socket_directory_its_group_can_enter_needs_a_key(tmp_path):
    d = tmp_path / "sock"
    d.mkdir()
    os.chmod(d, 0o710)
    assert P.keyless_problem(f"unix:{d}/e.sock") is not None
    os.chmod(d, 0o700)
    assert P.keyless_problem(f"unix:{d}/e.sock") is None


def test_a_key_one_byte_short_is_refused():
    with pytest.raises(P.KeyConfigError, match="need at least"):
        P.read_authkey({P.AUTHKEY_ENV: "k" * (P.MIN_KEY_BYTES - 1)})
    assert P.read_authkey({P.AUTHKEY_ENV: "k" * P.MIN_KEY_BYTES}) == b"k" * P.MIN_KEY_BYTES


def test_port_65536_is_not_an_address():
    assert P.parse_address("tcp://127.0.0.1:65535")[0] == ("127.0.0.1", 65535)
    with pytest.raises(P.AddressError):
        P.parse_address("tcp://127.0.0.1:65536")


def test_a_non_string_op_is_refused():
    with pytest.raises(P.ProtocolError, match="string 'op'"):
        P.decode(b'{"op": 5}')


def test_a_later_bucket_larger_than_the_first_moves_to_a_new_block(toy):
    _, client = toy
    req = Request(id="grown", prompt_ids=[5], max_new_tokens=4, seed=2)
    # the second bucket needs two 64-byte slots where the first needed one: a new shared-memory block
    stats = client.update_weights([[("w", torch.ones(4))], [("w", torch.ones(4)), ("w", torch.full((4,), 2.0))]])
    assert stats["buckets"] == 2 and stats["buffer_bytes"] > 64
    client.submit([req])
    assert client.next_completion().samples[0].token_ids == expected(req, 0, offset=8)  # the last copy of w
    client.update_weights([[("w", torch.zeros(4))]])


def test_weight_buckets_fill_up_to_the_byte_limit_exactly():
    model = torch.nn.ParameterDict({k: torch.nn.Parameter(torch.zeros(4)) for k in "abcde"})  # 16 bytes each
    names = [[n for n, _ in b] for b in weight_buckets(model, bucket_bytes=32)]
    assert names == [["a", "b"], ["c", "d"], ["e"]]
    assert [[n for n, _ in b] for b in weight_buckets(model, bucket_bytes=8)] == [[k] for k in "abcde"]


def test_a_generation_marks_cut_and_aborted_samples_truncated_and_only_aborted_ones_unfinished():
    samples = [Sample([1, 2], [-0.1, -0.2], "stop"), Sample([3], [-0.3], "length"), Sample([4], [-0.4], "aborted")]
    out = completions_to_generation([Completion("c", samples)], pad_id=0)
    assert out.truncated.tolist() == [False, True, True] and out.finished.tolist() == [True, True, False]
    assert out.response_ids.tolist() == [[1, 2], [3, 0], [4, 0]] and out.response_mask.sum().item() == 4


def test_the_generators_requests_stop_at_eos_and_the_extra_stop_tokens():
    gen = EngineGenerator(None, eos_id=49, pad_id=0, stop_token_ids=[7, 3])
    [req] = gen._requests([[1, 2]], n=4, max_new_tokens=8, temperature=1.0, top_p=1.0, seed=0)
    assert req.stop_token_ids == [3, 7, 49] and req.n == 4 and req.prompt_ids == [1, 2]


def test_a_batch_generate_ignores_the_completions_of_a_stream_left_unread(toy):
    _, client = toy
    gen = EngineGenerator(client, eos_id=99, pad_id=0)  # an id the toy never emits: every sample runs its budget
    ids, mask = torch.tensor([[0, 7], [8, 9]]), torch.tensor([[0, 1], [1, 1]])
    gen.stream(ids, mask, n=2, max_new_tokens=3, seed=5)  # never iterated: its 2 completions arrive first
    time.sleep(0.3)
    out = gen.generate(ids, mask, max_new_tokens=5, seed=5)
    assert out.response_ids.shape == (2, 5) and out.response_mask.sum().item() == 10
    with pytest.raises(EngineError, match="no completion"):
        client.next_completion(timeout_s=0.5)  # nothing left over: the stream's were read and dropped
