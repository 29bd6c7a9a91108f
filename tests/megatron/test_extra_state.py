"""nemo_dapo.megatron.extra_state: a checkpoint written without a module's ``_extra_state`` (the local spec's, as
``nemo-dapo convert`` writes it) loads into a model that has one (Transformer Engine's attention and norms) once the
request skips them, through megatron-core 0.10's own save and load on CPU; without the skip the load fails."""
import pytest
import torch

from tests.support import megatron_cpu_shim  # noqa: F401  (before megatron)
from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.dist_checkpointing import ShardedTensor  # noqa: E402
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedObject  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException  # noqa: E402

from nemo_dapo.megatron.dist_save import save_sharded  # noqa: E402
from nemo_dapo.megatron.extra_state import without_extra_state  # noqa: E402

ATTN = "model.decoder.layers.self_attention.core_attention._extra_state"  # TE's DotProductAttention has one


def _weight(t):
    return ShardedTensor.from_rank_offsets("model.decoder.layers.mlp.linear_fc1.weight", t, replica_id=0)


def _extra(key, data):
    return ShardedObject(key, data, (1,), (0,), replica_id=0)


def test_only_extra_state_objects_become_local():
    w = _weight(torch.ones(2, 2))
    other = _extra("model.rng_state", {"seed": 1})
    sd = {"state_dict": {"w": w, "x": _extra(ATTN, b"fp8"), "nested": [_extra("a.linear_qkv._extra_state", None)]},
          "rng": other}
    out = without_extra_state(sd)
    assert out is sd and sd["state_dict"]["w"] is w and sd["rng"] is other
    local = sd["state_dict"]["x"]
    assert isinstance(local, LocalNonpersistentObject) and local.unwrap() == b"fp8"
    assert isinstance(sd["state_dict"]["nested"][0], LocalNonpersistentObject)


def test_a_checkpoint_without_the_attention_state_loads_into_a_model_with_one(gloo_world_of_one, tmp_path):
    megatron_cpu_shim.adapt_checkpoint_writer()  # torch's writer signature, as in every CPU save (test support)
    saved = torch.arange(6.0).reshape(2, 3)
    # what the local spec writes: the weight and its linear's (None) extra state, no attention state
    save_sharded({"state_dict": {"model.decoder.layers.mlp.linear_fc1.weight": _weight(saved.clone()),
                                 "model.decoder.layers.mlp.linear_fc1._extra_state":
                                 _extra("model.decoder.layers.mlp.linear_fc1._extra_state", None)}}, str(tmp_path))

    def request():  # what a TE-spec model asks for: the same weight, plus its attention kernel's extra state
        return {"state_dict": {"model.decoder.layers.mlp.linear_fc1.weight": _weight(torch.zeros(2, 3)),
                               ATTN: _extra(ATTN, b"current")}}

    with pytest.raises(CheckpointException, match="core_attention._extra_state"):  # NeMo issue 12298's error
        dist_checkpointing.load(request(), str(tmp_path))
    loaded = dist_checkpointing.load(without_extra_state(request()), str(tmp_path))["state_dict"]
    assert torch.equal(loaded["model.decoder.layers.mlp.linear_fc1.weight"], saved)
    assert loaded[ATTN] == b"current"  # the module keeps its own state
    # a missing WEIGHT still fails: only extra states are skipped
    missing = {"state_dict": {"model.decoder.layers.mlp.linear_fc2.weight": ShardedTensor.from_rank_offsets(
        "model.decoder.layers.mlp.linear_fc2.weight", torch.zeros(2), replica_id=0)}}
    with pytest.raises(CheckpointException, match="linear_fc2.weight"):
        dist_checkpointing.load(without_extra_state(missing), str(tmp_path))
