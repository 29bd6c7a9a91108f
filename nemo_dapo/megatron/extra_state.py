"""Checkpoint requests without the modules' ``_extra_state`` entries (no FP8: they carry nothing).

megatron-core 0.10 checkpoints every ``_extra_state`` of a model as a ``ShardedObject``: its own linears store None,
Transformer Engine's modules their FP8 scaling metadata. Which modules have one depends on the layer spec and on
TE's version: the local spec (what ``nemo-dapo convert`` builds, and every CPU run) has none for the attention
kernel or the norms, while TE's ``DotProductAttention`` is a ``TransformerEngineBaseModule`` and has one, and newer
TE releases give their norms one too. So a checkpoint written from one spec lacks keys the other asks for, and the
load fails ("Missing key in checkpoint state_dict: model.decoder.layers.self_attention.core_attention._extra_state",
NeMo issue 12298, reported in February 2025 on the newest NeMo container then; the maintainers' answer there,
``dist_ckpt_load_strictness=log_all``, would let missing weights through as well). Without FP8 nothing in them is
worth keeping, so each becomes a ``LocalNonpersistentObject`` of the module's current value: not saved, and
"loaded" as itself. NeMo 2.1 does the same for TE's fused-attention state (``MegatronGPTModel.sharded_state_dict``,
``skip_fp8_load``). Weights stay strictly loaded.
"""
from __future__ import annotations

from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedObject

SUFFIX = "_extra_state"


def without_extra_state(sharded_state_dict):
    """``sharded_state_dict`` (nested dicts / lists, changed in place and returned) with every ``ShardedObject``
    whose key ends in ``_extra_state`` replaced by a ``LocalNonpersistentObject`` of its data."""
    def local(x):
        if isinstance(x, ShardedObject) and x.key.endswith(SUFFIX):
            return LocalNonpersistentObject(x.data)
        return x

    dict_list_map_inplace(local, sharded_state_dict)
    return sharded_state_dict
