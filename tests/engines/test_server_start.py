"""Starting an engine server: where its key comes from and who may reach it, the trainer's private key hand-over,
one ``error:`` line (exit 2 or 3) for every start mistake, an engine dependency that does not import, the
shared-memory check at connect, and no socket directory left by a failed start."""
import os
import subprocess
import sys

import pytest
import torch

from nemo_dapo.core import engine_registry
from nemo_dapo.engines import protocol as P
from nemo_dapo.engines import server as S
from nemo_dapo.engines.base import EngineError
from nemo_dapo.engines.client import EngineClient, EngineProcess, EngineRefused
from tests.engines.toy_engine import ToyEngine

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOY = "tests.engines.toy_engine:ToyEngine"
KEY = "k" * 32


@pytest.fixture
def env(monkeypatch):
    """No key in the environment unless a test sets one."""
    monkeypatch.delenv(P.AUTHKEY_ENV, raising=False)
    monkeypatch.delenv(P.AUTHKEY_FILE_ENV, raising=False)
    return monkeypatch


def one_error(capsys, *argv, code=2):
    """main(argv) must refuse with ``code`` and exactly one ``error:`` line; returns that line."""
    try:
        got = S.main(list(argv))
    except SystemExit as e:  # argparse's refusals exit from inside parse_args
        got = e.code
    assert got == code
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and ": error: " in err[0] and "Traceback" not in err[0], err
    return err[0]


def private_dir(tmp_path, mode=0o700):
    d = tmp_path / f"d{mode:o}"
    d.mkdir()
    os.chmod(d, mode)
    return d


def test_a_keyless_start_is_refused_with_the_fix_except_in_a_private_socket_directory(env, tmp_path, capsys):
    err = one_error(capsys, "--engine", TOY, "--model", "-", "--address", "tcp://127.0.0.1:1")
    assert "no engine key" in err and P.AUTHKEY_ENV in err and P.AUTHKEY_FILE_ENV in err
    shared = private_dir(tmp_path, 0o755)
    err = one_error(capsys, "--engine", TOY, "--model", "-", "--address", f"unix:{shared}/e.sock")
    assert "can be entered by other users (mode 755" in err and "chmod 700" in err
    assert P.server_key_policy(f"unix:{private_dir(tmp_path)}/e.sock", None, False).startswith("no key")
    assert P.keyless_problem("tcp://127.0.0.1:5") is not None  # every user can reach a port
    assert not hasattr(P, "DEFAULT_AUTHKEY")  # the public key of old is gone


def test_a_keyless_client_is_refused_with_the_fix_before_it_connects_to_a_port(env, tmp_path):
    # a client without a key would otherwise wait out its connect time-out, or talk to whoever holds the port
    with pytest.raises(EngineRefused, match=f"no engine key, and a TCP port can be reached by every user(.|\n)*"
                                            f"\\${P.AUTHKEY_ENV}"):
        EngineClient("tcp://127.0.0.1:1", name="toy", connect_timeout_s=60)
    with pytest.raises(EngineRefused, match="can be entered by other users"):
        EngineClient(f"unix:{private_dir(tmp_path, 0o755)}/e.sock", name="toy", connect_timeout_s=60)


def test_a_non_loopback_bind_needs_the_option_and_a_key(env, capsys):
    err = one_error(capsys, "--engine", TOY, "--model", "-", "--address", "tcp://0.0.0.0:5")
    assert "not a loopback address" in err and "--allow-remote-clients" in err
    err = one_error(capsys, "--engine", TOY, "--model", "-", "--address", "tcp://0.0.0.0:5", "--allow-remote-clients")
    assert "needs a key" in err
    assert P.server_key_policy("tcp://0.0.0.0:5", KEY.encode(), True) == "key"
    assert P.server_key_policy("tcp://localhost:5", KEY.encode(), False) == "key"
    with pytest.raises(P.KeyConfigError, match="not a loopback"):
        P.server_key_policy("tcp://myhost:5", KEY.encode(), False)  # a host name may name any interface


