"""The rollout-engine protocol, version 2: framing, the key handshake and messages (shared memory: ``shm.py``).

Transport: a stream socket, Unix (``unix:/path``) or TCP (``tcp://127.0.0.1:P``). A frame is an 8-byte big-endian
length and that many bytes of one UTF-8 JSON object with a string ``op``: no pickles cross the boundary, so the two
sides may run different Python / torch versions (the engine lives in its own environment). A frame is at most
``MAX_FRAME_BYTES`` (both sides check it before they allocate); every read and write has a deadline.

Handshake (mutual, HMAC-SHA256 over fresh nonces; the key itself never crosses the wire):

    server -> {op: challenge, nonce}      or {op: busy, message} (another client is connected), then it closes
    client -> {op: auth, mac, nonce}       mac = HMAC(key, "client" + server nonce)
    server -> {op: welcome, mac}           mac = HMAC(key, "server" + client nonce); or {op: denied}, or {op: busy}
                                           (another client proved the key first), then it closes

The key comes from ``$NEMO_DAPO_ENGINE_AUTHKEY`` or from a chmod-600 file named by ``$NEMO_DAPO_ENGINE_AUTHKEY_FILE``
(``read_authkey``), never from a command line. A server refuses to start without one, except on a Unix socket whose
directory only its user can enter: nobody else can reach that socket (``keyless_problem``).

Client -> server after the handshake: every command carries ``cmd`` (a client-chosen int) and is answered by exactly
one ``{"op": "reply", "cmd": k, ...}`` or ``{"op": "error", "cmd": k, "type": ..., "message": ..., "name": ...}``
(a frame that is not a JSON object with an ``op`` gets an error with ``cmd`` null).

    hello            {version, shm_token}            -> {version, engine, info, shm_token, sleeping}; see
                                                        shm.ShmToken. info has sleep_releases {"1": [...], "2":
                                                        [...]} (what each sleep level frees, of "weights",
                                                        "kv_cache") and wake_tags; sleeping: a client before this
                                                        one left the engine asleep
    submit           {requests: [Request]}           -> {}   queued; completions follow as they finish
    abort            {ids: [str]}                    -> {aborted: n}; the aborted requests' completions follow
    update_weights   {shm, tensors: [WeightSpec], begins?} -> {loaded: n}; one bucket, read from shared memory
    join_weights     {address, rank, world_size, ...} -> {joining}; the collective transport (weight_group.py)
    update_weights   {via: "group", size, tensors, begins?} -> {receiving: n}; one bucket, broadcast by the trainer
    update_weights_done {}                           -> {}   post-process, reset caches; generation may resume;
                                                        refused after a refused bucket, or an update a client
                                                        before left unfinished, until an update begins again
                                                        (its first bucket has begins: true)
    sleep            {level: 1|2}                    -> {}   level 1 frees the KV cache, 2 the weights too
    wake             {tags?: ["weights"|"kv_cache"]} -> {}   without tags: everything asleep (then submit works);
                                                             with tags: only that part (hello info's wake_tags)
    health           {}                              -> {running, weights_ok, sleeping, uptime_s, engine,
                                                        weight_group}
    shutdown         {}                              -> {}   then the server exits

Server -> client, unprompted:

    completion       {id, samples: [{token_ids, logprobs, finish_reason}]}   one per finished request
    fatal            {message}                                               the engine died; the server exits

A ``WeightSpec`` is ``{name, dtype, shape, offset}``: the tensor is ``nbytes(dtype, shape)`` bytes at ``offset`` of the
POSIX shared-memory block ``shm`` (CPU; ``shm.py``). The first ``update_weights`` naming a block (with no tensors)
attaches it: the server maps it and removes its name at once, so the block's life never depends on the trainer's
clean-up (a killed trainer leaves nothing in /dev/shm). Buckets are sent one at a time and the client waits for the
reply before it reuses the block, so the extra memory is one bucket.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import math
import os
import secrets
import select
import socket
import stat
import struct
import threading
import time
from typing import Callable, Optional

import torch

PROTOCOL_VERSION = 2
AUTHKEY_ENV = "NEMO_DAPO_ENGINE_AUTHKEY"
AUTHKEY_FILE_ENV = "NEMO_DAPO_ENGINE_AUTHKEY_FILE"
MIN_KEY_BYTES = 16
# The largest frame either side sends or accepts. The largest real ones are a completion of n long samples (~26
# bytes a token: id and log-prob) and a submit of a generation batch: a few MB at the recipes' sizes.
MAX_FRAME_BYTES = 256 << 20
# A completion frame's bytes per generated token, at most: a 6-digit token id and a 17-digit log-prob in JSON take
# 31 (measured); a server refuses a request whose completion could pass MAX_FRAME_BYTES (n x its token cap).
COMPLETION_BYTES_PER_TOKEN = 32
MAX_COMPLETION_TOKENS = (MAX_FRAME_BYTES - (1 << 16)) // COMPLETION_BYTES_PER_TOKEN
HANDSHAKE_MAX_BYTES = 4096  # what an unauthenticated peer can make a server allocate
HANDSHAKE_TIMEOUT_S = 10.0  # a peer that has not proved the key within this is dropped
IO_TIMEOUT_S = 60.0  # a frame that has started must be fully read or written within this
_HEADER = struct.Struct("!Q")

_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                                      torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool)}


class ProtocolError(ValueError):
    """A frame or handshake message that does not follow this protocol."""


class FrameTooLarge(ProtocolError):
    """A length prefix over the limit: the stream cannot be resynchronised, the connection must close."""


class AuthenticationError(ConnectionError):
    """The peer does not hold the same key."""


class ServerBusy(ConnectionError):
    """The server is serving another client (it serves one at a time)."""


BUSY_MESSAGE = "the engine server is serving another client (it serves one at a time)"


class KeyConfigError(ValueError):
    """No usable key for this address, or a key source that is not private."""


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype {dtype} cannot be sent to an engine; use one of {sorted(_DTYPES)}")
    return name


def dtype_of(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r} in a weight spec; known: {sorted(_DTYPES)}")
    return _DTYPES[name]


def nbytes(dtype: torch.dtype, shape) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


# ---- keys ---------------------------------------------------------------------------------------------------------
_KEY_FIX = (f"set ${AUTHKEY_ENV} (e.g. export {AUTHKEY_ENV}=$(python -c 'import secrets; "
            f"print(secrets.token_hex(32))')) or ${AUTHKEY_FILE_ENV} to a chmod-600 file holding one, the same for "
            "the trainer and the engine")


def new_authkey() -> bytes:
    return secrets.token_hex(32).encode()


def read_authkey(environ=None) -> Optional[bytes]:
    """The engine key of this process: ``$NEMO_DAPO_ENGINE_AUTHKEY``, or the content of the file named by
    ``$NEMO_DAPO_ENGINE_AUTHKEY_FILE`` (refused unless only its owner can read it); None when neither is set."""
    env = os.environ if environ is None else environ
    value, path = env.get(AUTHKEY_ENV, ""), env.get(AUTHKEY_FILE_ENV, "")
    if value and path:
        raise KeyConfigError(f"both ${AUTHKEY_ENV} and ${AUTHKEY_FILE_ENV} are set: unset one of them")
    if not value and not path:
        return None
    key, source = (_read_key_file(path), f"the file {path!r}") if path else (value.encode(), f"${AUTHKEY_ENV}")
    if len(key) < MIN_KEY_BYTES:
        raise KeyConfigError(f"the engine key in {source} is {len(key)} bytes, need at least {MIN_KEY_BYTES}: "
                             + _KEY_FIX)
    return key


def _read_key_file(path: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise KeyConfigError(f"${AUTHKEY_FILE_ENV}={path!r}: cannot read it ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise KeyConfigError(f"${AUTHKEY_FILE_ENV}={path!r} is not a regular file")
        if st.st_mode & 0o077:
            raise KeyConfigError(f"${AUTHKEY_FILE_ENV}={path!r} can be read by group or others (mode "
                                 f"{stat.S_IMODE(st.st_mode):03o}): run chmod 600 {path}")
        return f.read(4096).strip()


def keyless_problem(address: str) -> Optional[str]:
    """None when a server on ``address`` is reachable by its user only (a Unix socket in a directory that no group or
    other user can enter), so it may run without a key; otherwise why not."""
    addr, family = parse_address(address)
    if family != socket.AF_UNIX:
        return "a TCP port can be reached by every user of the machine"
    directory = os.path.dirname(os.path.abspath(addr))
    try:
        st = os.stat(directory)
    except OSError as e:
        return f"cannot check the directory {directory!r} ({e.strerror})"
    if st.st_uid != os.geteuid() or st.st_mode & 0o011:
        return (f"the socket's directory {directory!r} can be entered by other users (mode "
                f"{stat.S_IMODE(st.st_mode):03o}, owner uid {st.st_uid}); chmod 700 it, or use a key")
    return None


def server_key_policy(address: str, key: Optional[bytes], allow_remote: bool) -> str:
    """Raise KeyConfigError unless a server may listen on ``address`` with ``key``; returns how it is protected."""
    addr, family = parse_address(address)
    if family != socket.AF_UNIX and not is_loopback(addr[0]):
        if not allow_remote:
            raise KeyConfigError(f"--address {address}: {addr[0]!r} is not a loopback address, so other machines "
                                 "could connect: listen on tcp://127.0.0.1:PORT or a unix: socket, or pass "
                                 "--allow-remote-clients (a key is required then)")
        if not key:
            raise KeyConfigError(f"--address {address} with --allow-remote-clients needs a key: " + _KEY_FIX)
    if key:
        return "key"
    why = keyless_problem(address)
    if why is None:
        return "no key: the socket's directory is private to this user"
    raise KeyConfigError(f"no engine key, and {why}: {_KEY_FIX} (a unix socket in a directory only you can enter, "
                         "chmod 700, may run without one)")


def _mac(key: Optional[bytes], role: str, nonce: str) -> str:
    # no version in it: a server of another protocol version passes the handshake and says so at hello
    return hmac.new(key or b"", f"nemo_dapo-engine/{role}/{nonce}".encode(), hashlib.sha256).hexdigest()


# ---- addresses ----------------------------------------------------------------------------------------------------
class AddressError(ValueError):
    pass


def parse_address(address: str):
    """'unix:/path' -> ('/path', AF_UNIX); 'tcp://HOST:PORT' -> ((HOST, PORT), AF_INET or AF_INET6 for [v6])."""
    if not isinstance(address, str):
        raise AddressError(f"engine address {address!r}: expected unix:/path/to/socket or tcp://HOST:PORT")
    if address.startswith("unix:") and len(address) > len("unix:"):
        return address[len("unix:"):], socket.AF_UNIX
    if address.startswith("tcp://"):
        host, _, port = address[len("tcp://"):].rpartition(":")
        if host and port.isdigit() and int(port) < 65536:
            if host.startswith("[") and host.endswith("]"):
                return (host[1:-1], int(port)), socket.AF_INET6
            return (host, int(port)), socket.AF_INET
    raise AddressError(f"engine address {address!r}: expected unix:/path/to/socket or tcp://HOST:PORT")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may name any interface


class Listener:
    """A listening socket for ``address``; a Unix socket file is created mode 0600 (only its user can connect)."""

    def __init__(self, address: str):
        addr, family = parse_address(address)
        self.address, self._path = address, addr if family == socket.AF_UNIX else None
        if self._path is not None:
            _free_unix_path(address, self._path)
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            if self._path is None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            old = os.umask(0o177)
            try:
                sock.bind(addr)
            finally:
                os.umask(old)
            sock.listen(16)
        except OSError as e:
            sock.close()
            raise AddressError(f"--address {address}: cannot listen there ({e.strerror or e})") from None
        sock.setblocking(False)
        self.sock = sock
        self._inode = os.stat(self._path).st_ino if self._path else None

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept(self, timeout_s: float) -> Optional[socket.socket]:
        """The next connection, or None when none arrives within ``timeout_s``."""
        if not _poll(self.sock, select.POLLIN, timeout_s):
            return None
        try:
            conn, _ = self.sock.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return None
        conn.setblocking(False)
        return conn

    def close(self) -> None:
        self.sock.close()
        if self._path is not None:
            try:
                if os.stat(self._path).st_ino == self._inode:
                    os.unlink(self._path)
            except OSError:
                pass


def _free_unix_path(address: str, path: str) -> None:
    """Refuse a path that is a directory, a file, or a live server's socket; remove a dead server's socket."""
    parent = os.path.dirname(os.path.abspath(path))
    if len(os.fsencode(path)) > 107:
        raise AddressError(f"--address {address}: a unix socket path must be at most 107 bytes; choose a shorter one")
    if not os.path.isdir(parent):
        raise AddressError(f"--address {address}: the directory {parent!r} does not exist; create it first")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        raise AddressError(f"--address {address}: {path!r} is a directory; give a socket path inside it, e.g. "
                           f"unix:{os.path.join(path, 'engine.sock')}")
    if not stat.S_ISSOCK(st.st_mode):
        raise AddressError(f"--address {address}: {path!r} exists and is not a socket; remove it or choose another")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # a socket nobody listens on: left by a server that died
        return
    except OSError:
        pass
    finally:
        probe.close()
    raise AddressError(f"--address {address}: another server is listening on {path!r}; stop it or choose another")


def connect_socket(address: str, timeout_s: float) -> socket.socket:
    addr, family = parse_address(address)
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(max(0.01, timeout_s))
    try:
        sock.connect(addr)
    except BaseException:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


# ---- framing with deadlines ---------------------------------------------------------------------------------------
def _poll(sock, events: int, timeout_s: float) -> bool:
    p = select.poll()
    p.register(sock, events | select.POLLERR | select.POLLHUP)
    return bool(p.poll(max(0.0, timeout_s) * 1000.0))


def encode(msg: dict) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode()


def decode(body) -> dict:
    """One frame's body -> its message; ProtocolError for anything but a UTF-8 JSON object with a string ``op``."""
    try:
        msg = json.loads(bytes(body).decode("utf-8"))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ProtocolError(f"a frame must be UTF-8 JSON ({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise ProtocolError(f"a frame must be a JSON object with a string 'op', got {type(msg).__name__}: "
                            f"{str(msg)[:120]}")
    return msg


