"""The collective weight transport: one broadcast from the trainer to every engine server, beside shared memory.

Shared memory reaches only the servers on the trainer's host. Here the trainer (rank 0) and N engine servers (ranks
1..N) form a process group of their own, never the trainer's world (the trainer may run one already), so the engines
can live on other nodes and one broadcast feeds them all. The trainer hosts its rendezvous (rendezvous.py, a store of
our own: torch's TCPStore does not connect the trainer image's torch 2.4 with the engine image's 2.9) and tells each
server where it is (``join_weights``). A bucket travels as one flat uint8 tensor in the layout of
``shm.weight_layout`` (64-byte aligned offsets), so both transports share the WeightSpec and its checks.

Protocol (one reply per command, as every other op; the server blocks in the collective right after its reply):

    join_weights   {address: "tcp://H:P", rank, world_size, group_timeout_s, backend: gloo | nccl}
                                                                        -> {joining: true}; then it joins
    update_weights {via: "group", size, tensors: [WeightSpec]}          -> {receiving: n}; then it receives the
                                                                           bucket from rank 0 and loads it

The trainer sends a bucket's ``update_weights`` to every server and waits for every reply before it broadcasts: a
server that refuses is known before anyone blocks. A receive or a load that fails afterwards is answered on the
server's next ``update_weights`` / ``update_weights_done`` (its weights are then not usable, as with shared memory).
When anything fails part-way the trainer drops the group: the servers still waiting in the broadcast see their peer
close and fail at once, and the next update forms a new group.

Backends (``backend`` in ``join_weights``): ``gloo`` moves CPU tensors (the trainer copies each bucket to the CPU,
the receivers copy it to their GPU); ``nccl`` moves GPU tensors, GPU to GPU, one GPU per rank: the trainer's current
CUDA device, and each engine worker's own (vLLM's and TensorRT-LLM's workers receive the broadcast themselves:
engines/vllm.py, engines/trtllm_worker.py; an engine that receives in its server process takes gloo only). Every rank
must load the same NCCL release and torch major.minor (the engine's ``info["nccl"]`` / ``info["torch"]`` are
compared before a group forms). A dead peer ends a gloo broadcast at once; an NCCL broadcast is polled, so the
trainer names the engine that died instead of waiting out NCCL's time-out; the engine's workers of a trainer that
died fail their broadcast after ``group_timeout_s`` and drop the group, before NCCL's watchdog would end them
(``_process_group``), and a restarted run forms a new group.
``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` pick the network interface where the default is the wrong one.
"""
from __future__ import annotations

import datetime
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from nemo_dapo.core import engine_registry
from nemo_dapo.engines import protocol as P
from nemo_dapo.engines import shm as S
from nemo_dapo.engines.base import EngineError, EngineWeightError
from nemo_dapo.engines.rendezvous import JOIN_CONNECT_S, RendezvousServer, RendezvousStore

PREFIX = "nemo_dapo/weights"
MAX_WORLD = 4096  # servers of one trainer, plus the trainer
MAX_BUCKET_BYTES = 16 << 30  # one bucket of a group update (the recipes' buckets are 64-512 MiB)
TRANSPORTS = engine_registry.WEIGHT_TRANSPORTS  # what a trainer may choose: "shm", or a group's backend
BACKENDS = tuple(t for t in TRANSPORTS if t != "shm")  # gloo, nccl
POLL_S = 0.01  # an NCCL broadcast's completion is polled this often, its peers' liveness every second
NCCL_WATCHDOG_MARGIN_S = 60.0  # an NCCL group's time-out exceeds the poll's (_await), which therefore fires first


class GroupBroken(EngineError):
    """A broadcast of the weight group failed: the group is gone (the trainer dropped it, or a peer died)."""


def workers_failure(answers) -> Optional[tuple]:
    """An engine's verdict on a broadcast bucket from its workers' answers (one per worker, each for its own
    broadcast and its own shard: None, ("broken", why) or ("nan", name)): a broken broadcast on any worker first,
    since its group is gone whatever the others say, then any other failure, else None."""
    failed = [a for a in answers if a is not None]
    return next((a for a in failed if a[0] == "broken"), failed[0] if failed else None)


