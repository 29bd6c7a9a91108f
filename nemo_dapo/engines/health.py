"""Health probe of engine servers, for launchers: wait until every server answers ``health``, then exit.

    python -m nemo_dapo.engines.health [--timeout-s 1800] [--interval-s 1] ADDRESS [ADDRESS ...]

Each ADDRESS is ``unix:/path`` or ``tcp://HOST:PORT`` (as given to ``nemo_dapo.engines.server --address``). A
server listens only once its engine is loaded, so a successful ``hello`` + ``health`` means ready. The probe
disconnects right away (a server takes one client at a time: the trainer connects after it); a server that is
serving a client already answers ``busy`` at once, which counts as up. Exit code 0 when all are healthy within the
time-out, 1 otherwise (the message names the servers that are not); the time-out is a real upper bound on the wait.
Prints one JSON line per server. The key is read as the server reads it (``protocol.read_authkey``:
``$NEMO_DAPO_ENGINE_AUTHKEY`` or ``$NEMO_DAPO_ENGINE_AUTHKEY_FILE``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from nemo_dapo.engines.base import EngineError
from nemo_dapo.engines.client import EngineBusy, EngineClient, EngineRefused

# Between rounds of probes: a refused connection costs nothing, and a launcher starts training within a second of
# the last server coming up (a 5 s pause cost up to 5 s of idle allocation per job).
INTERVAL_S = 1.0


def probe(address: str, *, timeout_s: float) -> dict:
    """The server's health reply, or ``{address, busy: true}`` when it serves another client, all within
    ``timeout_s``; raises EngineError when it is not reachable in that time (EngineRefused: not with this key)."""
    deadline = time.monotonic() + timeout_s
    try:
        # no /dev/shm check: the probe sends no weights, and a server it cannot share /dev/shm with (on another node,
        # or in a container of its own) is up all the same; the trainer's client checks what its transport needs
        client = EngineClient(address, name=address, connect_timeout_s=timeout_s, request_timeout_s=timeout_s,
                              wait_if_busy=False, check_shared_memory=False)
    except EngineBusy:
        return {"address": address, "busy": True}
    try:
        reply = client.health(timeout_s=max(0.05, deadline - time.monotonic()))
        return {"address": address, **{k: v for k, v in reply.items() if k not in ("op", "cmd")}}
    finally:
        client.close()


def wait_healthy(addresses, *, timeout_s: float, interval_s: float = INTERVAL_S, out=sys.stdout) -> list:
    """Addresses still unhealthy at the deadline (empty: all healthy). Servers are probed in turn until each
    answers with ``weights_ok`` (or ``busy``: it is up and serving a client); an absent or refusing socket is retried
    every ``interval_s``. A server that refuses our key is reported at once. Returns within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    pending, last = list(dict.fromkeys(addresses)), ""
    while pending:
        left = []
        for i, address in enumerate(pending):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                left.append(address)
                continue
            try:
                reply = probe(address, timeout_s=min(max(interval_s, 0.5), remaining))
            except EngineRefused as e:  # a wrong or missing key: waiting does not help
                print(f"engine health: {e}", file=sys.stderr)
                return left + pending[i:]
            except (EngineError, OSError, ValueError) as e:
                left.append(address)
                last = str(e)
                continue
            if not (reply.get("weights_ok") or reply.get("busy")):
                left.append(address)
                last = f"{address}: weights not ok"
                continue
            print(json.dumps(reply), file=out, flush=True)
        pending = left
        if pending and time.monotonic() >= deadline:
            print(f"engine health: {len(pending)} server(s) not healthy after {timeout_s:.0f} s: {pending}; "
                  f"last error: {last}", file=sys.stderr)
            return pending
        if pending:
            time.sleep(min(interval_s, max(0.0, deadline - time.monotonic())))
    return []


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m nemo_dapo.engines.health", description=__doc__.split("\n\n")[0])
    p.add_argument("addresses", nargs="+", metavar="ADDRESS", help="unix:/path or tcp://HOST:PORT")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="give up after this long (engines load slowly)")
    p.add_argument("--interval-s", type=float, default=INTERVAL_S, help="pause between rounds of probes")
    args = p.parse_args(argv)
    if args.timeout_s <= 0 or args.interval_s <= 0:
        p.error("--timeout-s and --interval-s must be positive")
    return 1 if wait_healthy(args.addresses, timeout_s=args.timeout_s, interval_s=args.interval_s) else 0


if __name__ == "__main__":
    sys.exit(main())
