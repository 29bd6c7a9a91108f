"""Worker (2 ranks, gloo, no NeMo): AlignerEngineGenerator's results exchange (engine_generation.broadcast_generation)
over one model-parallel group. Each case gives the owners parts of different widths (with and without log-probs,
one of 0 rows); every rank writes what its generator returned. Env: OUT_DIR. Writes exchange_rank<r>.json."""
import json
import os

import torch
import torch.distributed as dist

from nemo_dapo.aligner.engine_generation import AlignerEngineGenerator
from nemo_dapo.core.types import Generation

PAD = 0


def part(rank: int, rows: int, width: int, logprobs: bool) -> Generation:
    g = torch.Generator().manual_seed(10 * rank + rows + width)
    ids = torch.randint(3, 1 << 40, (rows, width), generator=g)  # ids above 2^32: int64 end to end
    mask = (torch.rand(rows, width, generator=g) > 0.3).float()
    return Generation(response_ids=ids, response_mask=mask, truncated=torch.rand(rows, generator=g) > 0.5,
                      logprobs=-torch.rand(rows, width, generator=g) if logprobs else None)


def as_lists(gen: Generation) -> dict:
    return {"ids": gen.response_ids.tolist(), "mask": gen.response_mask.tolist(), "truncated": gen.truncated.tolist(),
            "logprobs": None if gen.logprobs is None else gen.logprobs.tolist()}


class Engine:
    """Stands in for this rank's EngineGenerator: returns its fixed part."""

    def __init__(self, gen):
        self.gen = gen

    def generate(self, prompt_ids, prompt_mask, **kw):
        return self.gen

    def idle_seconds(self):  # EngineGenerator's (the generator exposes it on the owners)
        return 0.0


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cases = {"two_owners": ([0, 1], {0: (3, 5, True), 1: (2, 7, True)}),
             "no_logprobs": ([0, 1], {0: (2, 4, False), 1: (2, 6, False)}),
             "one_owner": ([0], {0: (4, 3, True)}),
             "empty_part": ([0, 1], {0: (0, 0, True), 1: (3, 2, True)})}
    out = {}
    for name, (owners, spec) in cases.items():
        mine = part(rank, *spec[rank]) if rank in owners else None
        gen = AlignerEngineGenerator(actor=None, engine=Engine(mine) if mine is not None else None, owners=owners,
                                     mp_group=dist.group.WORLD, hf_config=None, pad_id=PAD)
        rows = sum(spec[o][0] for o in owners)
        got = gen.generate(torch.ones(rows, 2, dtype=torch.long), torch.ones(rows, 2), max_new_tokens=8)
        expected = Generation.cat([part(o, *spec[o]) for o in owners], PAD)
        out[name] = {"got": as_lists(got), "expected": as_lists(expected),
                     "dtypes": [str(got.response_ids.dtype), str(got.response_mask.dtype), str(got.truncated.dtype)]}
    with open(os.path.join(os.environ["OUT_DIR"], f"exchange_rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