def check_transport(name: str) -> str:
    """A weight transport of ``TRANSPORTS`` (by name only: a cluster config is checked where it cannot run)."""
    if name not in TRANSPORTS:
        raise ValueError(f"weight_transport must be one of {list(TRANSPORTS)}, got {name!r:.40}")
    return name


def nccl_problem() -> Optional[str]:
    """Why this process cannot take part in an NCCL weight group (None: it can)."""
    if not dist.is_nccl_available():
        return f"this torch ({torch.__version__}) is built without NCCL"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    return None


def torch_version() -> str:
    """This process's torch release ("2.9.0a0+..."), reported to the trainer in the engine's hello."""
    return str(torch.__version__)


def _minor(version: str) -> tuple:
    return tuple(version.split("+")[0].split(".")[:2])


def nccl_version() -> Optional[str]:
    """This process's NCCL release ("2.21.5"), None without NCCL: every rank of a group must load the same one."""
    if nccl_problem() is not None:
        return None
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(seconds))


def parse_store(address) -> tuple:
    """``tcp://HOST:PORT`` -> (host, port); a ProtocolError names anything else."""
    if not isinstance(address, str) or not address.startswith("tcp://"):
        raise P.ProtocolError(f"weight-group address must be tcp://HOST:PORT, got {address!r:.80}")
    host, sep, port = address[len("tcp://"):].rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise P.ProtocolError(f"weight-group address must be tcp://HOST:PORT, got {address!r:.80}")
    return host.strip("[]"), int(port)


def check_join(msg: dict) -> tuple:
    """(host, port, rank, world_size, timeout_s, backend) of a ``join_weights`` message, each checked."""
    host, port = parse_store(msg.get("address"))
    backend = msg.get("backend", "gloo")
    if backend not in BACKENDS:
        raise P.ProtocolError(f"join_weights: backend must be one of {list(BACKENDS)}, got {backend!r:.40}")
    rank, world, timeout_s = msg.get("rank"), msg.get("world_size"), msg.get("group_timeout_s", 300)
    if type(world) is not int or not 2 <= world <= MAX_WORLD:
        raise P.ProtocolError(f"join_weights: world_size must be an int in [2, {MAX_WORLD}], got {world!r:.40}")
    if type(rank) is not int or not 1 <= rank < world:
        raise P.ProtocolError(f"join_weights: rank must be an int in [1, world_size), got {rank!r:.40}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= 3600:
        raise P.ProtocolError(f"join_weights: group_timeout_s must be a number in (0, 3600], got {timeout_s!r:.40}")
    return host, port, rank, world, float(timeout_s), backend


def check_bucket(specs, size) -> int:
    """The byte size of a group bucket whose every spec lies inside it (ProtocolError otherwise)."""
    if type(size) is not int or not 0 <= size <= MAX_BUCKET_BYTES:
        raise P.ProtocolError(f"update_weights: size must be an int in [0, {MAX_BUCKET_BYTES}], got {size!r:.40}")
    if not isinstance(specs, list):
        raise P.ProtocolError("update_weights needs 'tensors': a list of weight specs")
    for spec in specs:
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise P.ProtocolError(f"a weight spec must be an object with a string name, got {spec!r:.80}")
        if not S.spec_fits(spec, size):
            raise P.ProtocolError(f"weight {spec['name']!r} ends past the {size}-byte bucket")
        if spec["offset"] % P.nbytes(P.dtype_of(spec["dtype"]), []):  # a view of the bucket starts on an element
            raise P.ProtocolError(f"weight {spec['name']!r}: offset {spec['offset']} is not aligned to its "
                                  f"{spec['dtype']} elements (shm.weight_layout aligns every offset to 64 bytes)")
    return size


def _views(flat: torch.Tensor, specs: Sequence[dict]) -> list:
    """[(name, view into ``flat``)]: the shared-memory block's layout over a uint8 tensor, on its device (the
    offsets are 64-byte aligned, so every view's start suits its dtype)."""
    out = []
    for spec in specs:
        dtype, shape, start = P.dtype_of(spec["dtype"]), tuple(spec["shape"]), int(spec["offset"])
        end = start + P.nbytes(dtype, shape)
        out.append((spec["name"], flat[start:end].view(dtype).view(shape)))
    return out


def _process_group(backend: str, store, rank: int, world_size: int, timeout_s: float):
    """The group's own process group (never the trainer's world). NCCL: every rank's current CUDA device, and a
    time-out ``NCCL_WATCHDOG_MARGIN_S`` past ``timeout_s``: at its own time-out NCCL's watchdog ends the process
    (``TORCH_NCCL_ASYNC_ERROR_HANDLING``'s default in torch 2.4 and 2.9), where ``_await``'s raises an error the
    caller reports and the group is dropped (its destructor aborts the communicator)."""
    prefixed = dist.PrefixStore(PREFIX, store)
    if backend == "nccl":
        problem = nccl_problem()
        if problem is not None:
            raise RuntimeError(f"an nccl weight group needs CUDA and NCCL: {problem}; use gloo")
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, _timeout(timeout_s + NCCL_WATCHDOG_MARGIN_S))
    return dist.ProcessGroupGloo(prefixed, rank, world_size, _timeout(timeout_s))


