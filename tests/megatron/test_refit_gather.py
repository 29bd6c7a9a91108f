"""Expert-aware refit gather: the split rules (fast, one process) and the streamed gather under TP=2, PP=2, EP=2
and TP=2 with TP-sharded experts (slow: tests/megatron/workers/refit_worker.py, one torchrun for every case)."""
import json
from pathlib import Path

import pytest
import torch

from nemo_dapo.megatron.convert_shard import tp_shard, tp_unshard
from nemo_dapo.megatron.model import sequential_expert_name, with_expert_index
from tests.support.dist import run_torchrun

WORKER = Path(__file__).parent / "workers" / "refit_worker.py"
LAYOUTS = ["tp2", "pp2", "pp2_tied", "ep2", "tp2_moe", "tp2_moe_te_labels"]
STREAMS = ["infer_tp1_small", "infer_tp1_large", "infer_tp2_small", "infer_tp2_large", "bf16"]


@pytest.mark.parametrize("dim,stride,size", [(0, 1, 2), (1, 1, 4), (0, 2, 2), (0, 2, 3), (1, 2, 2)])
def test_tp_shard_round_trip(dim, stride, size):
    full = torch.arange(12 * 24, dtype=torch.float32).reshape(12, 24)
    shards = [tp_shard(full, dim, stride, size, r) for r in range(size)]
    assert torch.equal(tp_unshard(shards, dim, stride), full)
    assert sum(s.numel() for s in shards) == full.numel()


def test_gated_fc1_shard_holds_gate_and_up_slices():
    """SwiGLU fc1 = [gate; up]; TP rank r must hold [gate_r; up_r] (megatron applies act(x[:h]) * x[h:] locally)."""
    gate, up = torch.arange(8.0)[:, None], 100 + torch.arange(8.0)[:, None]
    full = torch.cat([gate, up])
    r1 = tp_shard(full, 0, 2, 2, 1)
    assert torch.equal(r1, torch.cat([gate[4:], up[4:]]))


def test_tp_shard_rejects_indivisible_dim():
    with pytest.raises(ValueError, match="does not split"):
        tp_shard(torch.zeros(10, 4), 0, 2, 3, 0, name="decoder.layers.0.mlp.linear_fc1.weight")


def test_with_expert_index_renames_only_the_expert():
    seq = "decoder.layers.3.mlp.experts.local_experts.3.linear_fc1.weight"
    assert with_expert_index(seq, 7) == "decoder.layers.3.mlp.experts.local_experts.7.linear_fc1.weight"
    te = "decoder.layers.3.mlp.experts.linear_fc2.weight3"
    assert with_expert_index(te, 12) == "decoder.layers.3.mlp.experts.linear_fc2.weight12"
    with pytest.raises(ValueError, match="not an expert"):
        with_expert_index("decoder.layers.3.mlp.linear_fc1.weight", 1)


