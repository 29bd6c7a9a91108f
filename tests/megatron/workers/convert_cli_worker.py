"""torchrun worker: ``nemo-dapo convert`` itself (cli.main) on every rank; argv after the script are its arguments.

The ``__main__`` guard is required: megatron-core 0.10's checkpoint writer starts a ``spawn`` multiprocessing
Manager, whose server process imports the launching script again (as ``__mp_main__``); without the guard that child
re-ran the whole conversion and the Manager's start never returned (the hang of the first version of this test).
The product entry points (the ``nemo-dapo`` script, ``python -m nemo_dapo.cli``) are guarded the same way.
``os.fork`` raises here: megatron-core's own writer forks from the multi-threaded rank, which can hang
(nemo_dapo/megatron/dist_save.py); the conversion writes in-process instead."""
import sys


def run() -> int:
    from tests.support import nemo_cpu  # CPU patches first: this torch has no CUDA
    from tests.support.dist import forbid_fork

    nemo_cpu.allow_full_checkpoint_loads()
    forbid_fork()  # the checkpoint writer must write in this process
    from nemo_dapo.cli import main

    return main(["convert", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(run())