def test_the_key_comes_from_the_environment_or_a_private_file(env, tmp_path):
    assert P.read_authkey() is None
    env.setenv(P.AUTHKEY_ENV, KEY)
    assert P.read_authkey() == KEY.encode()
    env.setenv(P.AUTHKEY_ENV, "short")
    with pytest.raises(P.KeyConfigError, match="5 bytes, need at least 16"):
        P.read_authkey()
    env.delenv(P.AUTHKEY_ENV)
    f = tmp_path / "key"
    f.write_text(KEY + "\n")
    os.chmod(f, 0o644)
    env.setenv(P.AUTHKEY_FILE_ENV, str(f))
    with pytest.raises(P.KeyConfigError, match=f"mode 644.*run chmod 600 {f}"):
        P.read_authkey()
    os.chmod(f, 0o600)
    assert P.read_authkey() == KEY.encode()
    env.setenv(P.AUTHKEY_ENV, KEY)
    with pytest.raises(P.KeyConfigError, match="both .* are set"):
        P.read_authkey()


def test_a_trainer_started_server_gets_a_fresh_key_privately(tmp_path):
    d = private_dir(tmp_path)
    procs = [EngineProcess(engine=TOY, model_dir="-", address=f"unix:{d}/e{k}.sock", log_path=str(d / f"{k}.log"),
                           env={"PYTHONPATH": ROOT}) for k in range(2)]
    try:
        assert procs[0].authkey != procs[1].authkey and len(procs[0].authkey) >= P.MIN_KEY_BYTES
        client = EngineClient(procs[0].address, process=procs[0], connect_timeout_s=120)
        key = procs[0].authkey
        with open(f"/proc/{procs[0].pid}/cmdline", "rb") as f:
            assert key not in f.read()  # ps shows arguments: the key is not one
        with open(f"/proc/{procs[0].pid}/environ", "rb") as f:
            assert P.AUTHKEY_ENV.encode() + b"=" + key in f.read()  # handed over in its environment
        assert os.stat(f"/proc/{procs[0].pid}/environ").st_uid == os.getuid()
        with pytest.raises(EngineError, match="refused our engine key"):  # the other server's key is not it
            EngineClient(procs[1].address, authkey=key, connect_timeout_s=120)
        client.health()
        procs[0].stop(client)
    finally:
        for p in procs:
            p.stop()
    for p in procs:
        assert key not in open(p.log_path, "rb").read()


def test_a_server_given_cpus_runs_on_them(tmp_path):
    cpu = max(os.sched_getaffinity(0))
    d = private_dir(tmp_path)
    proc = EngineProcess(engine=TOY, model_dir="-", address=f"unix:{d}/e.sock", log_path=str(d / "e.log"),
                         env={"PYTHONPATH": ROOT}, cpus=[cpu])
    try:
        client = EngineClient(proc.address, process=proc, connect_timeout_s=120)
        client.health()  # it is up: pinned before its engine was built
        assert os.sched_getaffinity(proc.pid) == {cpu}
        assert "--cpus" in open(f"/proc/{proc.pid}/cmdline", "rb").read().decode().split("\0")
        proc.stop(client)
    finally:
        proc.stop()


