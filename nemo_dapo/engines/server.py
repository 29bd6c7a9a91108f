"""The rollout-engine server: one engine adapter behind the protocol of ``protocol.py``, in its own process.

    python -m nemo_dapo.engines.server --engine local|vllm|trtllm --model HF_DIR --address unix:/tmp/engine.sock \
        [--options-file FILE] [--option key=value ...] [--parent-pid PID] [--threads N] [--cpus 0,2-3] \
        [--allow-remote-clients] [--handshake-timeout-s S] [--max-samples-in-flight N]

One thread does everything: it reads a command when one is waiting, otherwise advances the engine (``adapter.step``)
and streams each finished request back as a ``completion``. One client at a time (the trainer rank that owns this
engine); a connection that arrives meanwhile is told ``busy`` and closed; when the client disconnects, its requests are
aborted and the server waits for the next. Between clients each new connection proves the key in a thread of its own
(at most ``MAX_HANDSHAKES`` at once), so peers that never answer hold up no one; of those that prove it together, the
first is welcomed and the others told ``busy``. A connection that fails the handshake (no key, wrong key, silence past
``--handshake-timeout-s``), a malformed frame or a refused request never stops the server.

The key (``protocol.read_authkey``): ``$NEMO_DAPO_ENGINE_AUTHKEY``, or a chmod-600 file named by
``$NEMO_DAPO_ENGINE_AUTHKEY_FILE``; never an argument. Without one the server starts only on a Unix socket whose
directory only its user can enter. A TCP address that is not loopback needs ``--allow-remote-clients`` and a key.

Safety rules: weights are only updated while no request runs (the client drains or aborts first), NaN / inf weights
are refused, and after an update that did not reach ``update_weights_done`` the server refuses to generate: it never
samples from mixed weights.

Exit codes: 0 shut down by its client; 1 the engine failed while serving; 2 a bad argument, address or key; 3 the
engine could not be built (a dependency that does not import, or its constructor refused). 2 and 3 print one
``error:`` line.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import select
import socket
import sys
import threading
import time
from typing import Optional

from nemo_dapo.core import engine_registry
from nemo_dapo.core.affinity import cpu_set_problem, parse_cpu_list, pin_cpus
from nemo_dapo.engines import protocol as P
from nemo_dapo.engines import shm as S
from nemo_dapo.engines import weight_group as WG
from nemo_dapo.engines.base import WAKE_TAGS, EngineError, EngineWeightError, Request, check_finite, check_token_ids

log = logging.getLogger("nemo_dapo.engine")

MAX_HANDSHAKES = 64  # connections proving the key at once; more are closed at once (the client retries)
MAX_SAMPLES_IN_FLIGHT = 65536  # samples queued or running at once (the recipes hold at most a few thousand)


class StartError(Exception):
    """The server cannot start; ``code`` is its exit code (2 bad input, 3 engine not buildable)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def make_engine(name: str, model_dir: str, options: dict):
    """``name``: a served engine of ``nemo_dapo.core.engine_registry``, or ``package.module:factory`` for an engine
    of your own."""
    served = engine_registry.is_served(name)
    if not served and ":" not in name:
        raise StartError(f"--engine {name!r}: unknown; choose one of {sorted(engine_registry.served_engines())} or "
                         "give module:factory", 2)
    if served and not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise StartError(f"--model {model_dir!r}: not a Hugging Face checkpoint directory (no config.json in it); "
                         "give the directory that save_pretrained wrote", 2)
    try:
        factory = engine_registry.load(engine_registry.ENGINES[name].adapter if served else name)
    except ImportError as e:
        raise _import_failed(name, e) from None
    except AttributeError as e:
        raise StartError(f"--engine {name!r}: {e}", 2) from None
    try:
        return factory(model_dir, **options)
    except ImportError as e:  # ModuleNotFoundError too: a dependency the engine imports when it starts
        raise _import_failed(name, e) from None
    except TypeError as e:
        if "unexpected keyword argument" not in str(e):
            raise
        raise StartError(f"--option: engine {name!r} does not take that option ({e})", 2) from None
    except (EngineError, ValueError) as e:
        raise StartError(f"engine {name!r} cannot start: {e}", 3) from None


