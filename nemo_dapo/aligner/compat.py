"""Everything that depends on the exact NeMo-Aligner / NeMo / megatron-core versions, in one place.

Target stack: NeMo-Aligner 0.7.0 (its last release) + NeMo 2.1.0 + megatron-core 0.10.0 + TensorRT-LLM 0.13.0, as
NeMo-Aligner 0.7.0's own Dockerfile builds it (``SUPPORTED``: what the CPU tests install, and what the trainer image's
build checks with ``python -m nemo_dapo.aligner.compat``). The rest of ``nemo_dapo.aligner`` imports the
host-framework symbols it needs from here, so a version bump touches this file only.

NeMo-Aligner 0.7.0 quirks handled here:
  * ``nemo_aligner/utils/trt_llm.py`` imports ``tensorrt_llm`` at top level, and the PPO actor module imports it, so
    the actor base class is importable only where TensorRT-LLM is installed (the container). ``actor_base`` says so
    instead of failing with a bare ModuleNotFoundError.
  * The trainer state of a NeMo-Aligner run is parsed back from the checkpoint FILE NAME
    (``retrieve_custom_trainer_state_dict``). We store ours inside the checkpoint instead (``pack_state`` /
    ``unpack_state``): a uint8 tensor survives both PTL checkpoints and megatron dist-checkpointing's "common" state,
    which torch 2.6+ loads with ``weights_only=True``.
  * NeMo 2.1's ``DistributedCheckpointIO`` saves through megatron-core 0.10's default ``torch_dist`` strategy, which
    forks twice on every rank at every save, even a synchronous one, and spawns a Manager process on the first
    (``nemo_dapo/megatron/dist_save.py`` says why both are unsafe or slow). ``write_checkpoints_in_process`` gives
    that IO our in-process strategy (same files, same format).
"""
from __future__ import annotations

import io
import sys
import warnings
from importlib import metadata

import torch

SUPPORTED = {"nemo-aligner": "0.7.0", "nemo-toolkit": "2.1.0", "megatron-core": "0.10.0"}
CHECKPOINT_KEY = "nemo_dapo_trainer_state"  # key of our trainer state inside the PTL checkpoint dict


def installed_versions() -> dict:
    """{distribution: version or None} for the stack we target."""
    out = {}
    for dist in SUPPORTED:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def stack_mismatch(found: dict) -> str:
    """Why ``found`` ({distribution: version or None}) is not the ``SUPPORTED`` stack; "" when it is. A local
    version label (``+git...``) is ignored: a source install of the same release is the same API."""
    wrong = {d: v for d, v in found.items() if (v or "").split("+")[0] != SUPPORTED[d]}
    if not wrong:
        return ""
    return ("nemo_dapo.aligner targets " + ", ".join(f"{d}=={v}" for d, v in SUPPORTED.items()) + "; found "
            + ", ".join(f"{d}=={v or 'not installed'}" for d, v in wrong.items()) + ". Its calls into NeMo and "
            "megatron-core were read and are tested at those versions only. Build the trainer image from "
            "containers/Dockerfile on NeMo-Aligner 0.7.0's own image (docs/cluster.md, 'Build the images').")


def check_versions(strict: bool = False) -> dict:
    """Warn (or raise with ``strict``) when the installed stack differs from the one this plugin targets."""
    found = installed_versions()
    msg = stack_mismatch(found)
    if msg and strict:
        raise RuntimeError(msg)
    if msg:
        warnings.warn(msg, stacklevel=2)
    return found


def actor_base():
    """NeMo-Aligner's ``MegatronGPTActorModel`` (the PPO actor), with a clear error when it cannot be imported."""
    try:
        from nemo_aligner.models.nlp.gpt.megatron_gpt_ppo_actor import MegatronGPTActorModel
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] in ("tensorrt_llm", "tensorrt", "mpi4py"):
            raise ImportError(
                f"NeMo-Aligner 0.7.0's actor module imports {e.name!r} at top level (nemo_aligner/utils/trt_llm.py), "
                "so the DAPO actor needs TensorRT-LLM installed: run inside the trainer image "
                "(containers/Dockerfile, on NeMo-Aligner 0.7.0's own image). (CPU tests install a stand-in module "
                "from tests/support/trtllm_stub.py.)") from e
        raise
    return MegatronGPTActorModel


def trtllm_generator_class():
    """NeMo-Aligner's ``GPTGenerateTRTLLM`` (engine build + refit + static-batch generate)."""
    from nemo_aligner.utils.trt_llm import GPTGenerateTRTLLM

    return GPTGenerateTRTLLM


