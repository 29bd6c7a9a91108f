"""Which rank owns each colocated engine server's connection (pure arithmetic; aligner/engine_generation.py uses it,
the config validator checks it).

Colocated engines tile each node: engine ``e`` runs on the global ranks' GPUs ``[e G, (e + 1) G)`` (G GPUs an engine,
nodes being contiguous rank ranges). A server takes one client, so one rank per engine owns it, and every
model-parallel group (one data-parallel replica) needs an engine of its own to generate. By default the owner is
the rank on the engine's first GPU. Where that leaves a group without an engine (a model-parallel group that spans
nodes beside another, as TP4 x PP2 with engines of a whole node: the stages of two replicas share each node), the
groups are matched to engines that hold one of their ranks, one engine each (augmenting paths); the engines left
over keep their first GPU's rank.
"""
from __future__ import annotations


def megatron_mp_groups(world: int, *, tp: int, pp: int, cp: int = 1) -> list:
    """megatron-core 0.10's model-parallel groups (tp x pp ranks of one context and data-parallel rank) in its default
    order "tp-cp-ep-dp-pp": rank ``t + tp (c + cp (d + dp p))``."""
    dp = world // (tp * pp * cp)
    return [sorted(t + tp * (c + cp * (d + dp * p)) for p in range(pp) for t in range(tp))
            for d in range(dp) for c in range(cp)]


def engine_owners(world: int, engine_gpus: int, groups: list) -> dict:
    """{engine index: owner rank} for engines of ``engine_gpus`` GPUs over ``world`` ranks and the model-parallel
    ``groups`` (lists of global ranks that partition the world). ValueError when no assignment gives every group an
    engine (more groups than engines, or groups whose ranks share too few engines)."""
    owners = {e: e * engine_gpus for e in range(world // engine_gpus)}
    group_of = {r: i for i, ranks in enumerate(groups) for r in ranks}
    if len({group_of[r] for r in owners.values()}) == len(groups):
        return owners
    engines_of = [sorted({r // engine_gpus for r in ranks}) for ranks in groups]
    matched: dict = {}  # engine -> group

    def augment(i: int, seen: set) -> bool:
        for e in engines_of[i]:
            if e not in seen:
                seen.add(e)
                if e not in matched or augment(matched[e], seen):
                    matched[e] = i
                    return True
        return False

    for i in range(len(groups)):
        if not augment(i, set()):
            raise ValueError(f"{len(groups)} model-parallel groups cannot each own one of the {len(owners)} engines of "
                             f"{engine_gpus} GPUs on their ranks (e.g. ranks {groups[i]}): use engines no wider than "
                             "model.tensor_model_parallel_size, or a model-parallel group of whole nodes")
    for e, i in matched.items():
        owners[e] = min(r for r in groups[i] if r // engine_gpus == e)
    return owners
