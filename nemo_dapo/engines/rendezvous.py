"""The weight group's rendezvous: a key-value store of our own, served by the trainer, that torch's process groups
read through a ``torch.distributed.Store`` subclass.

Why not torch's ``TCPStore``: the group joins processes of two images with different torch releases (the trainer's
NGC PyTorch 24.07, torch 2.4; TensorRT-LLM 1.3.0rc1's, torch 2.9), and TCPStore's wire protocol is not compatible
across them: a 2.9 client sends PING right after connecting (PyTorch PR #129985), a 2.4 server drops the connection
on the unknown query, and the client retries until its time-out. Here both sides speak this module's protocol, and
each side's torch only sees a Store. ProcessGroupGloo / ProcessGroupNCCL use set / get / wait / add / check on it
during rendezvous (the gloo addresses, the NCCL unique id); torch 2.9's NCCL heartbeat thread also polls ``check``
about once a second in a process whose first NCCL group this is (its dump-on-timeout key).

Frames: 4-byte big-endian length, then a JSON object. Request ``{"op": ..., "key" | "keys", "value" (base64),
"amount", "expected", "desired", "timeout_s"}``; reply ``{"ok": true, ...}`` or ``{"error": message}``. ``get`` and
``wait`` block on the server until the keys exist or the request's time-out. The server bounds what a client may
send (frame size, keys, total bytes) and answers a malformed frame by closing that connection; it stays up.
"""
from __future__ import annotations

import base64
import json
import math
import socket
import struct
import threading
import time
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

MAX_FRAME = 1 << 20  # one request or reply (rendezvous values are addresses and ids: bytes to kilobytes)
MAX_KEYS = 65536  # keys held at once
MAX_BYTES = 64 << 20  # key and value bytes held at once
MAX_CONNECTIONS = 8192  # two per group rank, at most (a rank's store and its clone)
REPLY_S = 60.0  # a reply's deadline beyond the wait a request asks for: a host that stops answering fails the call
JOIN_CONNECT_S = 15.0  # an engine's connect: the trainer listens before it sends join_weights, so no answer by then
                       # means no trainer there (the group's own time-out, minutes, held the engine server that long)
_HEADER = struct.Struct(">I")


class RendezvousError(RuntimeError):
    """A store request failed: the time-out, a refused request, or the server gone."""


def _send(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 16))
        if not chunk:
            raise ConnectionError("the rendezvous connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket) -> dict:
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if n > MAX_FRAME:
        raise ValueError(f"a rendezvous frame of {n} bytes is over the {MAX_FRAME}-byte limit")
    obj = json.loads(_recv_exact(sock, n))
    if not isinstance(obj, dict):
        raise ValueError("a rendezvous frame must be a JSON object")
    return obj


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text) -> bytes:
    if not isinstance(text, str):
        raise ValueError("a value must be a base64 string")
    return base64.b64decode(text, validate=True)


def _key(msg: dict) -> str:
    key = msg.get("key")
    if not isinstance(key, str) or not key or len(key) > 4096:
        raise ValueError("a key must be a non-empty string of at most 4096 characters")
    return key


def _keys(msg: dict) -> list:
    keys = msg.get("keys")
    if not isinstance(keys, list) or len(keys) > 4096:
        raise ValueError("'keys' must be a list of at most 4096 keys")
    return [_key({"key": k}) for k in keys]


