"""Which rank owns each colocated engine (nemo_dapo/cluster/engine_owners.py): megatron-core's own RankGenerator as the
reference for the model-parallel groups, a brute-force search over every assignment as the reference for whether one
exists, and the recipes' layouts."""
import itertools

import pytest

from nemo_dapo.cluster import config_load as cl
from nemo_dapo.cluster import config_validate as cv
from nemo_dapo.cluster.engine_owners import engine_owners, megatron_mp_groups

LAYOUTS = [(8, 2, 1, 1), (16, 4, 2, 1), (16, 2, 2, 2), (32, 2, 1, 1), (128, 4, 2, 1), (128, 8, 2, 1), (64, 1, 4, 2)]


@pytest.mark.parametrize("world,tp,pp,cp", LAYOUTS)
def test_the_groups_are_megatrons_in_its_default_order(world, tp, pp, cp):
    rank_generator = pytest.importorskip("megatron.core.parallel_state").RankGenerator
    ref = rank_generator(tp=tp, ep=1, dp=world // (tp * pp * cp), pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    assert sorted(megatron_mp_groups(world, tp=tp, pp=pp, cp=cp)) == sorted(sorted(g) for g in ref.get_ranks("tp-pp"))


def check(owners: dict, world: int, engine_gpus: int, groups: list) -> None:
    """Every engine has one owner on its own GPUs, and every group owns at least one engine."""
    assert sorted(owners) == list(range(world // engine_gpus))
    assert all(owner // engine_gpus == e for e, owner in owners.items())
    assert all(any(owner in g for owner in owners.values()) for g in groups)


def assignable(world: int, engine_gpus: int, groups: list) -> bool:
    """The slow reference: some choice of distinct engines, one per group, each holding a rank of its group."""
    options = [{r // engine_gpus for r in g} for g in groups]
    engines = range(world // engine_gpus)
    return any(all(e in opt for e, opt in zip(pick, options)) for pick in itertools.permutations(engines, len(groups)))


@pytest.mark.parametrize("gpus_per_node", [2, 4, 8])
def test_an_assignment_is_found_exactly_when_one_exists(gpus_per_node):
    seen = set()
    for world, tp, pp, engine_gpus in itertools.product([8, 16], [1, 2, 4], [1, 2, 4], [1, 2, 4, 8]):
        if world % (tp * pp) or gpus_per_node % engine_gpus or world // engine_gpus > 8:
            continue  # the brute force enumerates permutations of at most 8 engines
        groups = megatron_mp_groups(world, tp=tp, pp=pp)
        if len(groups) > world // engine_gpus:
            with pytest.raises(ValueError, match="cannot each own one"):
                engine_owners(world, engine_gpus, groups)
            continue
        exists = assignable(world, engine_gpus, groups)
        seen.add(exists)
        if exists:
            check(engine_owners(world, engine_gpus, groups), world, engine_gpus, groups)
        else:
            with pytest.raises(ValueError, match="cannot each own one"):
                engine_owners(world, engine_gpus, groups)
    assert seen == {True}  # in megatron's layouts enough engines always suffice: the match is the only question


def test_the_first_gpu_stays_the_owner_where_it_serves_every_group():
    groups = megatron_mp_groups(128, tp=8, pp=2)  # Mixtral: 8 groups, two node engines each
    assert engine_owners(128, 8, groups) == {e: 8 * e for e in range(16)}


def test_two_replicas_that_share_each_nodes_engine_are_matched_one_engine_each():
    """Qwen3-235B's layout: TP4 x PP2 on 16 nodes, engines of a node; half the groups hold no engine's first GPU."""
    groups = megatron_mp_groups(128, tp=4, pp=2)
    assert [4, 5, 6, 7, 68, 69, 70, 71] in groups and not any(r % 8 == 0 for r in [4, 5, 6, 7, 68, 69, 70, 71])
    owners = engine_owners(128, 8, groups)
    check(owners, 128, 8, groups)
    assert sorted(sum(owner in g for owner in owners.values()) for g in groups) == [1] * 16  # one engine each


def test_the_validator_refuses_replicas_without_an_engine_and_passes_the_recipes():
    cfg = cl.load_config("qwen3-30b-a3b_h100", ["trainer.dapo.engine_server.tensor_parallel_size=8",
                                                "trainer.dapo.engine_server.expert_parallel_size=8"])
    assert any("16 model-parallel groups cannot each own one of the 4 engines of 8 GPUs" in p
               for p in cv.check_config(cfg))
    other_order = cl.load_config("qwen3-30b-a3b_h100", ["trainer.dapo.engine_server.tensor_parallel_size=8",
                                                        "trainer.dapo.engine_server.expert_parallel_size=8",
                                                        "+model.use_tp_pp_dp_mapping=true"])
    assert not [p for p in cv.check_config(other_order) if "own one of" in p]  # not this order's arithmetic
    for recipe in ("qwen3-30b-a3b_h100", "qwen3-235b-a22b_h100", "moe-mixtral-8x22b_h20", "qwen2.5-32b_h100"):
        assert not [p for p in cv.check_config(cl.load_config(recipe)) if "own one of" in p], recipe