def test_sequential_expert_name_spells_te_grouped_names_as_sequential_ones():
    te = "decoder.layers.3.mlp.experts.linear_fc1.weight12"
    assert sequential_expert_name(te) == "decoder.layers.3.mlp.experts.local_experts.12.linear_fc1.weight"
    assert sequential_expert_name("decoder.layers.0.mlp.experts.linear_fc2.bias0") == \
        "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.bias"
    for same in ("decoder.layers.3.mlp.experts.local_experts.3.linear_fc1.weight",
                 "decoder.layers.3.mlp.linear_fc1.weight", "decoder.layers.3.mlp.experts.linear_fc1._extra_state"):
        assert sequential_expert_name(same) == same


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("refit")
    run_torchrun(WORKER, nproc=2, out_dir=out)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_stream_rebuilds_single_rank_weights_exactly(results, layout):
    for rank, res in enumerate(results):
        r = res[layout]
        for stream in STREAMS:
            s = r[stream]
            assert s["names_match"] and s["duplicates"] == 0 and s["exact"], (layout, rank, stream, s)
            assert s["total_bytes"] == s["want_bytes"]
        assert r["full_state_dict_exact"] and r["no_alias"], (layout, rank)
        if layout.startswith("tp2"):  # inference TP = training TP: the stream returns the rank's own shards
            assert r["own_shards_equal"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_buckets_respect_byte_bound(results, layout):
    for res in results:
        r = res[layout]
        for stream in STREAMS:
            s = r[stream]
            assert s["bucket_ok"], (layout, stream, s)  # <= bucket bytes, or a single oversized tensor
            assert s["peak"] <= s["bound"], (layout, stream, s)  # pending bucket + one gathered tensor
        assert r["infer_tp1_small"]["buckets"] > 5 and r["infer_tp1_large"]["buckets"] == 1


# ---- what the 2-rank runs cannot reach: TP x PP (4 ranks) and an expert-TP size other than TP --------------------

def _fake_parallel_state(monkeypatch, tp, etp):
    """TP size ``tp`` and expert-TP size ``etp`` (megatron's ``expert_tensor_parallel_size``), rank 0 of each, EP 1;
    ``all_gather`` answers as if every other rank held ``10 * rank + its own shard``. Returns the groups used."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    for name, value in (("get_tensor_model_parallel_world_size", tp), ("get_tensor_model_parallel_rank", 0),
                        ("get_tensor_model_parallel_group", "tp-group"),
                        ("get_expert_tensor_parallel_world_size", etp), ("get_expert_tensor_parallel_rank", 0),
                        ("get_expert_tensor_parallel_group", "etp-group"),
                        ("get_expert_model_parallel_world_size", 1), ("get_expert_model_parallel_rank", 0)):
        monkeypatch.setattr(ps, name, lambda value=value: value)
    used = []

    def all_gather(shards, t, group=None):
        used.append((group, len(shards)))
        for r, s in enumerate(shards):
            s.copy_(t + 10 * r)

    monkeypatch.setattr(dist, "all_gather", all_gather)
    return used


def test_an_expert_weight_is_gathered_over_expert_tp_not_tp(monkeypatch):
    """With expert_tensor_parallel_size=1 under TP=2 each rank holds its experts whole: gathering them over the TP
    group would stack two copies. Dense weights still gather over TP."""
    from nemo_dapo.megatron.refit_gather import _Entry, _tp_gather

    used = _fake_parallel_state(monkeypatch, tp=2, etp=1)
    t = torch.arange(12.0).reshape(4, 3)
    expert = _Entry("fc2", ("fc2",), tp_dim=1, stride=1, expert=True, shape=(4, 3), dtype=t.dtype)
    assert torch.equal(_tp_gather(t, expert), t) and used == []
    dense = _Entry("proj", ("proj",), tp_dim=1, stride=1, expert=False, shape=(4, 6), dtype=t.dtype)
    assert torch.equal(_tp_gather(t, dense), torch.cat([t, t + 10], 1)) and used == [("tp-group", 2)]
    used.clear()
    _fake_parallel_state(monkeypatch, tp=2, etp=2)
    assert _tp_gather(t, expert).shape == (4, 6)


def test_stage_entries_carry_the_gathered_shape(monkeypatch):
    """The other pipeline stages (and EP ranks) allocate their broadcast buffer from an entry's shape, so it must be
    the shape AFTER the TP gather: at TP=2 x PP=2 a shard-sized buffer fails the broadcast (4 ranks, not run here)."""
    from nemo_dapo.megatron import refit_gather
    from nemo_dapo.megatron.model import ParamLayout

    _fake_parallel_state(monkeypatch, tp=2, etp=2)
    model = torch.nn.Module()
    for name, shape in (("qkv", (6, 4)), ("proj", (4, 3)), ("norm", (4,))):
        model.register_parameter(name, torch.nn.Parameter(torch.zeros(shape)))
    layouts = {"qkv": ParamLayout("decoder.layers.0.self_attention.linear_qkv.weight", tp_dim=0),
               "proj": ParamLayout("decoder.layers.0.self_attention.linear_proj.weight", tp_dim=1),
               "norm": ParamLayout("decoder.final_layernorm.weight", tp_dim=None)}
    monkeypatch.setattr(refit_gather, "param_layouts", lambda inner: layouts)
    got = {e.local_name: (e.names, e.shape) for e in refit_gather._stage_entries(model)}
    assert got == {"qkv": (("decoder.layers.0.self_attention.linear_qkv.weight",), (12, 4)),
                   "proj": (("decoder.layers.0.self_attention.linear_proj.weight",), (4, 6)),
                   "norm": (("decoder.final_layernorm.weight",), (4,))}
