"""Rank -> engine server arithmetic of the NeMo-Aligner trainer (nemo_dapo/aligner/engine_layout.py): which engine
each rank belongs to, who owns the connection, and the servers' addresses in both placements."""
import pytest

from nemo_dapo.aligner.engine_layout import EngineLayout, owners_in_group, separate_address
from nemo_dapo.cluster.engine_owners import megatron_mp_groups


def test_rank_to_server_mapping_by_hand():
    lay = EngineLayout(world=16, gpus_per_node=8, engine_gpus=4)  # 2 nodes x 2 engines of TP4
    assert (lay.engines_per_node, lay.num_engines) == (2, 4)
    table = {0: (0, 0, 0), 3: (0, 0, 0), 4: (0, 1, 4), 7: (0, 1, 4), 8: (1, 0, 8), 13: (1, 1, 12)}
    for rank, (node, local, owner) in table.items():
        assert lay.engine_of(rank) == (node, local) and lay.owner_of(rank) == owner
    assert [r for r in range(16) if lay.owner_of(r) == r] == [0, 4, 8, 12]
    assert lay.address(13, "unix:/tmp/e/engine-{local}.sock") == "unix:/tmp/e/engine-1.sock"
    assert lay.address(13, "tcp://127.0.0.1:{port}", base_port=29600) == "tcp://127.0.0.1:29601"
    assert lay.address(9, "unix:/s/n{node}-r{rank}.sock") == "unix:/s/n1-r8.sock"
    with pytest.raises(ValueError, match="unknown field"):
        lay.address(0, "unix:/tmp/{gpu}.sock")


def test_separate_engines_are_addressed_by_data_parallel_replica():
    # engine 3 of 4, two per engine node: the second node's second engine
    assert separate_address("tcp://enode{node}:{port}", 3, 4, 2, 29600, owner=12) == "tcp://enode1:29601"
    assert separate_address("tcp://e{engine}:9/{rank}-{local}", 1, 2, 1, 0, owner=8) == "tcp://e1:9/8-0"
    listed = "tcp://h1:29600, tcp://h1:29601,tcp://h2:29600"
    assert [separate_address(listed, d, 3, 2, 0, owner=0) for d in range(3)] == [
        "tcp://h1:29600", "tcp://h1:29601", "tcp://h2:29600"]
    with pytest.raises(ValueError, match="lists 3 engine servers, but .* one per data-parallel replica: 4"):
        separate_address(listed, 0, 4, 2, 0, owner=0)
    with pytest.raises(ValueError, match="unknown field 'gpu'"):
        separate_address("unix:/tmp/e-{gpu}.sock", 0, 1, 1, 0, owner=0)


def test_engines_that_span_nodes_are_refused():
    with pytest.raises(ValueError, match="does not tile a node"):
        EngineLayout(world=16, gpus_per_node=8, engine_gpus=3)


def test_owners_of_model_parallel_groups():
    lay = EngineLayout(world=16, gpus_per_node=8, engine_gpus=2)
    # TP8 groups of contiguous ranks: four engines each, owners every second rank
    assert owners_in_group(lay, range(8, 16), groups=[list(range(8)), list(range(8, 16))]) == [8, 10, 12, 14]
    # TP2 x PP2 (megatron: PP outermost), group {0, 1, 8, 9}: the engines of GPUs 0-1 and 8-9
    tp2pp2 = megatron_mp_groups(16, tp=2, pp=2)
    assert [0, 1, 8, 9] in tp2pp2 and owners_in_group(lay, [0, 1, 8, 9], groups=tp2pp2) == [0, 8]
    # engine TP4 wider than a TP2 group: the group {2, 3} holds no engine's first GPU, and four groups share two
    # engines, so no match serves them all
    wide = EngineLayout(world=8, gpus_per_node=8, engine_gpus=4)
    assert not any(wide.owner_of(r) == r for r in (2, 3))
    with pytest.raises(ValueError, match="4 model-parallel groups cannot each own one of the 2 engines"):
        owners_in_group(wide, [2, 3], groups=[[0, 1], [2, 3], [4, 5], [6, 7]])
    # TP2 x PP2 over two 4-GPU nodes with engines of a node: {2, 3, 6, 7} holds no first GPU but gets node 1's engine
    lay, groups = EngineLayout(world=8, gpus_per_node=4, engine_gpus=4), [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert not any(lay.owner_of(r) == r for r in (2, 3, 6, 7))
    owners = [owners_in_group(lay, g, groups=groups) for g in groups]
    assert [len(o) for o in owners] == [1, 1] and all(o[0] in g for o, g in zip(owners, groups))
    assert {o[0] // 4 for o in owners} == {0, 1}  # one engine each


@pytest.mark.parametrize("kw, match", [(dict(world=8, gpus_per_node=8, engine_gpus=0), "engine_gpus=0 must be >= 1"),
                                       (dict(world=0, gpus_per_node=8, engine_gpus=1), "world=0 must be >= 1"),
                                       (dict(world=12, gpus_per_node=8, engine_gpus=2),
                                        "world size 12 is not a whole number of 8-GPU nodes")])
def test_a_layout_that_cannot_place_engines_is_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineLayout(**kw)


def test_a_separate_address_list_longer_than_the_replicas_is_refused():
    # a list with an engine too many means the job and the config disagree about the engines: refuse, do not guess

    with pytest.raises(ValueError, match="lists 3 engine servers, but .* one per data-parallel replica: 2"):
        separate_address("tcp://a:1,tcp://b:1,tcp://c:1", 0, 2, 1, 0, owner=0)