class Channel:
    """One framed connection over a non-blocking socket; every read and write waits until a deadline at most.
    Sends are serialised (a lock); one thread reads."""

    def __init__(self, sock: socket.socket, max_frame: int = MAX_FRAME_BYTES):
        sock.setblocking(False)
        self.sock, self.max_frame = sock, max_frame
        self._send_lock = threading.Lock()

    def fileno(self) -> int:
        return self.sock.fileno()

    def readable(self, timeout_s: float) -> bool:
        return _poll(self.sock, select.POLLIN, timeout_s)

    def recv(self, timeout_s: float = IO_TIMEOUT_S) -> dict:
        return decode(self.read_frame(timeout_s))

    def read_frame(self, timeout_s: float = IO_TIMEOUT_S) -> bytearray:
        """One frame's body, all of it within ``timeout_s`` (TimeoutError otherwise; EOFError when the peer closed)."""
        deadline = time.monotonic() + timeout_s
        (size,) = _HEADER.unpack(self._recv_exact(_HEADER.size, deadline))
        if size > self.max_frame:
            raise FrameTooLarge(f"a frame of {size} bytes is over the limit of {self.max_frame} bytes")
        return self._recv_exact(size, deadline)

    def _recv_exact(self, n: int, deadline: float) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            try:
                k = self.sock.recv_into(view[got:])
            except (BlockingIOError, InterruptedError):
                self._wait(select.POLLIN, deadline, "read")
                continue
            if k == 0:
                raise EOFError("the peer closed the connection")
            got += k
        return buf

    def send(self, msg: dict, timeout_s: float = IO_TIMEOUT_S) -> None:
        body = encode(msg)
        if len(body) > MAX_FRAME_BYTES:
            raise FrameTooLarge(f"a {msg.get('op')!r} frame of {len(body)} bytes is over the protocol's limit of "
                                f"{MAX_FRAME_BYTES} bytes (protocol.MAX_FRAME_BYTES); send fewer requests at once")
        deadline = time.monotonic() + timeout_s
        with self._send_lock:
            self._send_all(_HEADER.pack(len(body)) + body, deadline)

    def _send_all(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[self.sock.send(view):]
            except (BlockingIOError, InterruptedError):
                self._wait(select.POLLOUT, deadline, "write")

    def _wait(self, events: int, deadline: float, what: str) -> None:
        if not _poll(self.sock, events, deadline - time.monotonic()):
            raise TimeoutError(f"the peer did not let us {what} a frame before the deadline")

    def close(self) -> None:
        """Ends the stream for both sides at once (a reader blocked on this socket in another thread wakes up)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


# ---- the handshake ------------------------------------------------------------------------------------------------
def _field(msg: dict, name: str) -> str:
    value = msg.get(name)
    if not isinstance(value, str) or not 0 < len(value) <= 128:
        raise ProtocolError(f"handshake message {msg.get('op')!r} lacks a valid {name!r}")
    return value


def server_handshake(sock: socket.socket, key: Optional[bytes], timeout_s: float = HANDSHAKE_TIMEOUT_S,
                     admit: Callable[[], bool] = lambda: True) -> Channel:
    """Authenticate a new connection within ``timeout_s``; returns its Channel or raises (the caller closes it).
    ``admit()``, asked once the key is proven: False answers ``busy`` instead of ``welcome`` and raises ServerBusy
    (two clients that prove the key at the same moment: one is served, the other told at once)."""
    ch, deadline = Channel(sock, HANDSHAKE_MAX_BYTES), time.monotonic() + timeout_s
    nonce = secrets.token_hex(32)
    ch.send({"op": "challenge", "nonce": nonce}, timeout_s)
    msg = ch.recv(deadline - time.monotonic())
    if msg["op"] != "auth":
        raise ProtocolError(f"expected the 'auth' answer to the challenge, got {msg['op']!r}")
    if not hmac.compare_digest(_field(msg, "mac"), _mac(key, "client", nonce)):
        ch.send({"op": "denied", "message": "wrong engine key"}, max(0.1, deadline - time.monotonic()))
        raise AuthenticationError("the client does not hold the engine key")
    if not admit():
        ch.send({"op": "busy", "message": BUSY_MESSAGE}, max(0.1, deadline - time.monotonic()))
        raise ServerBusy("another client was admitted first")
    ch.send({"op": "welcome", "mac": _mac(key, "server", _field(msg, "nonce"))}, deadline - time.monotonic())
    ch.max_frame = MAX_FRAME_BYTES
    return ch


def client_handshake(sock: socket.socket, key: Optional[bytes], timeout_s: float) -> Channel:
    """Prove the key to the server and check that it holds it too; ServerBusy when it serves another client."""
    ch, deadline = Channel(sock, HANDSHAKE_MAX_BYTES), time.monotonic() + timeout_s
    msg = ch.recv(timeout_s)
    if msg["op"] == "busy":
        raise ServerBusy(str(msg.get("message", "the engine server is serving another client")))
    if msg["op"] != "challenge":
        raise ProtocolError(f"expected the server's challenge, got {msg['op']!r}")
    nonce = secrets.token_hex(32)
    ch.send({"op": "auth", "mac": _mac(key, "client", _field(msg, "nonce")), "nonce": nonce},
            deadline - time.monotonic())
    reply = ch.recv(deadline - time.monotonic())
    if reply["op"] == "denied":
        raise AuthenticationError("the server refused our engine key")
    if reply["op"] == "busy":
        raise ServerBusy(str(reply.get("message", BUSY_MESSAGE)))
    if reply["op"] != "welcome" or not hmac.compare_digest(_field(reply, "mac"), _mac(key, "server", nonce)):
        raise AuthenticationError("the server did not prove that it holds our engine key")
    ch.max_frame = MAX_FRAME_BYTES
    return ch


def send_busy(sock: socket.socket) -> None:
    """Tell a connection that arrived while another client is served to come back later, then close it."""
    try:
        Channel(sock).send({"op": "busy", "message": BUSY_MESSAGE}, 0.2)
    except (OSError, ValueError):
        pass
    finally:
        sock.close()
