"""The rollout-engine server: one engine adapter behind the protocol of ``protocol.py``, in its own process.

    python -m nemo_dapo.engines.server --engine local|vllm|trtllm --model HF_DIR --address unix:/tmp/engine.sock \
        [--options-file FILE] [--option key=value ...] [--parent-pid PID] [--threads N]

One thread does everything: it reads a command when one is waiting, otherwise advances the engine (``adapter.step``)
and streams each finished request back as a ``completion``. One client at a time (the trainer rank that owns this
engine); when it disconnects, its requests are aborted and the server waits for the next. The authkey comes from
``$NEMO_DAPO_ENGINE_AUTHKEY`` (default: a fixed key, fine for a Unix socket or loopback; set one on shared nodes).

Safety rules: weights are only updated while no request runs (the client drains or aborts first), and after an update
that did not reach ``update_weights_done`` the server refuses to generate: it never samples from mixed weights.
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
import threading
import time
from typing import Optional

from nemo_dapo.engines import protocol as P
from nemo_dapo.engines.base import EngineWeightError, Request

log = logging.getLogger("nemo_dapo.engine")

# engine name -> "module:factory"; factory(model_dir, **options) returns an EngineAdapter
ENGINES = {
    "local": "nemo_dapo.engines.local:LocalEngine.from_path",
    "vllm": "nemo_dapo.engines.vllm:VLLMEngine",
    "trtllm": "nemo_dapo.engines.trtllm:TRTLLMEngine",
}


def make_engine(name: str, model_dir: str, options: dict):
    """``name``: a key of ENGINES, or ``package.module:factory`` for an engine of your own."""
    if name not in ENGINES and ":" not in name:
        raise SystemExit(f"unknown engine {name!r}; choose one of {sorted(ENGINES)} or give module:factory")
    module, _, attr = ENGINES.get(name, name).partition(":")
    factory = importlib.import_module(module)
    for part in attr.split("."):
        factory = getattr(factory, part)
    return factory(model_dir, **options)


class EngineServer:
    def __init__(self, adapter, listener, *, name: Optional[str] = None):
        self.adapter, self.listener = adapter, listener
        self.name = name or getattr(adapter, "name", "engine")
        self.inflight: set = set()
        self.weights_ok = True
        self.sleeping = False
        self.started = time.time()
        self._buffer: Optional[P.AttachedBuffer] = None
        self._stop = False

    # ---- sessions -------------------------------------------------------------------------------------------------
    def serve(self) -> int:
        while not self._stop:
            conn = self.listener.accept()
            try:
                self._session(conn)
            except (EOFError, OSError, ConnectionError):
                log.info("client disconnected")
            except _Fatal as e:
                log.error("engine %s failed: %s", self.name, e)
                return 1
            finally:
                if self.inflight:
                    self.adapter.abort(sorted(self.inflight))
                    self.inflight.clear()
                conn.close()
        return 0

    def _session(self, conn) -> None:
        while not self._stop:
            busy = self.adapter.has_work()
            if conn.poll(0 if busy else 0.05):
                self._handle(conn, P.recv(conn))
            if self.adapter.has_work():
                try:
                    done = self.adapter.step()
                except Exception as e:  # noqa: BLE001 - reported to the client, then the server exits
                    P.send(conn, {"op": "fatal", "message": f"engine {self.name!r} failed while generating: {e!r}"})
                    raise _Fatal(repr(e)) from e
                self._send_completions(conn, done)

    def _send_completions(self, conn, completions) -> None:
        for c in completions:
            self.inflight.discard(c.id)
            P.send(conn, {"op": "completion", **c.to_wire()})

    # ---- commands -------------------------------------------------------------------------------------------------
    def _handle(self, conn, msg: dict) -> None:
        op, cmd = msg.get("op"), msg.get("cmd")
        handler = getattr(self, f"_op_{op}", None)
        try:
            if handler is None:
                raise _BadRequest(f"unknown op {op!r} (protocol version {P.PROTOCOL_VERSION})")
            reply, after = handler(msg)
        except EngineWeightError as e:
            P.send(conn, {"op": "error", "cmd": cmd, "type": "weight", "name": e.name, "message": str(e)})
            return
        except (_BadRequest, ValueError, TypeError, KeyError) as e:
            P.send(conn, {"op": "error", "cmd": cmd, "type": "bad_request", "message": str(e)})
            return
        except Exception as e:  # noqa: BLE001 - the client gets the error; the server keeps serving
            log.exception("op %s failed", op)
            P.send(conn, {"op": "error", "cmd": cmd, "type": "engine", "message": f"{op} failed: {e!r}"})
            return
        P.send(conn, {"op": "reply", "cmd": cmd, **reply})
        self._send_completions(conn, after)

    def _op_hello(self, msg):
        if msg.get("version") != P.PROTOCOL_VERSION:
            raise _BadRequest(f"protocol version mismatch: client speaks {msg.get('version')}, engine server "
                              f"{self.name!r} speaks {P.PROTOCOL_VERSION}; install the same nemo_dapo version in "
                              "the trainer's and the engine's environments")
        return {"version": P.PROTOCOL_VERSION, "engine": self.name, "info": self.adapter.info()}, []

    def _op_submit(self, msg):
        if not self.weights_ok:
            raise _BadRequest("the last weight update did not finish (no update_weights_done): refusing to generate "
                              "on mixed weights; send the whole update again")
        if self.sleeping:
            raise _BadRequest("engine is asleep: send wake before submitting requests")
        requests = [Request.from_wire(r) for r in msg["requests"]]
        dup = [r.id for r in requests if r.id in self.inflight]
        if dup or len({r.id for r in requests}) != len(requests):
            raise _BadRequest(f"request ids already in flight or repeated: {dup[:5]}")
        for r in requests:
            self.adapter.add(r)
            self.inflight.add(r.id)
        return {"queued": len(requests)}, []

    def _op_abort(self, msg):
        ids = [i for i in msg["ids"] if i in self.inflight]
        done = self.adapter.abort(ids) if ids else []
        return {"aborted": len(done)}, done

    def _op_update_weights(self, msg):
        if self.inflight:
            raise _BadRequest(f"{len(self.inflight)} requests are still running: let them finish or abort them "
                              "before updating weights")
        self.weights_ok = False
        if self._buffer is None or self._buffer.name != msg["shm"]:
            self._close_buffer()
            self._buffer = P.AttachedBuffer(msg["shm"])
        named = self._buffer.tensors(msg["tensors"])
        try:
            self.adapter.load_weights(named)
        finally:
            del named  # the adapter copied them; drop the views before the block can be closed
        return {"loaded": len(msg["tensors"])}, []

    def _op_update_weights_done(self, msg):
        self._close_buffer()
        self.adapter.finish_weights()
        self.weights_ok = True
        return {}, []

    def _op_sleep(self, msg):
        level = int(msg.get("level", 1))
        if level not in (1, 2):
            raise _BadRequest(f"sleep level must be 1 (KV cache) or 2 (KV cache and weights), got {level}")
        if self.inflight:
            raise _BadRequest("cannot sleep with requests running; abort or finish them first")
        self.adapter.sleep(level)
        self.sleeping = True
        return {}, []

    def _op_wake(self, msg):
        if self.sleeping:
            self.adapter.wake()
        self.sleeping = False
        return {}, []

    def _op_health(self, msg):
        return {"running": len(self.inflight), "weights_ok": self.weights_ok, "sleeping": self.sleeping,
                "uptime_s": round(time.time() - self.started, 3), "engine": self.name}, []

    def _op_shutdown(self, msg):
        self._stop = True
        return {}, []

    def _close_buffer(self) -> None:
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None


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
        if not sep:
            raise SystemExit(f"--option {pair!r}: expected key=value")
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
        raise SystemExit(f"--options-file {path!r}: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise SystemExit(f"--options-file {path!r}: not valid JSON ({e})") from None
    if isinstance(data, dict) and isinstance(data.get("options"), dict) and "engine" in data:
        if data["engine"] != engine:
            raise SystemExit(f"--options-file {path!r} holds options for engine {data['engine']!r}, not for "
                             f"--engine {engine!r}; write it for the same engine")
        data = data["options"]
    if not isinstance(data, dict):
        raise SystemExit(f"--options-file {path!r}: expected a JSON object of engine options, got "
                         f"{type(data).__name__}")
    return data


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m nemo_dapo.engines.server", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True, help=f"one of {sorted(ENGINES)}, or module:factory")
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory (config.json + weights)")
    p.add_argument("--address", required=True, help="unix:/path/to.sock or tcp://127.0.0.1:PORT")
    p.add_argument("--option", action="append", help="engine constructor argument key=value (JSON value); "
                   "overrides the same key of --options-file")
    p.add_argument("--options-file", default=None, help="JSON object of engine constructor arguments (or the "
                   "{engine, engine_gpus, options} file of nemo_dapo.cluster.engine_options)")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process exits")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads of the engine process")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[engine %(asctime)s] %(message)s", stream=sys.stderr)
    if args.parent_pid:
        _watch_parent(args.parent_pid)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    authkey = os.environ.get("NEMO_DAPO_ENGINE_AUTHKEY", "").encode() or P.DEFAULT_AUTHKEY
    t0 = time.time()
    options = {**_options_file(args.options_file, args.engine), **_options(args.option)}
    adapter = make_engine(args.engine, args.model, options)
    listener = P.listen(args.address, authkey)  # listen only once the engine is up: connecting means ready
    log.info("engine %s ready on %s in %.1f s (protocol %d)", args.engine, args.address, time.time() - t0,
             P.PROTOCOL_VERSION)
    try:
        return EngineServer(adapter, listener, name=args.engine).serve()
    finally:
        listener.close()
        adapter.close()


if __name__ == "__main__":
    sys.exit(main())