@pytest.mark.parametrize("args, message", [
    (["--engine", "local", "--model", "/nonexistent"], "--model '/nonexistent': not a Hugging Face checkpoint"),
    (["--engine", TOY, "--model", "-", "--option", "bogus=1"], "--option: engine .* does not take that option"),
    (["--engine", TOY, "--model", "-", "--option", "novalue"], "--option 'novalue': expected key=value"),
    (["--engine", TOY, "--model", "-", "--option", "=1"], "--option '=1': expected key=value"),
    (["--engine", TOY, "--model", "-", "--threads", "-2"], "--threads: expected a positive int, got '-2'"),
    (["--engine", TOY, "--model", "-", "--threads", "0"], "--threads: expected a positive int, got '0'"),
    (["--engine", TOY, "--model", "-", "--cpus", "0-x"], "--cpus: expected CPU ids such as 0,2-3, got '0-x'"),
    (["--engine", TOY, "--model", "-", "--cpus", "4096"], r"--cpus names CPUs \[4096\] that this machine does not"),
    (["--engine", "nosuch", "--model", "-"], "--engine 'nosuch': unknown"),
    (["--engine", "tests.engines.toy_engine:NoSuch", "--model", "-"], "has no attribute 'NoSuch'"),
])
def test_server_cli_mistakes_are_one_error_line_and_exit_2(env, tmp_path, capsys, args, message):
    import re

    env.setenv(P.AUTHKEY_ENV, KEY)
    err = one_error(capsys, *args, "--address", f"unix:{tmp_path}/e.sock")
    assert re.search(message, err), err


def test_bad_addresses_are_one_error_line_and_exit_2(env, tmp_path, capsys):
    env.setenv(P.AUTHKEY_ENV, KEY)
    err = one_error(capsys, "--engine", TOY, "--model", "-", "--address", f"unix:{tmp_path}")
    assert "is a directory; give a socket path inside it" in err
    err = one_error(capsys, "--engine", TOY, "--model", "-", "--address", "localhost:5")
    assert "expected unix:/path/to/socket or tcp://HOST:PORT" in err
    (tmp_path / "file").write_text("x")
    env.setenv(P.AUTHKEY_ENV, KEY)
    err = one_error(capsys, "--engine", TOY, "--model", "-", "--address", f"unix:{tmp_path}/file")
    assert "exists and is not a socket" in err


def test_the_real_cli_prints_no_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "nemo_dapo.engines.server", "--engine", "local", "--model",
                        "/nonexistent", "--address", f"unix:{tmp_path}/e.sock"], capture_output=True, text=True,
                       env={**os.environ, P.AUTHKEY_ENV: KEY, "PYTHONPATH": ROOT}, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("error:") == 1, r.stderr


def test_an_engine_dependency_that_does_not_import_is_a_clean_engine_error(env, tmp_path, capsys):
    env.setenv(P.AUTHKEY_ENV, KEY)
    engine = "tests.engines.toy_engine:needs_missing_dependency"
    err = one_error(capsys, "--engine", engine, "--model", "-", "--address", f"unix:{tmp_path}/e.sock", code=3)
    assert f"engine {engine!r} cannot start: module 'nemo_dapo_missing_dependency' does not import" in err
    assert "ModuleNotFoundError" in err and "fix: install what" in err
    # the trainer that starts it gets an EngineError (nemo-dapo train: exit 4, rollout engine error) with that line
    proc = EngineProcess(engine=engine, model_dir="-", address=f"unix:{tmp_path}/t.sock",
                         log_path=str(tmp_path / "engine.log"), env={"PYTHONPATH": ROOT})
    try:
        with pytest.raises(EngineError, match="exited with code 3 before it accepted connections(.|\n)*"
                                              "module 'nemo_dapo_missing_dependency' does not import"):
            EngineClient(proc.address, process=proc, connect_timeout_s=120)
    finally:
        proc.stop()
    from nemo_dapo.cli import EXIT_ENGINE, _exit_code_and_message

    assert _exit_code_and_message("train", EngineError("x"))[0] == EXIT_ENGINE == 4
    assert "scripts/install.sh VENV engine-vllm" in engine_registry.install_hint("vllm")


def test_the_missing_python_message_names_install_modes_that_exist():
    with pytest.raises(EngineError) as e:
        EngineProcess(engine="local", model_dir="-", address="unix:/tmp/x.sock", python="/nonexistent/python")
    assert "engine-local" not in str(e.value) and "scripts/install.sh VENV core" in str(e.value)


