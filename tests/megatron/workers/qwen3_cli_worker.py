"""torchrun worker: ``nemo-dapo convert`` itself (cli.main) on 2 ranks; argv after the script are its arguments.
The CPU patches are loaded first (this torch has no CUDA; megatron-core's checkpoint writer synchronises CUDA)."""
import sys

from tests.support import nemo_cpu  # noqa: F401

nemo_cpu.allow_full_checkpoint_loads()
from nemo_dapo.cli import main  # noqa: E402

sys.exit(main(["convert", *sys.argv[1:]]))
