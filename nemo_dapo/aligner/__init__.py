"""NeMo-Aligner 0.7.0 integration: the DAPO actor, trainer, rollout generators, local reward and data set.

The only part of nemo_dapo that imports NeMo / NeMo-Aligner / TensorRT-LLM. Names are resolved lazily, so that
importing the package (e.g. for ``generation.check_generation_lengths`` or the data set) does not load NeMo.
"""
from importlib import import_module

_EXPORTS = {
    "MegatronGPTDAPOActorModel": "nemo_dapo.aligner.actor",
    "DAPOTrainer": "nemo_dapo.aligner.trainer",
    "ActorPolicy": "nemo_dapo.aligner.trainer",
    "TRTLLMGenerator": "nemo_dapo.aligner.generation",
    "MegatronSampler": "nemo_dapo.aligner.generation",
    "build_generator": "nemo_dapo.aligner.generation",
    "check_generation_lengths": "nemo_dapo.aligner.generation",
    "LocalRewardClient": "nemo_dapo.aligner.reward_client",
    "ClientReward": "nemo_dapo.aligner.reward_client",
    "DAPOPromptDataset": "nemo_dapo.aligner.dataset",
    "collate": "nemo_dapo.aligner.dataset",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'nemo_dapo.aligner' has no attribute {name!r}")