@pytest.mark.skipif(os.geteuid() != 0, reason="a private /dev/shm (mount namespace) needs root")
def test_a_server_that_does_not_share_dev_shm_is_refused_at_connect_naming_the_setting_unless_refit_by_a_group(
        tmp_path):
    """What ENROOT_UNSHARE_IPC does, and what an engine on another node is: the shared-memory transport is refused at
    connect; the health probe and a trainer refitting over a process group (which need no /dev/shm) are served."""
    from nemo_dapo.engines.health import probe
    from nemo_dapo.engines.weight_group import update_over_group

    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare -m is not permitted here")
    d = private_dir(tmp_path)
    log = tmp_path / "engine.log"
    # what ENROOT_UNSHARE_IPC / --container-unshare=ipc does to a container: a /dev/shm of its own
    cmd = (f"mount -t tmpfs none /dev/shm && exec {sys.executable} -m nemo_dapo.engines.server --engine {TOY} "
           f"--model - --address unix:{d}/e.sock")
    proc = subprocess.Popen(["unshare", "-m", "sh", "-c", cmd], stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            env={**os.environ, P.AUTHKEY_ENV: KEY, "PYTHONPATH": ROOT})
    try:
        with pytest.raises(EngineError, match="cannot see the trainer's shared-memory block(.|\n)*"
                                              "ENROOT_UNSHARE_IPC.*--container-unshare=ipc"):
            EngineClient(f"unix:{d}/e.sock", authkey=KEY.encode(), connect_timeout_s=120)
        os.environ[P.AUTHKEY_ENV] = KEY
        try:
            assert probe(f"unix:{d}/e.sock", timeout_s=30)["weights_ok"] is True
        finally:
            del os.environ[P.AUTHKEY_ENV]
        client = EngineClient(f"unix:{d}/e.sock", authkey=KEY.encode(), connect_timeout_s=30,
                              check_shared_memory=False)
        try:
            stats, group = update_over_group([client], [[("w", torch.ones(4))]], host=client.local_host(),
                                             backend="gloo")
            group.close()
            assert stats["transport"] == "group" and client.health()["weights_ok"] is True
        finally:
            client.close()
    finally:
        proc.kill()
        proc.wait()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"nemo_dapo_{os.getpid()}_t_")]


def _cfg(tmp_path, *extra):
    from nemo_dapo.local.config import load_config

    return load_config("tiny_cpu", [f"run_dir={tmp_path / 'run'}", "rollout.engine=local",
                                    "rollout.server.connect_timeout_s=60", *extra])


def test_a_failed_or_killed_engine_start_leaves_no_socket_directory(tmp_path, monkeypatch):
    import tempfile

    from nemo_dapo.local import run_engine

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setattr(run_engine, "_save_hf", lambda model, tokenizer, directory: None)
    for name, body in [("fails", "exit 1"), ("killed", "kill -9 $$")]:
        python = tmp_path / name
        python.write_text(f"#!/bin/sh\n{body}\n")
        os.chmod(python, 0o755)
        os.makedirs(tmp_path / "run", exist_ok=True)
        with pytest.raises(EngineError, match="exited with code (1|-9) before it accepted"):
            run_engine.EngineRollouts(_cfg(tmp_path, f"rollout.server.python={python}"), None, None, None)
        assert [p for p in os.listdir(tmp) if p.startswith("nemo-dapo-")] == []


@pytest.mark.parametrize("kind", ["missing", "not executable", "a directory"])
def test_an_engine_python_that_cannot_run_is_named_before_anything_starts(kind, tmp_path):
    python = tmp_path / "python"
    if kind == "not executable":
        python.write_text("#!/bin/sh\n")  # mode 0644: no execute bit, for root too
    elif kind == "a directory":
        python.mkdir()
    match = "does not exist" if kind == "missing" else "is not an executable file"
    with pytest.raises(EngineError, match=f"python '{python}' {match}"):  # was "Permission denied", naming nothing
        EngineProcess(engine="local", model_dir=str(tmp_path), address=f"unix:{tmp_path}/e.sock", python=str(python))


