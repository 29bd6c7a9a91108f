"""Worker (2 ranks, gloo, no NeMo): AlignerEngineGenerator's results exchange (engine_generation.broadcast_generation)
over one model-parallel group. Each case gives the owners parts of different widths (with and without log-probs,
one of 0 rows), and the groups of stream_requests (cut-short samples, a group without requests); every rank writes
what its generator returned. Env: OUT_DIR. Writes exchange_rank<r>.json."""
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


class Stream:
    """A finished GroupStream: (key, Generation) of the groups that had requests, and the tokens generated."""

    def __init__(self, parts: dict, tokens: int):
        self.parts, self.generated_tokens = parts, tokens

    def __iter__(self):
        return iter(sorted(self.parts.items()))


def group_part(owner: int, key: int, rows: int, width: int) -> Generation:
    """Owner ``owner``'s samples of its group ``key``, some cut short (``finished`` False)."""
    gen = part(owner + 7 * key, rows, width, True)
    gen.finished = torch.arange(rows) % 2 == key % 2
    return gen


# owner -> {local key: (rows, width)} of the groups it was given; a key left out had no requests (nothing comes back)
STREAM_SPEC = {0: {0: (2, 3), 1: (1, 5)}, 1: {0: (3, 2), 2: (1, 4)}}
N_GROUPS = 5  # split over the two owners as [0, 2) and [2, 5)


class StreamingEngine(Engine):
    """Stands in for an owner's EngineGenerator.stream_requests: checks the groups it was given, returns its parts."""

    def __init__(self, owner: int):
        super().__init__(None)
        self.owner = owner

    def stream_requests(self, groups, *, temperature, top_p):
        lo = 0 if self.owner == 0 else 2
        assert groups == [[([g], 1, 4, g)] for g in range(lo, lo + len(groups))], groups
        parts = {k: group_part(self.owner, k, *shape) for k, shape in STREAM_SPEC[self.owner].items()}
        return Stream(parts, tokens=100 + self.owner)


def stream_case(rank: int) -> dict:
    gen = AlignerEngineGenerator(actor=None, engine=StreamingEngine(rank), owners=[0, 1], mp_group=dist.group.WORLD,
                                 hf_config=None, pad_id=PAD)
    stream = gen.stream_requests([[([g], 1, 4, g)] for g in range(N_GROUPS)], first_key=10)
    got = dict(stream)
    expected = {}
    for owner, lo in ((0, 0), (1, 2)):
        for k, shape in STREAM_SPEC[owner].items():
            expected[10 + lo + k] = group_part(owner, k, *shape)
    out = {"got": {}, "expected": {}, "padding_only": [], "tokens": stream.generated_tokens}
    for k, g in got.items():  # a group comes back right-padded to its owner's widest: the extra columns are padding
        w = expected[k].response_ids.shape[1] if k in expected else 0
        out["padding_only"].append(bool((g.response_mask[:, w:] == 0).all() and (g.response_ids[:, w:] == PAD).all()))
        cut = Generation(g.response_ids[:, :w], g.response_mask[:, :w], g.truncated, g.logprobs[:, :w])
        out["got"][k] = dict(as_lists(cut), finished=g.finished.tolist())
    out["expected"] = {k: dict(as_lists(g), finished=g.finished.tolist()) for k, g in expected.items()}
    return out


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
    out["stream_requests"] = stream_case(rank)
    with open(os.path.join(os.environ["OUT_DIR"], f"exchange_rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