def nccl_api_problems() -> list:
    """What this torch lacks of the NCCL API the group calls (read from torch 2.4.0's and 2.9's bindings):
    ``ProcessGroupNCCL(store, rank, size, timeout: timedelta)``, ``broadcast(tensor, root)`` and a non-blocking
    ``Work.is_completed``. The images run it at build time (``python -m nemo_dapo.engines.weight_group``)."""
    if not dist.is_nccl_available():
        return [f"torch {torch.__version__} is built without NCCL"]
    problems = []
    doc = dist.ProcessGroupNCCL.__init__.__doc__ or ""
    if "timeout: datetime.timedelta" not in doc:
        problems.append("ProcessGroupNCCL has no (store, rank, size, timeout: timedelta) constructor")
    if "tensor: torch.Tensor, root" not in (dist.ProcessGroupNCCL.broadcast.__doc__ or ""):
        problems.append("ProcessGroupNCCL has no broadcast(tensor, root)")
    if not hasattr(dist.Work, "is_completed"):
        problems.append("torch.distributed.Work has no is_completed()")
    return problems


def _device(backend: str, device=None) -> torch.device:
    if backend == "gloo":
        return torch.device("cpu")
    return torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())


def _await(work, backend: str, timeout_s: float, check=None) -> None:
    """Wait for one broadcast. gloo returns or raises (a peer closed, the time-out); an NCCL wait would only order
    the CUDA stream, so its completion is polled, ``check()`` (raises for a dead peer) every second, and the
    time-out raised here rather than left to NCCL's watchdog."""
    if backend == "gloo":
        work.wait()
        return
    deadline, next_check = time.monotonic() + timeout_s, time.monotonic() + 1.0
    while not work.is_completed():
        now = time.monotonic()
        if now > deadline:
            raise RuntimeError(f"the nccl broadcast did not complete within {timeout_s:.0f} s")
        if check is not None and now > next_check:
            check()
            next_check = now + 1.0
        time.sleep(POLL_S)
    work.wait()  # raises a failure NCCL recorded


