"""Trainer side of the rollout-engine protocol: a connection (``EngineClient``), a server process (``EngineProcess``).

``EngineClient`` sends commands from the caller's thread and reads every frame on a reader thread, which routes
replies to the waiting command and completions into a queue. Every wait has a time-out, and a dead connection
(engine killed, crashed, or unreachable) wakes all waiters with an :class:`EngineError` that names the engine and
says what to do: the trainer never hangs on an engine.
"""
from __future__ import annotations

import itertools
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from typing import Iterable, Optional, Sequence

from nemo_dapo.engines import protocol as P
from nemo_dapo.engines import shm as S
from nemo_dapo.engines.base import Completion, EngineError, EngineWeightError, Request

log = logging.getLogger("nemo_dapo")


class EngineDied(EngineError):
    """The engine's connection dropped (process killed or crashed)."""


class EngineBusy(EngineError):
    """The engine server is serving another client (it serves one at a time)."""


class EngineRefused(EngineError):
    """The server refuses this client (key, permissions, protocol): retrying does not help."""


class EngineClient:
    """One connection to one engine server.

    connect_timeout_s: the longest time to connect, authenticate and say hello (an engine may take minutes to load;
    it listens once loaded); request_timeout_s: the longest wait for a command's reply or for the next completion.
    weight_timeout_s: the longest wait for the reply to a weight or memory command (sleep, wake, each bucket of a
    weight update, its end) and for a weight group's broadcast: short, since a trainer's other ranks wait meanwhile in
    the refit's collectives, which NCCL's watchdog ends at their own time-out (30 min under NeMo), unexplained.
    authkey: the engine key; None = the key of ``process`` (a server we started), else ``protocol.read_authkey()``
    (``$NEMO_DAPO_ENGINE_AUTHKEY`` or ``$NEMO_DAPO_ENGINE_AUTHKEY_FILE``). wait_if_busy: a server that serves another
    client is retried until the connect time-out (False: EngineBusy at once). check_shared_memory: prove at hello that
    the server sees this process's /dev/shm (the weight updates need it).
    """

    def __init__(self, address: str, *, authkey: Optional[bytes] = None, name: str = "engine",
                 connect_timeout_s: float = 120.0, request_timeout_s: float = 600.0,
                 weight_timeout_s: float = 300.0, process: Optional["EngineProcess"] = None,
                 wait_if_busy: bool = True, check_shared_memory: bool = True):
        self.address, self.name, self.request_timeout_s = address, name, request_timeout_s
        self.weight_timeout_s = weight_timeout_s
        self.process, self.wait_if_busy = process, wait_if_busy
        P.parse_address(address)  # AddressError (a ValueError) for a malformed one
        deadline = time.monotonic() + connect_timeout_s
        key = self._key(authkey)
        self._ch = self._connect(key, deadline, connect_timeout_s)
        self._cmd = itertools.count(1)
        self._replies: dict = {}
        self._cv = threading.Condition()
        self.completions: "queue.Queue" = queue.Queue()
        self._dead: Optional[str] = None
        self._outstanding, self._idle_since, self._idle_s = 0, time.perf_counter(), 0.0
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"{name}-reader")
        self._reader.start()
        try:
            hello = self._hello(check_shared_memory, max(0.5, deadline - time.monotonic()))
        except BaseException:
            self.close()
            raise
        self.engine, self.info = hello.get("engine", name), hello.get("info", {})
        self.asleep_at_connect = hello.get("sleeping") is True  # left asleep by a client before (killed mid-step)

    def _key(self, authkey: Optional[bytes]) -> Optional[bytes]:
        if authkey is None and self.process is not None:
            authkey = self.process.authkey
        if authkey is None:
            try:
                authkey = P.read_authkey()
            except P.KeyConfigError as e:
                raise EngineRefused(f"engine {self.name!r}: {e}") from None
        if not authkey:
            why = P.keyless_problem(self.address)
            if why is not None:
                raise EngineRefused(f"engine {self.name!r} at {self.address}: no engine key, and {why}: set "
                                  f"${P.AUTHKEY_ENV} (or ${P.AUTHKEY_FILE_ENV}) to the engine server's key")
        return authkey

    def _hello(self, check_shared_memory: bool, timeout_s: float) -> dict:
        token = S.ShmToken() if check_shared_memory else None
        try:
            hello = self.call("hello", version=P.PROTOCOL_VERSION, shm_token=token and token.name,
                              timeout_s=timeout_s)
        finally:
            if token is not None:
                token.close()
        if hello.get("version") != P.PROTOCOL_VERSION:
            raise EngineError(f"engine {self.name!r} at {self.address} speaks protocol {hello.get('version')}, this "
                              f"trainer {P.PROTOCOL_VERSION}: install the same nemo_dapo in both environments")
        if token is not None and not token.matches(hello.get("shm_token")):
            raise EngineError(f"engine {self.name!r} at {self.address} did not read back the shared-memory token "
                              f"/dev/shm/{token.name}: {S.IPC_HINT}")
        return hello

    def _connect(self, key: Optional[bytes], deadline: float, timeout_s: float) -> P.Channel:
        """Connect and authenticate by ``deadline``; a missing, refusing or busy server is retried until then."""
        last: Optional[BaseException] = None
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise EngineError(f"engine {self.name!r} exited with code {self.process.poll()} before it accepted "
                                  f"connections; its log: {self.process.log_path}\n{self.process.log_tail()}")
            try:
                sock = P.connect_socket(self.address, min(5.0, deadline - time.monotonic()))
                try:
                    return P.client_handshake(sock, key, max(0.01, deadline - time.monotonic()))
                except BaseException:
                    sock.close()
                    raise
            except P.ServerBusy as e:
                if not self.wait_if_busy:
                    raise EngineBusy(f"engine {self.name!r} at {self.address} is busy: {e}") from None
                last = e
            except P.AuthenticationError as e:
                raise EngineRefused(f"engine {self.name!r} at {self.address}: {e}: give the trainer and the engine the "
                                  f"same key (${P.AUTHKEY_ENV} or ${P.AUTHKEY_FILE_ENV})") from None
            except PermissionError as e:
                raise EngineRefused(f"engine {self.name!r} at {self.address}: permission denied ({e.strerror}): the "
                                  "socket belongs to another user") from None
            except P.ProtocolError as e:
                raise EngineRefused(f"engine {self.name!r} at {self.address} does not speak the nemo_dapo engine "
                                  f"protocol {P.PROTOCOL_VERSION} ({e}); is it an older nemo_dapo?") from None
            except (OSError, EOFError) as e:  # absent, refused, reset, timed out: retried until the deadline
                last = e
            if time.monotonic() >= deadline:
                raise EngineError(f"engine {self.name!r} not reachable at {self.address} after {timeout_s:.0f} s "
                                  f"({last!r}): start it (python -m nemo_dapo.engines.server ...) or raise the "
                                  "connect time-out")
            time.sleep(max(0.0, min(0.2, deadline - time.monotonic())))

    # ---- the reader thread ----------------------------------------------------------------------------------------
    def _read(self) -> None:
        try:
            while self._dead is None:
                if not self._ch.readable(0.5):
                    continue
                msg = self._ch.recv(P.IO_TIMEOUT_S)
                op = msg["op"]
                if op == "completion":
                    self._in_flight(-1)
                    self.completions.put(Completion.from_wire(msg))
                elif op in ("reply", "error"):
                    with self._cv:
                        self._replies[msg.get("cmd")] = msg
                        self._cv.notify_all()
                elif op == "fatal":
                    self._die(f"engine {self.name!r} failed: {msg.get('message')}")
                    return
        except (EOFError, OSError, ValueError) as e:
            self._die(f"connection to engine {self.name!r} at {self.address} lost ({e!r}): the engine process "
                      "died or was killed")
        except (KeyError, TypeError, AttributeError) as e:  # waits would end only at their time-outs, as "stuck"
            self._die(f"engine {self.name!r} at {self.address} sent a message this client cannot read ({e!r}): "
                      "install the same nemo_dapo version in the trainer's and the engine's environments")

    def _die(self, why: str) -> None:
        with self._cv:
            if self._dead is None:
                self._dead = why + self._process_note()
            self._cv.notify_all()
        self.completions.put(None)  # wakes a waiting next_completion()

    def _process_note(self) -> str:
        if self.process is None:
            return ""
        code = self.process.wait(timeout_s=2.0)  # the socket closes a moment before the process is reaped
        return (f" (exit code {code}; log {self.process.log_path})" if code is not None
                else f" (log {self.process.log_path})")

    # ---- commands -------------------------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._dead is None

    def _check(self) -> None:
        if self._dead is not None:
            raise EngineDied(self._dead)

    def local_host(self) -> str:
        """This end's IP address on the connection to the engine (127.0.0.1 over a unix socket): where the engine's
        host reaches this process, e.g. a weight group's rendezvous (weight_group.py)."""
        name = self._ch.sock.getsockname()
        return name[0] if isinstance(name, tuple) else "127.0.0.1"

    def raise_if_dead(self) -> None:
        """EngineDied when the connection is gone (the server died, was killed, or this client was closed)."""
        self._check()

    def call(self, op: str, *, timeout_s: Optional[float] = None, **fields) -> dict:
        """Send one command and wait for its reply; an ``error`` reply raises (EngineWeightError for weights)."""
        return self.reply(self.send(op, timeout_s=timeout_s, **fields), op, timeout_s=timeout_s)

    def send(self, op: str, *, timeout_s: Optional[float] = None, **fields) -> int:
        """Send one command without waiting; returns its number for :meth:`reply` (commands to several servers
        can then be in flight together, as a collective weight update needs)."""
        self._check()
        cmd = next(self._cmd)
        timeout = self.request_timeout_s if timeout_s is None else timeout_s
        try:
            self._ch.send({"op": op, "cmd": cmd, **fields}, timeout)
        except P.FrameTooLarge as e:  # refused before a byte was sent: the connection is intact
            raise EngineError(f"engine {self.name!r}: {e}") from None
        except (OSError, ValueError) as e:
            self._die(f"cannot send {op!r} to engine {self.name!r} ({e!r})")
            self._check()
        return cmd

    def reply(self, cmd: int, op: str, *, timeout_s: Optional[float] = None) -> dict:
        """Wait for the reply to command ``cmd`` (an ``op``); an ``error`` reply raises."""
        timeout = self.request_timeout_s if timeout_s is None else timeout_s
        with self._cv:
            ok = self._cv.wait_for(lambda: cmd in self._replies or self._dead is not None, timeout=timeout)
            msg = self._replies.pop(cmd, None)
        if msg is None:
            self._check()
            if not ok:
                raise EngineError(f"engine {self.name!r} did not answer {op!r} within {timeout:.0f} s: it is stuck "
                                  "or overloaded; raise the request time-out or check its log")
        if msg["op"] == "error":
            text = f"engine {self.name!r} refused {op!r}: {msg.get('message')}"
            if msg.get("type") == "weight":
                raise EngineWeightError(text, msg.get("name", ""))
            raise EngineError(text)
        return msg

    def submit(self, requests: Sequence[Request]) -> None:
        self._in_flight(len(requests))  # before the send: a completion may come back before the reply
        try:
            self.call("submit", requests=[r.to_wire() for r in requests])
        except EngineError:  # a refused submit runs none of them (all or nothing): no completion will come
            self._in_flight(-len(requests))
            raise

    def _in_flight(self, delta: int) -> None:
        """Requests submitted and not yet completed (each submitted request completes once, aborted ones too)."""
        with self._cv:
            now = time.perf_counter()
            if self._outstanding == 0 and delta > 0:
                self._idle_s += now - self._idle_since
            self._outstanding = max(self._outstanding + delta, 0)
            if self._outstanding == 0:
                self._idle_since = now

    def idle_seconds(self) -> float:
        """Wall seconds since connecting with no request of this client in flight: the engine had nothing to
        generate (weight updates and sleep count as idle)."""
        with self._cv:
            extra = time.perf_counter() - self._idle_since if self._outstanding == 0 else 0.0
            return self._idle_s + extra

    def next_completion(self, timeout_s: Optional[float] = None) -> Completion:
        """The next finished request (any order); raises EngineError on a time-out or a dead engine."""
        self._check()
        timeout = self.request_timeout_s if timeout_s is None else timeout_s
        try:
            c = self.completions.get(timeout=timeout)
        except queue.Empty:
            raise EngineError(f"engine {self.name!r} produced no completion in {timeout:.0f} s: it is stuck or the "
                              "request time-out is too short for the generation length") from None
        if c is None:
            self.completions.put(None)
            self._check()
        return c

    def abort(self, ids: Sequence[str]) -> int:
        return int(self.call("abort", ids=list(ids)).get("aborted", 0))

    def update_weights(self, buckets: Iterable[list]) -> dict:
        """Send (name, tensor) buckets one by one through one shared-memory block, then ``update_weights_done``.

        Extra memory: one block of the largest bucket. A new block is attached (the server maps it and removes its
        name) before it is filled, so a trainer killed mid-update leaves nothing in /dev/shm. A failure part-way
        raises; the engine then refuses to generate until a whole update succeeds."""
        buffer = S.WeightBuffer()
        stats = {"buckets": 0, "tensors": 0, "bytes": 0, "seconds": 0.0, "transport": "shm"}
        t0 = time.perf_counter()
        try:
            for bucket in buckets:
                bucket = list(bucket)
                specs, size = S.weight_layout(bucket)
                fresh = buffer.reserve(size)
                if fresh is not None:
                    self.call("update_weights", shm=fresh, tensors=[], timeout_s=self.weight_timeout_s)
                buffer.fill(bucket, specs)
                self.call("update_weights", shm=buffer.name, tensors=specs, begins=not stats["buckets"],
                          timeout_s=self.weight_timeout_s)
                stats["buckets"] += 1
                stats["tensors"] += len(specs)
                stats["bytes"] += sum(P.nbytes(P.dtype_of(s["dtype"]), s["shape"]) for s in specs)
            self.call("update_weights_done", timeout_s=self.weight_timeout_s)
            stats["buffer_bytes"] = buffer.size
        finally:
            buffer.close()
        stats["seconds"] = time.perf_counter() - t0
        return stats

    def sleep(self, level: int = 1) -> None:
        self.call("sleep", level=level, timeout_s=self.weight_timeout_s)

    def wake(self, tags: Optional[Sequence[str]] = None) -> None:
        """Wake what ``sleep`` released; ``tags`` (the server's ``info["wake_tags"]``): only those parts."""
        fields = {} if tags is None else {"tags": list(tags)}
        self.call("wake", timeout_s=self.weight_timeout_s, **fields)

    def health(self, timeout_s: Optional[float] = None) -> dict:
        return self.call("health", timeout_s=min(30.0, self.request_timeout_s) if timeout_s is None else timeout_s)

    def shutdown(self) -> None:
        if self.alive:
            try:
                self.call("shutdown", timeout_s=10.0)
            except EngineError:
                pass
        self.close()

    def close(self) -> None:
        """End the session so that the SERVER sees it at once (it serves one client at a time): the stream is shut
        down for both sides, which also wakes the reader thread; the socket is closed once that thread is done."""
        with self._cv:
            if self._dead is None:
                self._dead = f"the client of engine {self.name!r} was closed"
            self._cv.notify_all()
        self.completions.put(None)  # wakes a waiting next_completion()
        try:
            self._ch.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if self._reader is not threading.current_thread():
            self._reader.join(timeout=2.0)
        self._ch.sock.close()


