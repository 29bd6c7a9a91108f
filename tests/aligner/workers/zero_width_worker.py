"""Worker (2 ranks, gloo, no NeMo): engine_generation.broadcast_generation of an owner's part whose rows hold no
response token yet (width 0: e.g. the samples of a round cut before their first token), with its ``truncated`` and
``finished`` flags. Env: OUT_DIR. Writes zero_width_rank<r>.json: the flags each rank got."""
import json
import os

import torch
import torch.distributed as dist

from nemo_dapo.aligner.engine_generation import broadcast_generation
from nemo_dapo.core.types import Generation


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    part = None
    if rank == 0:  # the owner
        part = Generation(response_ids=torch.zeros(3, 0, dtype=torch.long), response_mask=torch.zeros(3, 0),
                          truncated=torch.tensor([True, False, False]), logprobs=torch.zeros(3, 0),
                          finished=torch.tensor([False, False, True]))
    got = broadcast_generation(part, 0, dist.group.WORLD)
    out = {"shape": list(got.response_ids.shape), "truncated": got.truncated.tolist(),
           "finished": None if got.finished is None else got.finished.tolist()}
    with open(os.path.join(os.environ["OUT_DIR"], f"zero_width_rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
