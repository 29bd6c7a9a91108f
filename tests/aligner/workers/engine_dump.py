"""A test engine for ``python -m nemo_dapo.engines.server --engine
tests.aligner.workers.engine_dump:DumpingEngine.from_path``: the local engine, which also writes its whole state dict (HF names) to ``$ENGINE_DUMP_DIR/update<k>.pt`` after each
complete weight update, so a test can compare the engine's weights with the trainer's."""
import os

import torch

from nemo_dapo.engines.local import LocalEngine


class DumpingEngine(LocalEngine):
    updates = 0

    def finish_weights(self) -> None:
        super().finish_weights()
        type(self).updates += 1
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        torch.save(state, os.path.join(os.environ["ENGINE_DUMP_DIR"], f"update{type(self).updates}.pt"))