class RendezvousServer:
    """The store's server, in a thread of the process that makes it (the trainer), on ``host`` and a free port."""

    def __init__(self, host: str, *, max_wait_s: float = 3600.0):
        self._data: dict = {}
        self._bytes = 0
        self._cv = threading.Condition()
        self._closed = False
        self._max_wait_s = float(max_wait_s)
        self._conns: set = set()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(128)
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name="rendezvous-accept").start()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            conns, self._conns = list(self._conns), set()
        for s in [self._sock, *conns]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with self._cv:
                if self._closed or len(self._conns) >= MAX_CONNECTIONS:
                    conn.close()
                    continue
                self._conns.add(conn)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), daemon=True, name="rendezvous-conn").start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                try:
                    msg = _recv(conn)
                except (ConnectionError, OSError):
                    return
                try:
                    reply = {"ok": True, **self._handle(msg)}
                except (ValueError, TypeError, KeyError, RendezvousError) as e:
                    reply = {"error": f"{type(e).__name__}: {e}"[:500]}
                _send(conn, reply)
        except (ValueError, OSError):  # a malformed frame: this connection ends, the server stays
            return
        finally:
            with self._cv:
                self._conns.discard(conn)
            conn.close()

    def _wait_for(self, keys: list, timeout_s) -> None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 <= timeout_s < math.inf:
            raise ValueError("timeout_s must be a finite number >= 0")  # JSON may carry NaN and Infinity
        deadline = time.monotonic() + min(float(timeout_s), self._max_wait_s)
        while not all(k in self._data for k in keys):
            left = deadline - time.monotonic()
            if self._closed:
                raise RendezvousError("the rendezvous closed")
            if left <= 0:
                missing = [k for k in keys if k not in self._data]
                raise RendezvousError(f"keys not set within {timeout_s:.0f} s: {missing[:4]}")
            self._cv.wait(left)

    def _put(self, key: str, value: bytes) -> None:
        grown = len(key) + len(value) - (len(key) + len(self._data[key]) if key in self._data else 0)
        if key not in self._data and len(self._data) >= MAX_KEYS or self._bytes + grown > MAX_BYTES:
            raise RendezvousError(f"the rendezvous holds at most {MAX_KEYS} keys and {MAX_BYTES} bytes")
        self._data[key] = value
        self._bytes += grown
        self._cv.notify_all()

    def _handle(self, msg: dict) -> dict:
        op = msg.get("op")
        with self._cv:
            if op == "set":
                self._put(_key(msg), _unb64(msg.get("value")))
                return {}
            if op == "get":
                key = _key(msg)
                self._wait_for([key], msg.get("timeout_s"))
                return {"value": _b64(self._data[key])}
            if op == "wait":
                self._wait_for(_keys(msg), msg.get("timeout_s"))
                return {}
            if op == "check":
                return {"value": all(k in self._data for k in _keys(msg))}
            if op == "add":
                key, amount = _key(msg), msg.get("amount")
                if isinstance(amount, bool) or not isinstance(amount, int):
                    raise ValueError("'amount' must be an integer")
                value = int(self._data.get(key, b"0")) + amount
                self._put(key, str(value).encode())
                return {"value": value}
            if op == "compare_set":
                key, expected, desired = _key(msg), _unb64(msg.get("expected")), _unb64(msg.get("desired"))
                current = self._data.get(key)
                if (current is None and not expected) or current == expected:
                    self._put(key, desired)
                    return {"value": _b64(desired)}
                return {"value": _b64(expected if current is None else current)}
            if op == "delete":
                key = _key(msg)
                if key not in self._data:
                    return {"value": False}
                self._bytes -= len(key) + len(self._data.pop(key))
                return {"value": True}
            if op == "num_keys":
                return {"value": len(self._data)}
        raise ValueError(f"unknown op {op!r:.40}")


class RendezvousStore(dist.Store):
    """A client of a RendezvousServer as a ``torch.distributed.Store``; keep a reference to it for as long as a
    process group uses it (torch calls back into this Python object)."""

    def __init__(self, host: str, port: int, timeout_s: float, *, connect_timeout_s: Optional[float] = None):
        super().__init__()
        self.host, self.port, self.timeout_s = host, int(port), float(timeout_s)
        self._lock = threading.Lock()
        self._clones = []  # torch may clone from C++, which holds no reference to the Python object it gets
        deadline = time.monotonic() + (self.timeout_s if connect_timeout_s is None else connect_timeout_s)
        while True:  # the server may not listen yet
            try:
                self._sock = socket.create_connection((host, self.port), timeout=10.0)
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise RendezvousError(f"cannot reach the weight group's rendezvous at {host}:{port}: {e}") \
                        from None
                time.sleep(0.2)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _call(self, op: str, **fields):
        with self._lock:
            try:
                self._sock.settimeout(fields.get("timeout_s", 0.0) + REPLY_S)
                _send(self._sock, {"op": op, **fields})
                reply = _recv(self._sock)
            except (OSError, ValueError) as e:
                self._sock.close()  # a reply may still be in flight: this connection's framing is lost
                raise RendezvousError(f"the weight group's rendezvous at {self.host}:{self.port} failed during "
                                      f"{op}: {type(e).__name__}: {e}") from None
        if "error" in reply:
            raise RendezvousError(f"rendezvous {op}: {reply['error']}")
        return reply.get("value")

    @staticmethod
    def _bytes(value) -> bytes:
        return value.encode() if isinstance(value, str) else bytes(value)

    def set(self, key, value):
        self._call("set", key=key, value=_b64(self._bytes(value)))

    def get(self, key):
        return _unb64(self._call("get", key=key, timeout_s=self.timeout_s))

    def add(self, key, amount):
        return int(self._call("add", key=key, amount=int(amount)))

    def compare_set(self, key, expected, desired):
        return _unb64(self._call("compare_set", key=key, expected=_b64(self._bytes(expected)),
                                 desired=_b64(self._bytes(desired))))

    def check(self, keys):
        return bool(self._call("check", keys=list(keys)))

    def wait(self, keys, timeout=None):
        seconds = self.timeout_s if timeout is None else (
            timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout))
        self._call("wait", keys=list(keys), timeout_s=seconds)

    def delete_key(self, key):
        return bool(self._call("delete", key=key))

    def num_keys(self):
        return int(self._call("num_keys"))

    def set_timeout(self, timeout):
        self.timeout_s = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)

    def clone(self):
        twin = RendezvousStore(self.host, self.port, self.timeout_s)
        self._clones.append(twin)
        return twin

    def close(self) -> None:
        """Closes this connection and its clones' (the group that used them is done)."""
        for store in [self, *self._clones]:
            try:
                store._sock.close()
            except OSError:
                pass