def test_a_bad_server_address_is_a_config_error(tmp_path):
    from nemo_dapo.cli import EXIT_BAD_INPUT, _exit_code_and_message
    from nemo_dapo.local import run_engine

    with pytest.raises(ValueError, match="rollout.server.address: engine address 'localhost:5'") as e:
        run_engine.EngineRollouts(_cfg(tmp_path, "rollout.server.address=localhost:5"), None, None, None)
    code, line = _exit_code_and_message("train", e.value)
    assert code == EXIT_BAD_INPUT and "error: rollout.server.address" in line


def test_an_engine_that_refuses_its_arguments_exits_3_naming_why(env, tmp_path, capsys):
    env.setenv(P.AUTHKEY_ENV, KEY)
    engine = "tests.engines.toy_engine:refuses_to_start"
    err = one_error(capsys, "--engine", engine, "--model", "-", "--address", f"unix:{tmp_path}/e.sock", code=3)
    assert f"engine {engine!r} cannot start: need max_batch_size >= 1" in err


def test_the_engine_is_closed_when_its_address_cannot_be_listened_on(env, tmp_path, capsys):
    env.setenv(P.AUTHKEY_ENV, KEY)
    (tmp_path / "file").write_text("x")
    closed = ToyEngine.closed
    err = one_error(capsys, "--engine", TOY, "--model", "-", "--address", f"unix:{tmp_path}/file")
    assert "exists and is not a socket" in err and ToyEngine.closed == closed + 1  # built first, then let go


def test_a_directory_address_is_refused_before_the_engine_is_built(env, tmp_path, capsys):
    # a 32B engine takes minutes to load: a mistake visible from the arguments alone must not wait for it
    env.setenv(P.AUTHKEY_ENV, KEY)
    closed = ToyEngine.closed
    err = one_error(capsys, "--engine", TOY, "--model", "-", "--address", f"unix:{tmp_path}")
    assert "is a directory; give a socket path inside it" in err and ToyEngine.closed == closed


def test_the_key_is_not_left_in_the_environment_of_the_engine(env, tmp_path, capsys):
    env.setenv(P.AUTHKEY_ENV, KEY)
    seen = {}

    def make_engine(name, model_dir, options):  # where the engine (and the workers it starts) is built
        seen["key"] = os.environ.get(P.AUTHKEY_ENV)
        raise S.StartError("stop here", 3)
    env.setattr(S, "make_engine", make_engine)
    one_error(capsys, "--engine", TOY, "--model", "-", "--address", f"unix:{tmp_path}/e.sock", code=3)
    assert seen == {"key": None}


def test_a_server_shut_down_by_its_client_exits_0_and_removes_its_socket(tmp_path):
    d = private_dir(tmp_path)
    proc = EngineProcess(engine=TOY, model_dir="-", address=f"unix:{d}/e.sock", log_path=str(d / "e.log"),
                         env={"PYTHONPATH": ROOT})
    try:
        client = EngineClient(proc.address, process=proc, connect_timeout_s=120)
        assert os.path.exists(d / "e.sock")
        proc.stop(client)
        assert proc.poll() == 0 and not os.path.exists(d / "e.sock")
    finally:
        proc.stop()


def test_a_trainer_with_a_key_file_still_hands_its_server_one_key(tmp_path, monkeypatch):
    key_file = tmp_path / "key"
    key_file.write_text(KEY)
    os.chmod(key_file, 0o600)
    monkeypatch.setenv(P.AUTHKEY_FILE_ENV, str(key_file))  # the trainer's own key: never the server's second one
    d = private_dir(tmp_path)
    proc = EngineProcess(engine=TOY, model_dir="-", address=f"unix:{d}/e.sock", log_path=str(d / "e.log"),
                         env={"PYTHONPATH": ROOT})
    try:
        client = EngineClient(proc.address, process=proc, connect_timeout_s=120)
        assert client.health()["running"] == 0
        proc.stop(client)
    finally:
        proc.stop()