def pack_state(state: dict) -> torch.Tensor:
    """``state`` (any torch.save-able object) as a 1-D uint8 tensor, for storage inside a model checkpoint."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8).clone()


def unpack_state(packed: torch.Tensor) -> dict:
    """Inverse of :func:`pack_state`; like every checkpoint read, it never runs code from the bytes."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.dim() != 1:
        raise ValueError(f"checkpoint entry {CHECKPOINT_KEY!r} must be a 1-D uint8 tensor written by pack_state, "
                         f"got {type(packed).__name__}")
    from nemo_dapo.core.checkpoint import safe_load

    return safe_load(io.BytesIO(packed.cpu().numpy().tobytes()), what=f"checkpoint entry {CHECKPOINT_KEY!r}")


def device() -> torch.device:
    """Where megatron keeps its tensors: the current CUDA device (CPU when torch has no CUDA)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def write_checkpoints_in_process(trainer) -> str:
    """Make the PTL ``trainer``'s synchronous ``torch_dist`` checkpoint saves write in the calling process, keeping
    NeMo's own choices (plan caching, the fully-parallel wrapper). Returns the save strategy's name, or why NeMo's
    is kept: another format, or ``async_save`` (its writes run in forked processes by design)."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from nemo.utils.callbacks.dist_ckpt_io import DistributedCheckpointIO

    from nemo_dapo.megatron.dist_save import InProcessTorchDistSave

    strategy = getattr(trainer, "strategy", None)
    if hasattr(strategy, "use_distributed_checkpointing"):
        strategy.use_distributed_checkpointing  # NeMo's own choice of IO, made now rather than at the first save
    io = getattr(strategy, "unwrapped_checkpoint_io", None)
    if not isinstance(io, DistributedCheckpointIO):
        return f"kept: checkpoint IO {type(io).__name__}"
    if io.async_save or io.save_ckpt_format != "torch_dist":
        return f"kept: async_save={io.async_save}, format {io.save_ckpt_format}"
    outer = io.save_sharded_strategy  # NeMo's choice, built as it builds it
    holder, attr = (outer, "base_strategy") if hasattr(outer, "base_strategy") else (io, "_save_sharded_strategy")
    base = getattr(holder, attr)
    if type(base) is not TorchDistSaveShardedStrategy:
        return f"kept: save strategy {type(base).__name__}"
    ours = InProcessTorchDistSave(thread_count=base.thread_count)
    ours.use_cached_ckpt_structure = getattr(base, "use_cached_ckpt_structure", False)
    setattr(holder, attr, ours)
    return type(io.save_sharded_strategy).__name__ + ("" if holder is io else f"({type(ours).__name__})")


def _state_round_trips() -> bool:
    """``pack_state`` / ``unpack_state`` on this torch, with the filler's dataclass inside (raises if not)."""
    from nemo_dapo.core.dynamic_sampling import Group

    group = Group(uid=7, acc=torch.tensor([1.0, 0.0]), rewards=torch.tensor([1.0, -1.0]))
    back = unpack_state(pack_state({"groups": [group]}))["groups"][0]
    if not (isinstance(back, Group) and back.uid == 7 and torch.equal(back.rewards, group.rewards)):
        raise RuntimeError(f"the trainer state does not round-trip on torch {torch.__version__}: got {back!r}")
    return True


def main(argv=None) -> int:
    """``python -m nemo_dapo.aligner.compat [--stack-check strict|warn]``: the image build's check of the stack.
    Prints what is installed; with ``strict`` (the default) a stack other than ``SUPPORTED`` fails the build. The
    trainer state's round trip through a weights-only load (what every resume does) runs on the image's torch too."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m nemo_dapo.aligner.compat", description=main.__doc__)
    ap.add_argument("--stack-check", choices=("strict", "warn"), default="strict",
                    help="warn: build on another stack knowingly (its differences are untested)")
    args = ap.parse_args(argv)
    found = installed_versions()
    print("stack:", ", ".join(f"{d}=={v}" for d, v in found.items()))
    print(f"torch {torch.__version__}: the trainer state round-trips through a weights-only load:",
          _state_round_trips())
    msg = stack_mismatch(found)
    if not msg:
        return 0
    if args.stack_check == "warn":
        print(f"WARNING: {msg}", file=sys.stderr)
        return 0
    print(f"{msg} To build on this stack anyway: --build-arg STACK_CHECK=warn.", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