class EngineProcess:
    """Starts ``python -m nemo_dapo.engines.server`` (possibly another environment's python) and owns it.

    The server gets a fresh random key (or ``authkey``, or ``env``'s ``$NEMO_DAPO_ENGINE_AUTHKEY``) in its
    environment, never on its command line (``ps`` shows arguments); a client given ``process=`` uses it. The server
    exits with its parent (``--parent-pid``); ``stop()`` shuts it down, then terminates it."""

    def __init__(self, *, engine: str, model_dir: str, address: str, python: Optional[str] = None,
                 options: Optional[dict] = None, log_path: Optional[str] = None, threads: Optional[int] = 1,
                 env: Optional[dict] = None, authkey: Optional[bytes] = None, cpus: Optional[list] = None):
        import json

        from nemo_dapo.core.engine_registry import install_hint

        self.engine, self.address = engine, address
        self.python = python or sys.executable
        if not os.path.exists(self.python):
            raise EngineError(f"engine {engine!r}: python {self.python!r} does not exist; {install_hint(engine)}, "
                              "or fix the python path")
        if os.path.isdir(self.python) or not os.access(self.python, os.X_OK):
            raise EngineError(f"engine {engine!r}: python {self.python!r} is not an executable file; give the "
                              "engine environment's interpreter (e.g. .venv-vllm/bin/python)")
        addr, family = P.parse_address(address)
        cmd = [self.python, "-m", "nemo_dapo.engines.server", "--engine", engine, "--model", model_dir,
               "--address", address, "--parent-pid", str(os.getpid())]
        if threads:
            cmd += ["--threads", str(threads)]
        if cpus:
            cmd += ["--cpus", ",".join(str(int(c)) for c in cpus)]
        for k, v in (options or {}).items():
            cmd += ["--option", f"{k}={json.dumps(v)}"]
        self.log_path = log_path or os.path.join(os.path.dirname(addr) if family == socket.AF_UNIX else ".",
                                                 f"engine-{engine}.log")
        given = (env or {}).get(P.AUTHKEY_ENV)
        self.authkey = authkey or (os.fsencode(given) if given else P.new_authkey())
        run_env = {**os.environ, **(env or {}), P.AUTHKEY_ENV: os.fsdecode(self.authkey)}
        run_env.pop(P.AUTHKEY_FILE_ENV, None)
        run_env.setdefault("OMP_NUM_THREADS", str(threads or 1))
        self._log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=run_env,
                                         start_new_session=True)
        except BaseException:
            self._log.close()
            raise
        log.info("started engine %s (pid %d) on %s; log %s", engine, self.proc.pid, address, self.log_path)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> Optional[int]:
        return self.proc.poll()

    def wait(self, timeout_s: float) -> Optional[int]:
        """Exit code, or None if still running after ``timeout_s``."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"".join(f.readlines()[-lines:]).decode(errors="replace")
        except OSError:
            return ""

    def stop(self, client: Optional[EngineClient] = None, timeout_s: float = 15.0) -> None:
        if client is not None:
            client.shutdown()
        try:
            self.proc.wait(timeout=timeout_s if client is not None else 0.1)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()