def _import_failed(name: str, e: ImportError) -> StartError:
    return StartError(f"engine {name!r} cannot start: module {e.name or '?'!r} does not import "
                      f"({type(e).__name__}: {e}); fix: {engine_registry.install_hint(name)}", 3)


class EngineServer:
    def __init__(self, adapter, listener: P.Listener, *, name: Optional[str] = None, authkey: Optional[bytes] = None,
                 handshake_timeout_s: float = P.HANDSHAKE_TIMEOUT_S,
                 max_samples_in_flight: int = MAX_SAMPLES_IN_FLIGHT):
        self.adapter, self.listener, self.authkey = adapter, listener, authkey
        self.name = name or getattr(adapter, "name", "engine")
        self.handshake_timeout_s, self.max_samples_in_flight = handshake_timeout_s, max_samples_in_flight
        info = adapter.info()
        self.vocab_size, self.max_seq_len = info.get("vocab_size"), info.get("max_seq_len")
        # the NCCL release of an engine whose GPU workers can join an nccl weight group (weight_group.py)
        self.nccl = WG.nccl_version() if hasattr(adapter, "join_weight_group") else None
        self.inflight: dict = {}  # request id -> its sample count
        self.weights_ok = True
        # why the current update cannot be declared done (a bucket refused, named by its first tensor, or a client
        # that left it unfinished): update_weights_done is refused until an update begins again (a bucket with
        # "begins" that is accepted), since the engine may hold part old, part new weights
        self._refused: Optional[str] = None
        self.sleeping = False
        self.started = time.time()
        self._buffer: Optional[S.AttachedBuffer] = None
        self._group = WG.ServerSide(self.adapter)
        self._then = None  # a collective to enter once the reply is sent (join_weights, update_weights via group)
        self._authenticated: "queue.Queue[P.Channel]" = queue.Queue()  # by the handshake threads, in their order
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._admission = threading.Lock()
        self._admitted = False  # a client proved the key and is (about to be) served: the others are told busy
        self._stop = False

    # ---- sessions -------------------------------------------------------------------------------------------------
    def serve(self) -> int:
        while not self._stop:
            ch = self._accept()
            if ch is None:
                continue
            try:
                self._session(ch)
            except _Fatal as e:
                log.error("engine %s failed: %s", self.name, e)
                return 1
            except (EOFError, OSError, P.ProtocolError) as e:
                log.info("client disconnected (%s)", e or type(e).__name__)
            finally:
                self._end_session(ch)
        return 0

    def _accept(self) -> Optional[P.Channel]:
        """The next authenticated client, or None (none within a moment). New connections are handed to handshake
        threads; one that fails the handshake is logged and closed there, and the server goes on."""
        sock = self.listener.accept(0.05)
        for _ in range(MAX_HANDSHAKES):
            if sock is None:
                break
            self._start_handshake(sock)
            sock = self.listener.accept(0)
        try:
            return self._authenticated.get(timeout=0.05)
        except queue.Empty:
            return None

    def _start_handshake(self, sock: socket.socket) -> None:
        if not self._handshakes.acquire(blocking=False):
            log.warning("closed a connection: %d others are proving the key", MAX_HANDSHAKES)
            sock.close()
            return
        threading.Thread(target=self._handshake, args=(sock,), daemon=True, name="handshake").start()

    def _handshake(self, sock: socket.socket) -> None:
        admitted = False

        def admit() -> bool:
            nonlocal admitted
            with self._admission:
                admitted, self._admitted = not self._admitted, True
            return admitted

        try:
            self._authenticated.put(P.server_handshake(sock, self.authkey, self.handshake_timeout_s, admit=admit))
        except P.ServerBusy:
            log.info("turned away a connection: another client was admitted first")
            sock.close()
        except Exception as e:  # noqa: BLE001 - whatever a peer does before it is authenticated, we serve on
            if admitted:  # the welcome did not reach it: admit the next client
                self._release_admission()
            log.warning("refused a connection: %s (%s)", e or "closed", type(e).__name__)
            sock.close()
        finally:
            self._handshakes.release()

    def _release_admission(self) -> None:
        with self._admission:
            self._admitted = False

    def _end_session(self, ch: P.Channel) -> None:
        try:
            if self.inflight:
                self.adapter.abort(sorted(self.inflight))
        except Exception:  # noqa: BLE001 - a failing abort must not hide why the session ended
            log.exception("aborting the requests of the closed session failed")
        self.inflight.clear()
        self._then = None  # a collective the client asked for: it is gone, and the next one forms its own group
        if not self.weights_ok:  # the next client cannot finish an update it did not send, nor generate from it
            self._refused = self._refused or "the previous client left its update unfinished"
        self._close_buffer()
        self._group = WG.ServerSide(self.adapter)  # the next trainer forms its own group
        ch.close()
        self._release_admission()

    def _session(self, ch: P.Channel) -> None:
        poller = select.poll()
        poller.register(ch.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
        poller.register(self.listener.fileno(), select.POLLIN)
        while not self._stop:
            busy = self.adapter.has_work()
            ready = {fd for fd, _ in poller.poll(0 if busy else 50)}
            if ch.fileno() in ready:  # first: a client that closed, then reconnects, must find the server free
                try:
                    body = ch.read_frame(P.IO_TIMEOUT_S)
                except P.FrameTooLarge as e:  # the stream cannot be resynchronised: say why, then close
                    self._try_send(ch, _error(None, "bad_request", f"{e}; closing the connection"))
                    raise
                self._handle_frame(ch, body)
            if self.listener.fileno() in ready and not self._stop:
                self._turn_away()
            if self.adapter.has_work():
                try:
                    done = self.adapter.step()
                except Exception as e:  # noqa: BLE001 - reported to the client, then the server exits
                    self._try_send(ch, {"op": "fatal",
                                        "message": f"engine {self.name!r} failed while generating: {e!r}"})
                    raise _Fatal(repr(e)) from e
                self._send_completions(ch, done)

    def _turn_away(self) -> None:
        for _ in range(16):
            sock = self.listener.accept(0)
            if sock is None:
                return
            log.info("turned away a connection: another client is being served")
            P.send_busy(sock)

    def _send_completions(self, ch: P.Channel, completions) -> None:
        for c in completions:
            self.inflight.pop(c.id, None)
            ch.send({"op": "completion", **c.to_wire()})

    @staticmethod
    def _try_send(ch: P.Channel, msg: dict) -> None:
        try:
            ch.send(msg, 1.0)
        except (OSError, ValueError):
            pass

    # ---- commands -------------------------------------------------------------------------------------------------
    def _handle_frame(self, ch: P.Channel, body) -> None:
        try:
            msg = P.decode(body)
        except P.ProtocolError as e:
            ch.send(_error(None, "bad_request", f"malformed frame: {e}"))
            return
        self._handle(ch, msg)

    def _handle(self, ch: P.Channel, msg: dict) -> None:
        op, cmd = msg["op"], msg.get("cmd")
        cmd = cmd if isinstance(cmd, (int, str)) else None
        handler = getattr(self, f"_op_{op}", None)
        try:
            if handler is None:
                raise _BadRequest(f"unknown op {op[:40]!r} (protocol version {P.PROTOCOL_VERSION})")
            reply, after = handler(msg)
        except EngineWeightError as e:
            ch.send({**_error(cmd, "weight", str(e)), "name": e.name})
            return
        except (ValueError, TypeError, KeyError, OverflowError) as e:  # _BadRequest and ProtocolError too
            ch.send(_error(cmd, "bad_request", f"{type(e).__name__}: {e}" if isinstance(e, KeyError) else str(e)))
            return
        except Exception as e:  # noqa: BLE001 - the client gets the error; the server keeps serving
            log.exception("op %s failed", op)
            ch.send(_error(cmd, "engine", f"{op} failed: {e!r}"))
            return
        ch.send({"op": "reply", "cmd": cmd, **reply})
        self._send_completions(ch, after)
        then, self._then = self._then, None
        if then is not None:
            then()

    def _op_hello(self, msg):
        if msg.get("version") != P.PROTOCOL_VERSION:
            raise _BadRequest(f"protocol version mismatch: client speaks {msg.get('version')}, engine server "
                              f"{self.name!r} speaks {P.PROTOCOL_VERSION}; install the same nemo_dapo version in "
                              "the trainer's and the engine's environments")
        info = self.adapter.info()
        info["torch"] = WG.torch_version()
        if self.nccl is not None:
            info["nccl"] = self.nccl
        reply = {"version": P.PROTOCOL_VERSION, "engine": self.name, "info": info, "sleeping": self.sleeping}
        if msg.get("shm_token") is not None:
            reply["shm_token"] = S.read_token(msg["shm_token"])
        return reply, []

    def _op_submit(self, msg):
        if not self.weights_ok:
            raise _BadRequest("the last weight update did not finish (no update_weights_done): refusing to generate "
                              "on mixed weights; send the whole update again")
        if self.sleeping:
            raise _BadRequest("engine is asleep: send wake before submitting requests")
        if not isinstance(msg.get("requests"), list):
            raise _BadRequest("submit needs 'requests': a list of requests")
        requests = [Request.from_wire(r) for r in msg["requests"]]
        dup = [r.id for r in requests if r.id in self.inflight]
        if dup or len({r.id for r in requests}) != len(requests):
            raise _BadRequest(f"request ids already in flight or repeated: {dup[:5]}")
        for r in requests:
            check_token_ids(r, self.vocab_size, self.name)
            self._check_completion_fits(r)
        held, want = sum(self.inflight.values()), sum(r.n for r in requests)
        if held + want > self.max_samples_in_flight:
            raise _BadRequest(f"submit of {want} samples refused: {held} are in flight and this engine server holds at "
                              f"most {self.max_samples_in_flight} (--max-samples-in-flight); wait for completions, "
                              "abort, or submit fewer at once")
        added = []
        try:
            for r in requests:
                self.adapter.add(r)
                added.append(r.id)
                self.inflight[r.id] = r.n
        except BaseException:
            if added:  # all or nothing: the client is told the submit failed, so none of it may run
                self.adapter.abort(added)
                for rid in added:
                    self.inflight.pop(rid, None)
            raise
        return {"queued": len(requests)}, []

    def _check_completion_fits(self, r: Request) -> None:
        """Refuse a request whose completion could be too large for one frame (sent, it would end the session)."""
        cap = r.max_new_tokens if self.max_seq_len is None else min(r.max_new_tokens,
                                                                    self.max_seq_len - len(r.prompt_ids))
        if r.n * cap > P.MAX_COMPLETION_TOKENS:
            raise _BadRequest(f"request {r.id}: n={r.n} samples of up to {cap} tokens could make a completion larger "
                              f"than the protocol's {P.MAX_FRAME_BYTES >> 20} MiB frame (at most "
                              f"{P.MAX_COMPLETION_TOKENS:,} tokens a request); split it into requests of fewer "
                              "samples, or lower max_new_tokens")

    def _op_abort(self, msg):
        if not isinstance(msg.get("ids"), list):
            raise _BadRequest("abort needs 'ids': a list of request ids")
        ids = [i for i in msg["ids"] if isinstance(i, str) and i in self.inflight]
        done = self.adapter.abort(ids) if ids else []
        return {"aborted": len(done)}, done

    def _op_join_weights(self, msg):
        self._then = self._group.join_later(msg)
        return {"joining": True}, []

    def _op_update_weights(self, msg):
        """One bucket; any refusal (of a bucket that begins an update too) leaves the update refused until a bucket
        with ``begins`` is accepted: the engine may hold part of it."""
        if msg.get("begins") is True:
            self._refused = None
        try:
            return self._bucket(msg)
        except Exception:
            self._refused = self._refused or _refusal(msg.get("tensors"))
            raise

    def _bucket(self, msg):
        if self.inflight:
            raise _BadRequest(f"{len(self.inflight)} requests are still running: let them finish or abort them "
                              "before updating weights")
        self._group.raise_failed()  # a bucket that failed after its reply: the update is refused from here on
        if not isinstance(msg.get("begins", False), bool):
            raise _BadRequest(f"update_weights: begins must be true or false, got {msg.get('begins')!r:.40}")
        if msg.get("via", "shm") == "group":
            receive = self._group.receive_later(msg, self._load_checked)
            self.weights_ok = False
            self._then = lambda: self._received(receive, msg["tensors"])
            return {"receiving": len(msg["tensors"])}, []
        if msg.get("via", "shm") != "shm":
            raise _BadRequest(f"update_weights: via must be 'shm' or 'group', got {msg.get('via')!r:.40}")
        if not isinstance(msg.get("tensors"), list):
            raise _BadRequest("update_weights needs 'tensors': a list of weight specs")
        if self._buffer is None or self._buffer.name != msg.get("shm"):
            self._close_buffer()
            self._buffer = S.AttachedBuffer(msg.get("shm"))  # maps the block and removes its name
        self.weights_ok = False  # an update has begun (a refused block name above changes nothing)
        named = self._buffer.tensors(msg["tensors"])
        try:
            self._load_checked(named)
        finally:
            del named  # the adapter copied them; drop the views before the block can be closed
        return {"loaded": len(msg["tensors"])}, []

    def _received(self, receive, tensors: list) -> None:
        """A group bucket, received after the reply: a failure is answered on the next weight command."""
        receive()
        if self._group.failed is not None:
            self._refused = _refusal(tensors)

    def _load_checked(self, named: list) -> None:
        for name, t in named:  # the whole bucket before any of it is loaded: a refused bucket changes nothing
            check_finite(name, t, self.name)
        if named:
            self.adapter.load_weights(named)

    def _op_update_weights_done(self, msg):
        self._group.raise_failed()
        if self._refused is not None:
            raise _BadRequest(f"update_weights_done refused: {self._refused}, so the engine may hold "
                              "part old, part new weights and still refuses to generate; send the whole update "
                              "again, its first bucket with begins=true")
        self._close_buffer()
        self.adapter.finish_weights()
        self.weights_ok = True
        return {}, []

    def _op_sleep(self, msg):
        level = msg.get("level", 1)
        if level not in (1, 2) or isinstance(level, bool):
            raise _BadRequest(f"sleep level must be 1 (KV cache) or 2 (KV cache and weights), got {level!r:.40}")
        if self.inflight:
            raise _BadRequest("cannot sleep with requests running; abort or finish them first")
        self.adapter.sleep(level)
        self.sleeping = True
        return {}, []

    def _op_wake(self, msg):
        tags = msg.get("tags")
        if tags is not None:
            # a partial wake (the weights before a refit, the KV cache still released): still asleep for generation
            if not isinstance(tags, list) or not tags or any(t not in WAKE_TAGS for t in tags):
                raise _BadRequest(f"wake tags must be a non-empty list of {list(WAKE_TAGS)}, got {tags!r:.60}")
            if self.sleeping:
                self.adapter.wake(tags=list(tags))
            return {}, []
        if self.sleeping:
            self.adapter.wake()
        self.sleeping = False
        return {}, []

    def _op_health(self, msg):
        return {"running": len(self.inflight), "weights_ok": self.weights_ok, "sleeping": self.sleeping,
                "uptime_s": round(time.time() - self.started, 3), "engine": self.name,
                "weight_group": self._group.state}, []

    def _op_shutdown(self, msg):
        self._stop = True
        return {}, []

    def _close_buffer(self) -> None:
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None


def _refusal(specs) -> str:
    """Why an update cannot be declared done, for a refused bucket with these weight specs."""
    name = _first_name(specs)
    return "a bucket of this update" + ("" if name == "?" else f" (from {name!r})") + " was refused"


def _first_name(specs) -> str:
    """The first tensor name of a bucket's weight specs, to name a refused bucket by ("?" where none reads)."""
    first = specs[0] if isinstance(specs, list) and specs else None
    return first["name"][:200] if isinstance(first, dict) and isinstance(first.get("name"), str) else "?"


def _error(cmd, kind: str, message: str) -> dict:
    return {"op": "error", "cmd": cmd, "type": kind, "message": message}


class _BadRequest(ValueError):
    pass


class _Fatal(RuntimeError):
    pass


def _watch_parent(pid: int) -> None:
    """Exit when the process that started us is gone, so a killed trainer leaves no engine behind."""
    def run():
        while True:
            time.sleep(1.0)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os._exit(0)
    threading.Thread(target=run, daemon=True, name="parent-watch").start()


def _options(pairs) -> dict:
    out = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise StartError(f"--option {pair!r}: expected key=value", 2)
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _options_file(path, engine: str) -> dict:
    """The JSON object of ``--options-file`` (``python -m nemo_dapo.cluster.engine_options`` writes one: its
    ``options``; a bare object of options is read as is)."""
    if path is None:
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise StartError(f"--options-file {path!r}: cannot read it ({e.strerror})", 2) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StartError(f"--options-file {path!r}: not valid JSON ({e})", 2) from None
    if isinstance(data, dict) and isinstance(data.get("options"), dict) and "engine" in data:
        if data["engine"] != engine:
            raise StartError(f"--options-file {path!r} holds options for engine {data['engine']!r}, not for "
                             f"--engine {engine!r}; write it for the same engine", 2)
        data = data["options"]
    if not isinstance(data, dict):
        raise StartError(f"--options-file {path!r}: expected a JSON object of engine options, got "
                         f"{type(data).__name__}", 2)
    return data


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, as every other refusal of this command
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def _cpu_list(text: str) -> list:
    try:
        cpus = parse_cpu_list(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    problem = cpu_set_problem(cpus)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"--cpus {problem}")
    return cpus


def _positive(kind):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}")
        return value
    return parse


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m nemo_dapo.engines.server", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True, help=f"one of {sorted(engine_registry.served_engines())}, or "
                   "module:factory")
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory (config.json + weights)")
    p.add_argument("--address", required=True, help="unix:/path/to.sock or tcp://127.0.0.1:PORT")
    p.add_argument("--option", action="append", help="engine constructor argument key=value (JSON value); "
                   "overrides the same key of --options-file")
    p.add_argument("--options-file", default=None, help="JSON object of engine constructor arguments (or the "
                   "{engine, engine_gpus, options} file of nemo_dapo.cluster.engine_options)")
    p.add_argument("--parent-pid", type=_positive(int), default=None, help="exit when this process exits")
    p.add_argument("--threads", type=_positive(int), default=None, help="torch intra-op threads of the engine")
    p.add_argument("--cpus", type=_cpu_list, default=None, help="run on these CPUs only, e.g. 0 or 2-3 (taskset's "
                   "notation; default: the CPUs it was started with)")
    p.add_argument("--allow-remote-clients", action="store_true", help="allow a TCP address that is not loopback "
                   "(clients on other machines); a key is required then")
    p.add_argument("--handshake-timeout-s", type=_positive(float), default=P.HANDSHAKE_TIMEOUT_S,
                   help="drop a connection that has not proved the key within this many seconds")
    p.add_argument("--max-samples-in-flight", type=_positive(int), default=MAX_SAMPLES_IN_FLIGHT,
                   help="refuse a submit that would hold more samples than this at once")
    return p