class WeightGroup:
    """Trainer side, rank 0: hosts the rendezvous at ``host`` (an address the engine nodes reach) on a free port.

    ``connect`` blocks until all ``receivers`` ranks (engine servers, or their workers) have joined (after their
    ``join_weights``) or ``timeout_s``. ``backend``: gloo, or nccl from ``device`` (None: the current CUDA device)."""

    def __init__(self, host: str, receivers: int, *, timeout_s: float = 300.0, backend: str = "gloo", device=None):
        if not 1 <= receivers < MAX_WORLD:
            raise ValueError(f"a weight group has 1..{MAX_WORLD - 1} receiving ranks, got {receivers}")
        if backend not in BACKENDS:
            raise ValueError(f"a weight group's backend is one of {list(BACKENDS)}, got {backend!r:.40}")
        self.world_size, self.timeout_s, self.backend = receivers + 1, float(timeout_s), backend
        self.device = device  # nccl: None is the current CUDA device at each broadcast (gloo: always the CPU)
        self._server = RendezvousServer(host)
        self._store = RendezvousStore(host, self._server.port, self.timeout_s)
        self.address = f"tcp://{host}:{self._server.port}"
        self._pg = None

    def join_message(self, rank: int) -> dict:
        return {"address": self.address, "rank": rank, "world_size": self.world_size,
                "group_timeout_s": self.timeout_s, "backend": self.backend}

    def connect(self) -> None:
        self._pg = _process_group(self.backend, self._store, 0, self.world_size, self.timeout_s)

    def broadcast(self, bucket: list, specs: list, size: int, check=None) -> None:
        """Send one bucket of (name, tensor) pairs, laid out by ``shm.weight_layout``. ``check()``: raises
        when a receiver died (polled during an NCCL broadcast)."""
        flat = torch.empty(size, dtype=torch.uint8, device=_device(self.backend, self.device))
        for (_, view), (_, t) in zip(_views(flat, specs), bucket):
            view.copy_(t.detach().reshape(view.shape))
        _await(self._pg.broadcast(flat, 0), self.backend, self.timeout_s, check)

    def close(self) -> None:
        """Drop the group and its rendezvous; a server still waiting in a broadcast fails as its peer closes."""
        self._pg = None
        if self._store is not None:
            self._store.close()
            self._server.close()
        self._store = None


