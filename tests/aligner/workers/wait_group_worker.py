"""Worker (2 ranks, gloo, no NeMo): where the NeMo-Aligner path's ranks wait for engines (core/collective.py).

Each case records, per rank, when (seconds after a common start) it entered each collective and on which group: the
generator's results exchange with a slow owner (``generate``, and ``stream_requests`` with two owners), an owner's slow
engine sleep, and DPReducer.gather_objects with a slow replica, each with its gloo twin (``cpu_wait_group``) and
without one (the control: the exchange's first broadcast starts at once). Also the twins' ranks and backend, a
twin's time-out, and a refit whose owner's engine stops answering. Env: OUT_DIR. Writes waits_rank<r>.json."""
import datetime
import json
import os
import time

import torch
import torch.distributed as dist

from nemo_dapo.aligner.engine_generation import AlignerEngineGenerator
from nemo_dapo.core.collective import cpu_wait_group
from nemo_dapo.core.types import Generation
from nemo_dapo.engines.base import EngineError
from nemo_dapo.megatron.reduction import DPReducer

DELAY = 1.5  # seconds the slow rank's engine (or share) takes
CALLS = []
START = [0.0]


def recorded(name, fn):
    def call(*args, **kwargs):
        CALLS.append((name, round(time.monotonic() - START[0], 3), kwargs.get("group")))
        return fn(*args, **kwargs)
    return call


for _name in ("broadcast", "barrier", "all_gather_object", "all_reduce"):
    setattr(dist, _name, recorded(_name, getattr(dist, _name)))


def begin() -> None:
    dist.barrier()
    CALLS.clear()
    START[0] = time.monotonic()


def record(wait) -> list:
    return [(name, t, None if group is None else ("wait" if group is wait else "data")) for name, t, group in CALLS]


def gen(rows: int) -> Generation:
    return Generation(response_ids=torch.arange(rows * 3).view(rows, 3), response_mask=torch.ones(rows, 3),
                      truncated=torch.zeros(rows, dtype=torch.bool), logprobs=-torch.ones(rows, 3))


class SlowEngine:
    """An owner's EngineGenerator whose generation takes ``delay`` seconds."""

    def __init__(self, delay: float):
        self.delay = delay

    def generate(self, prompt_ids, prompt_mask, **kw):
        time.sleep(self.delay)
        return gen(prompt_ids.shape[0])

    def stream_requests(self, groups, *, temperature, top_p):
        delay = self.delay

        class Stream:
            generated_tokens = 3 * len(groups)

            def __iter__(self):
                time.sleep(delay)
                return iter([(k, gen(1)) for k in range(len(groups))])
        return Stream()

    def sleep(self):
        time.sleep(self.delay)

    def idle_seconds(self):
        return 0.0


class StuckRefitEngine:
    """An owner's EngineGenerator whose engine stops answering after the first weight bucket: what its client raises
    after ``weight_timeout_s`` (tests/engines/test_protocol.py shows the deadline)."""
    asleep, bucket_bytes = False, 1 << 20

    def update_weights(self, buckets, wake=True):
        next(iter(buckets))
        raise EngineError("engine 'stuck' did not answer 'update_weights' within 300 s")

    def idle_seconds(self):
        return 0.0


class GatheredWeights:
    """The refit gather's face: every bucket costs a collective of the model-parallel group, as megatron's does."""
    buckets = 4

    def hf_weight_buckets(self, bucket_bytes):
        for k in range(self.buckets):
            t = torch.ones(1)
            dist.all_reduce(t)
            yield [(f"w{k}", t)]


def refit_case() -> dict:
    """The refit with a stuck owner's engine: both ranks finish the gather's collectives in step, then raise."""
    g = AlignerEngineGenerator(actor=None, engine=StuckRefitEngine() if dist.get_rank() == 0 else None, owners=[0],
                               mp_group=dist.group.WORLD, hf_config=None, pad_id=0)
    g._weights = GatheredWeights()
    begin()
    try:
        g.update_weights()
        raised = None
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        raised = f"{type(e).__name__}: {e}"
    return {"raised": raised, "all_reduces": sum(1 for name, _, _ in CALLS if name == "all_reduce"),
            "after_s": time.monotonic() - START[0]}


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.group.WORLD
    out = {}
    twin = cpu_wait_group(world)
    singles = [dist.new_group([r]) for r in (0, 1)]
    single_twin = cpu_wait_group(singles[rank])
    out["twin"] = {"ranks": dist.get_process_group_ranks(twin), "backend": str(dist.get_backend(twin)),
                   "single": dist.get_process_group_ranks(single_twin)}
    for name, wait in (("generate", twin), ("generate_control", None)):
        g = AlignerEngineGenerator(actor=None, engine=SlowEngine(DELAY) if rank == 0 else None, owners=[0],
                                   mp_group=world, hf_config=None, pad_id=0, wait_group=wait)
        begin()
        got = g.generate(torch.ones(4, 2, dtype=torch.long), torch.ones(4, 2), max_new_tokens=3)
        out[name] = {"calls": record(wait), "rows": got.response_ids.shape[0]}
    for name, wait in (("sleep", twin), ("sleep_control", None)):
        g = AlignerEngineGenerator(actor=None, engine=SlowEngine(DELAY) if rank == 0 else None, owners=[0],
                                   mp_group=world, hf_config=None, pad_id=0, wait_group=wait)
        begin()
        g.sleep()
        out[name] = {"calls": record(wait), "returned_s": time.monotonic() - START[0]}
    g = AlignerEngineGenerator(actor=None, engine=SlowEngine(DELAY if rank == 0 else 0.0), owners=[0, 1],
                               mp_group=world, hf_config=None, pad_id=0, wait_group=twin)
    begin()
    got = dict(g.stream_requests([[([1], 1, 3, 0)] for _ in range(4)]))
    out["stream"] = {"calls": record(twin), "groups": sorted(got)}
    for name, wait in (("gather", twin), ("gather_control", None)):
        reducer = DPReducer(world, wait_group=wait)
        begin()
        if rank == 1:
            time.sleep(DELAY)  # this replica's share takes longer
        gathered = reducer.gather_objects(rank)
        out[name] = {"calls": record(wait), "gathered": gathered}
    out["refit"] = refit_case()
    short = dist.new_group([0, 1], backend="gloo", timeout=datetime.timedelta(seconds=1))
    begin()
    if rank == 1:
        time.sleep(3.0)
    t0 = time.monotonic()
    try:
        dist.barrier(group=short)
        out["timeout"] = {"raised": None}
    except RuntimeError as e:
        out["timeout"] = {"raised": f"{type(e).__name__}: {e}"[:300], "after_s": time.monotonic() - t0}
    with open(os.path.join(os.environ["OUT_DIR"], f"waits_rank{rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