def _listen_plan(args) -> tuple:
    """(key, what protects it): refused before the engine loads (loading may take minutes)."""
    try:
        key = P.read_authkey()
        protection = P.server_key_policy(args.address, key, args.allow_remote_clients)
    except (P.KeyConfigError, P.AddressError) as e:
        raise StartError(str(e), 2) from None
    os.environ.pop(P.AUTHKEY_ENV, None)  # not inherited by the engine's own worker processes
    addr, family = P.parse_address(args.address)
    if family == socket.AF_UNIX and os.path.isdir(addr):
        raise StartError(f"--address {args.address}: {addr!r} is a directory; give a socket path inside it, e.g. "
                         f"unix:{os.path.join(addr, 'engine.sock')}", 2)
    return key, protection


def _run(args) -> int:
    key, protection = _listen_plan(args)
    if args.parent_pid:
        _watch_parent(args.parent_pid)
    if args.cpus:  # before torch starts its thread pool: the threads inherit it
        try:
            pin_cpus(args.cpus)
        except ValueError as e:
            raise StartError(f"--cpus: {e}", 2) from None
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    t0 = time.time()
    options = {**_options_file(args.options_file, args.engine), **_options(args.option)}
    adapter = make_engine(args.engine, args.model, options)
    try:
        try:
            listener = P.Listener(args.address)  # listen only once the engine is up: connecting means ready
        except P.AddressError as e:
            raise StartError(str(e), 2) from None
        log.info("engine %s ready on %s in %.1f s (protocol %d; %s)", args.engine, args.address, time.time() - t0,
                 P.PROTOCOL_VERSION, protection)
        try:
            return EngineServer(adapter, listener, name=args.engine, authkey=key,
                                handshake_timeout_s=args.handshake_timeout_s,
                                max_samples_in_flight=args.max_samples_in_flight).serve()
        finally:
            listener.close()
    finally:
        adapter.close()


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[engine %(asctime)s] %(message)s", stream=sys.stderr)
    try:
        return _run(args)
    except StartError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return e.code


if __name__ == "__main__":
    sys.exit(main())
