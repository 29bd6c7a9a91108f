"""Python start-up of the test images (test-only; the enroot stand-in puts this directory on PYTHONPATH).

* Every Python process started in a container records its command line and environment as
  ``$STANDIN_RECORDS/proc-<pid>.json``, so the test sees what each step really ran with (an export inside a step's
  ``bash -c`` is in the environment here, not in the step's).
* The trainer image (``NEMO_DAPO_CPU_IMAGE=1``) runs NeMo on CPU: the NeMo container has GPUs, apex and Transformer
  Engine; here the patches of ``tests/support/nemo_cpu.py`` stand in for them. They must be in place before
  megatron or NeMo is first imported, in the trainer and in every process it spawns: an import hook applies them at
  the first import of ``megatron`` / ``nemo`` / ``nemo_aligner``, so processes that never load NeMo (the engine
  options step) stay light.
"""
import importlib.abc
import json
import os
import sys


def _record_process() -> None:
    records = os.environ.get("STANDIN_RECORDS")
    if not records:
        return
    with open("/proc/self/cmdline", "rb") as f:
        argv = [a.decode(errors="replace") for a in f.read().split(b"\0")[:-1]]
    path = os.path.join(records, f"proc-{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), "ppid": os.getppid(), "argv": argv, "env": dict(os.environ)}, f)
    os.replace(path + ".tmp", path)


class _PatchNeMoFirst(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] not in ("megatron", "nemo", "nemo_aligner"):
            return None
        sys.meta_path.remove(self)  # once: the patches import megatron and NeMo themselves
        import tests.support.nemo_cpu as nemo_cpu

        nemo_cpu.allow_full_checkpoint_loads()  # a resumed run loads the checkpoint's common state (patch 12)
        _seed_model_parallel_rng_on_cpu()
        return None  # the normal finders import the (now patched) module


def _seed_model_parallel_rng_on_cpu() -> None:
    """NeMo 2.1 seeds megatron's model-parallel RNG tracker only ``if torch.cuda.device_count() > 0``
    (megatron_init._set_random_seed); the tests' init_parallel seeds it by hand, the example relies on NeMo: seed it
    here on CPU too (the tracker runs on the megatron CPU shim)."""
    import nemo.collections.nlp.modules.common.megatron.megatron_init as megatron_init
    from megatron.core import tensor_parallel

    original = megatron_init._set_random_seed

    def _set_random_seed(seed_):
        original(seed_)
        tensor_parallel.model_parallel_cuda_manual_seed(seed_ + 100 * megatron_init.get_pipeline_model_parallel_rank())

    megatron_init._set_random_seed = _set_random_seed


_record_process()
if os.environ.get("NEMO_DAPO_CPU_IMAGE") == "1":
    sys.meta_path.insert(0, _PatchNeMoFirst())
