"""Which engine server each training rank belongs to, which rank owns the connection, and the server's address: pure
arithmetic over global ranks, no process groups (``engine_generation.py`` connects and generates).

Rank -> server (:class:`EngineLayout`). An engine spans ``G = engine_server.tensor_parallel_size x
pipeline_parallel_size`` GPUs inside one node; node n runs ``gpus_per_node / G`` engines, engine ``i`` of node n on the
node-local GPUs ``[i G, (i + 1) G)``. Global rank r (node ``r // gpus_per_node``, local rank ``l = r % gpus_per_node``)
belongs to engine ``i = l // G`` of its node, and the rank with ``l % G == 0`` (the first GPU of the engine) OWNS the
connection: it is the only rank that talks to that server (a server takes one client at a time) and sends it the
weights. Where that leaves a model-parallel group without an engine, the groups are matched to engines holding one of
their ranks instead (``cluster/engine_owners.py``; every rank computes the same match). Its address is
``engine_server.address`` (or ``$<address_env>``) formatted with ``node``, ``local`` (= i), ``port`` (= base_port + i)
and ``rank`` (the owner's global rank); the launcher starts the servers with the same template. Weights travel through
node-local shared memory, so owner and server share a node.

``engine_server.placement: separate`` (engines on GPUs of their own): one engine per data-parallel replica, owned by
the replica's first rank (the lowest global rank of its model-parallel group), at entry ``d`` (the replica's
data-parallel rank) of a comma-separated ``address`` list, or the template formatted for engine d of the engine nodes
as above (``node`` = d // engines per node, ``local``, ``port``, ``rank``; also ``engine`` = d):
:func:`separate_address`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from nemo_dapo.cluster.engine_owners import engine_owners


@dataclass(frozen=True)
class EngineLayout:
    """Which engine server each global rank belongs to (module docstring). Pure arithmetic, no process groups."""

    world: int
    gpus_per_node: int
    engine_gpus: int  # GPUs of one engine (its tensor x pipeline parallel size)

    def __post_init__(self):
        for key in ("world", "gpus_per_node", "engine_gpus"):
            if int(getattr(self, key)) < 1:
                raise ValueError(f"EngineLayout.{key}={getattr(self, key)} must be >= 1")
        if self.gpus_per_node % self.engine_gpus:
            raise ValueError(f"an engine of {self.engine_gpus} GPUs (engine_server.tensor_parallel_size x "
                             f"pipeline_parallel_size) does not tile a node of {self.gpus_per_node} GPUs "
                             "(trainer.devices): engines must not span nodes; choose a divisor of trainer.devices")
        if self.world % self.gpus_per_node:
            raise ValueError(f"world size {self.world} is not a whole number of {self.gpus_per_node}-GPU nodes")

    @property
    def engines_per_node(self) -> int:
        return self.gpus_per_node // self.engine_gpus

    @property
    def num_engines(self) -> int:
        return self.world // self.engine_gpus

    def engine_of(self, rank: int) -> tuple:
        """(node, node-local engine index) of global ``rank``."""
        return rank // self.gpus_per_node, (rank % self.gpus_per_node) // self.engine_gpus

    def owner_of(self, rank: int) -> int:
        node, local = self.engine_of(rank)
        return node * self.gpus_per_node + local * self.engine_gpus

    def address(self, rank: int, template: str, base_port: int = 0, owner: Optional[int] = None) -> str:
        """The address of ``rank``'s engine server from ``template`` ({node}, {local}, {port}, {rank}: ``owner``, by
        default the rank on the engine's first GPU)."""
        node, local = self.engine_of(rank)
        try:
            return template.format(node=node, local=local, port=base_port + local,
                                   rank=self.owner_of(rank) if owner is None else owner)
        except (KeyError, IndexError) as e:
            raise ValueError(f"engine_server.address {template!r}: unknown field {e}; use {{node}}, {{local}}, "
                             "{port}, {rank}") from None


def owners_in_group(layout: EngineLayout, group_ranks, groups) -> list:
    """The connection owners among the global ranks of one model-parallel group, in rank order, from the assignment
    over every model-parallel group of the world (``groups``, cluster/engine_owners.py: the ranks on the engines'
    first GPUs where they serve every group, else a match; ValueError where none can)."""
    owners = engine_owners(layout.world, layout.engine_gpus, groups).values()
    mine = set(group_ranks)
    return sorted(r for r in owners if r in mine)


def separate_address(template: str, engine: int, engines: int, per_node: int, base_port: int, owner: int) -> str:
    """The address of engine ``engine`` (of ``engines``, one per data-parallel replica) in the separate placement:
    entry ``engine`` of a comma-separated list of ``engines`` addresses, or ``template`` formatted as the colocated
    one is, over the engine nodes (``per_node`` engines each): ``node`` (= engine // per_node, counted from the first
    engine node), ``local`` (= engine % per_node), ``port`` (= base_port + local), ``rank`` (the owner's global
    rank), and ``engine``."""
    if "," in template:
        listed = [a.strip() for a in template.split(",")]
        if len(listed) != engines:
            raise ValueError(f"engine_server.address lists {len(listed)} engine servers, but the separate placement "
                             f"has one per data-parallel replica: {engines}; list {engines} addresses")
        return listed[engine]
    try:
        node, local = divmod(engine, per_node)
        return template.format(engine=engine, node=node, local=local, port=base_port + local, rank=owner)
    except (KeyError, IndexError) as e:
        raise ValueError(f"engine_server.address {template!r}: unknown field {e}; use {{node}}, {{local}}, "
                         "{port}, {rank}, {engine}, or list one address per engine, comma-separated") from None