class GroupMember:
    """Engine side, rank >= 1 of the trainer's group (blocks in the constructor until every rank joined).
    ``device``: where an nccl bucket lands (the worker's GPU; None: the current CUDA device)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float, backend: str = "gloo",
                 device=None):
        self.backend, self.timeout_s, self.device = backend, float(timeout_s), _device(backend, device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # NCCL binds a rank to the current device
        self._store = RendezvousStore(host, port, timeout_s,  # kept: torch calls back into it
                                      connect_timeout_s=min(float(timeout_s), JOIN_CONNECT_S))
        self._pg = _process_group(backend, self._store, rank, world_size, timeout_s)

    def receive(self, specs: list, size: int) -> list:
        """[(name, tensor)] of one bucket broadcast by rank 0 (views of one fresh buffer on ``device``);
        GroupBroken when the broadcast fails (a peer closed, or the time-out)."""
        if self._pg is None:
            raise GroupBroken("this weight group failed on an earlier bucket; the trainer forms a new one")
        flat = torch.empty(size, dtype=torch.uint8, device=self.device)
        try:
            _await(self._pg.broadcast(flat, 0), self.backend, self.timeout_s)
        except RuntimeError as e:
            self._pg = None  # dropped before NCCL's watchdog would end this process; the next join forms another
            raise GroupBroken(f"{type(e).__name__}: {e}") from None
        return _views(flat, specs)

    def receive_and_load(self, specs: list, size: int, load) -> None:
        load(self.receive(specs, size))


class _AdapterMember:
    """A member whose engine receives the broadcast in its own workers (``adapter.join_weight_group`` /
    ``check_weight_specs`` / ``receive_weights``: vLLM's collective_rpc), so a bucket's bytes never pass through the
    server process. The adapter checks a bucket from its specs before the server replies, and once it replies its
    workers always read the whole broadcast: a rank that skipped one would read the next bucket's bytes as this."""

    def __init__(self, adapter, host: str, port: int, rank: int, world_size: int, timeout_s: float, backend: str):
        self.adapter = adapter
        adapter.join_weight_group(host, port, rank, world_size, timeout_s, backend)

    def receive_and_load(self, specs: list, size: int, load) -> None:
        self.adapter.receive_weights(specs, size)


class ServerSide:
    """What an engine server keeps of its group: the member, its state for ``health``, and the error of a receive
    or load that failed after the reply (answered on the next weight command). An adapter with
    ``join_weight_group`` / ``receive_weights`` receives in its workers, with ``info()["weight_group_ranks"]``
    ranks from the one the trainer gives it; any other is one rank and receives here."""

    def __init__(self, adapter=None):
        self.adapter = adapter
        self.member = None
        self.state = "none"
        self.failed: Optional[EngineWeightError] = None

    def join_later(self, msg: dict):
        """Check a ``join_weights`` message; returns what joins, to be run after the reply."""
        host, port, rank, world, timeout_s, backend = check_join(msg)
        in_workers = hasattr(self.adapter, "join_weight_group")
        if backend == "nccl" and not in_workers:
            raise P.ProtocolError("join_weights: this engine receives weights in its server process, on the CPU: "
                                  "nccl needs an engine whose GPU workers receive (vllm, trtllm); use gloo")
        self.member, self.state = None, "joining"
        self.failed = None  # a new group starts a new update: the trainer knew of the old one's failure
        if in_workers:  # an engine that cannot take weights says so now, not by a join the trainer waits out
            self.adapter.check_weight_specs([])

        def join():
            try:
                self.member = (_AdapterMember(self.adapter, host, port, rank, world, timeout_s, backend) if in_workers
                               else GroupMember(host, port, rank, world, timeout_s))
                self.state = "joined" + (" (in the engine's workers)" if in_workers else "") + (
                    " over nccl" if backend == "nccl" else "")
            except Exception as e:  # noqa: BLE001 - reported through health and the next update
                self.state = f"failed to join {msg['address']} as rank {rank}: {type(e).__name__}: {e}"
        return join

    def receive_later(self, msg: dict, load):
        """Check a group ``update_weights``; returns what receives the bucket and hands it to ``load``."""
        if self.member is None:
            raise P.ProtocolError(f"update_weights via group: no weight group is joined ({self.state}); send "
                                  "join_weights first")
        specs, size = msg.get("tensors"), check_bucket(msg.get("tensors"), msg.get("size"))
        if isinstance(self.member, _AdapterMember):  # refused now, or its workers would leave the bytes unread
            self.adapter.check_weight_specs(specs)

        def receive():
            try:
                self.member.receive_and_load(specs, size, load)
            except GroupBroken as e:  # the trainer dropped the group or died: the next update rejoins
                self.member, self.state = None, f"left: a broadcast failed ({e})"
                self.failed = EngineWeightError(f"the weight broadcast failed part-way ({e}); the update is "
                                                "incomplete")
            except EngineWeightError as e:
                self.failed = e
            except Exception as e:  # noqa: BLE001 - answered on the next weight command
                self.failed = EngineWeightError(f"loading a broadcast bucket failed: {type(e).__name__}: {e}")
        return receive

    def raise_failed(self) -> None:
        failed, self.failed = self.failed, None
        if failed is not None:
            raise failed


# ---- trainer side: one update to many servers ---------------------------------------------------------------------
def update_over_group(clients: Sequence, buckets, *, host: str = "127.0.0.1", group: Optional[WeightGroup] = None,
                      backend: str = "gloo") -> tuple:
    """Broadcast every (name, tensor) bucket to ``clients`` (EngineClient), then ``update_weights_done`` each.

    ``group``: a joined group from an earlier update (None: form one over ``backend``, its rendezvous on ``host``,
    its broadcasts bounded by the clients' ``weight_timeout_s``, as is each server's reply to a weight command).
    Returns (stats, the group to reuse). A server that dies or refuses raises EngineError / EngineWeightError, after
    the group was dropped."""
    stats = {"buckets": 0, "tensors": 0, "bytes": 0, "seconds": 0.0, "transport": "group"}
    t0 = time.perf_counter()
    timeout_s = max(c.weight_timeout_s for c in clients)

    def alive():
        for c in clients:
            c.raise_if_dead()
    try:
        if group is None:
            group = _form(clients, host, timeout_s, backend)
        for bucket in buckets:
            bucket = list(bucket)
            specs, size = S.weight_layout(bucket)
            cmds = [c.send("update_weights", via="group", size=size, tensors=specs, begins=not stats["buckets"])
                    for c in clients]
            for c, k in zip(clients, cmds):
                c.reply(k, "update_weights", timeout_s=c.weight_timeout_s)
            _collective(clients, lambda: group.broadcast(bucket, specs, size, check=alive))
            stats["buckets"] += 1
            stats["tensors"] += len(specs)
            stats["bytes"] += size
        for k, c in [(c.send("update_weights_done"), c) for c in clients]:
            c.reply(k, "update_weights_done", timeout_s=c.weight_timeout_s)
    except BaseException:
        if group is not None:
            group.close()
        raise
    stats["seconds"] = time.perf_counter() - t0
    return stats, group


def _form(clients: Sequence, host: str, timeout_s: float, backend: str = "gloo") -> WeightGroup:
    """A new group: server k gets ``info["weight_group_ranks"]`` ranks (one per engine worker that receives; 1 when
    the server receives itself) from the first rank after server k-1's."""
    if backend == "nccl":
        check_nccl_peers(clients)
    ranks = [int(c.info.get("weight_group_ranks", 1)) for c in clients]
    group = WeightGroup(host, sum(ranks), timeout_s=timeout_s, backend=backend)
    firsts = [1 + sum(ranks[:k]) for k in range(len(clients))]
    try:
        for k, c in [(c.send("join_weights", **group.join_message(r)), c) for r, c in zip(firsts, clients)]:
            c.reply(k, "join_weights", timeout_s=c.weight_timeout_s)
        _collective(clients, group.connect, joining=True)
    except BaseException:
        group.close()
        raise
    return group


def check_nccl_peers(clients: Sequence) -> None:
    """Before an nccl group forms: this process can join one, and every engine reports this process's NCCL
    release (``info["nccl"]``); otherwise an EngineError names the engine and what to change, before anyone blocks."""
    problem, mine = nccl_problem(), nccl_version()
    if problem is not None:
        raise EngineError(f"weight_transport nccl: this trainer cannot join an NCCL group ({problem}); use gloo")
    for c in clients:
        theirs = c.info.get("nccl")
        if theirs != mine:
            raise EngineError(f"weight_transport nccl: engine {c.name!r} has NCCL {theirs or 'none'}, this trainer "
                              f"{mine}: every rank of the group must load the same NCCL release (the engine image "
                              "and the trainer's), or use gloo")
        # torch releases exchange NCCL's unique id differently above 128 ranks (2.9 gathers one per root under
        # keys 2.4 never writes), so an nccl group also needs one torch major.minor
        other = c.info.get("torch")
        if other is not None and _minor(other) != _minor(torch_version()):
            raise EngineError(f"weight_transport nccl: engine {c.name!r} runs torch {other}, this trainer "
                              f"{torch_version()}: an nccl group needs one torch major.minor in every rank; use gloo")


def _collective(clients: Sequence, fn, joining: bool = False) -> None:
    """Run a collective; a failure is named after the engine that died, or after the servers' own account."""
    try:
        fn()
    except RuntimeError as e:  # a peer that closed (gloo), the time-out
        time.sleep(0.2)  # a dead server's socket closes a moment after its process ends
        for c in clients:
            c.raise_if_dead()
        states = "; ".join(f"{c.name}: {c.health().get('weight_group', '?')}" for c in clients)
        what = "forming the weight group" if joining else "the weight broadcast"
        raise EngineError(f"{what} failed ({e}); the engine servers say: {states}") from None


if __name__ == "__main__":  # the images' build-time check of the NCCL API above
    found = nccl_api_problems()
    print("\n".join(found) or f"torch {torch.__version__}: the NCCL weight group's API is present")
    raise SystemExit(1 if found else 0)
