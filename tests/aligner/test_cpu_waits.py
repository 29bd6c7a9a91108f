"""Where the NeMo-Aligner path's ranks wait for engines: on the CPU, in a gloo twin of their group
(core.collective.cpu_wait_group), not inside an NCCL collective, where a waiting rank spins a kernel on the GPU a
colocated engine computes on and NCCL's watchdog ends it at the group's time-out (30 minutes under NeMo). Two gloo
ranks (tests/aligner/workers/wait_group_worker.py); each wait has a control without the twin, which fails the same
assertions."""
import json
from pathlib import Path

import pytest

from tests.support.dist import run_torchrun

ROOT = Path(__file__).resolve().parents[2]
DELAY = 1.5  # the worker's slow rank


@pytest.fixture(scope="module")
def waits(tmp_path_factory):
    out = tmp_path_factory.mktemp("waits")
    run_torchrun(ROOT / "tests/aligner/workers/wait_group_worker.py", nproc=2, out_dir=out)
    return [json.loads((out / f"waits_rank{r}.json").read_text()) for r in (0, 1)]


def first(calls, name, group="data"):
    return min(t for n, t, g in calls if n == name and g == group)


def test_a_twin_has_the_groups_ranks_over_gloo(waits):
    for rank, out in enumerate(waits):
        assert out["twin"] == {"ranks": [0, 1], "backend": "gloo", "single": [rank]}


def test_the_other_ranks_wait_for_a_slow_owner_on_the_cpu_then_exchange(waits):
    other = waits[1]["generate"]["calls"]
    assert first(other, "barrier", "wait") < 0.5  # waiting from the start, in the twin
    assert first(other, "broadcast") >= 0.8 * DELAY  # the NCCL exchange only once the owner has its part
    assert waits[1]["generate"]["rows"] == 4
    assert first(waits[1]["generate_control"]["calls"], "broadcast") < 0.5  # without the twin: inside the exchange


def test_an_owner_done_early_waits_for_the_other_owners_stream_on_the_cpu(waits):
    fast_owner = waits[1]["stream"]["calls"]
    assert first(fast_owner, "barrier", "wait") < 0.5 and first(fast_owner, "broadcast") >= 0.8 * DELAY
    assert waits[0]["stream"]["groups"] == waits[1]["stream"]["groups"] == [0, 1, 2, 3]


def test_the_other_ranks_leave_sleep_once_the_owner_has_put_its_engine_to_sleep(waits):
    other = waits[1]["sleep"]
    assert first(other["calls"], "barrier", "wait") < 0.5 and other["returned_s"] >= 0.8 * DELAY
    assert waits[1]["sleep_control"]["returned_s"] < 0.5  # without the twin: straight on to the training


def test_a_replica_done_early_waits_for_the_others_on_the_cpu_before_the_gather(waits):
    early = waits[0]["gather"]["calls"]
    assert first(early, "barrier", "wait") < 0.5 and first(early, "all_gather_object") >= 0.8 * DELAY
    assert waits[0]["gather"]["gathered"] == waits[1]["gather"]["gathered"] == [0, 1]
    assert first(waits[0]["gather_control"]["calls"], "all_gather_object") < 0.5


def test_a_twins_time_out_is_its_own(waits):
    timed_out = waits[0]["timeout"]
    assert timed_out["raised"] is not None and timed_out["after_s"] < 2.9  # 1 s, not the partner's 3 s late arrival


def test_a_refit_whose_engine_stops_answering_ends_on_every_rank_with_the_gather_drained(waits):
    """The owner's client gives up after ``weight_timeout_s`` (short: the others wait in the gather's collectives
    meanwhile); the owner then finishes the gather in step, and every rank raises instead of hanging."""
    owner, other = waits[0]["refit"], waits[1]["refit"]
    assert owner["raised"].startswith("EngineError: engine 'stuck' did not answer")
    assert other["raised"].startswith("RuntimeError: an engine weight update failed on another rank")
    assert owner["all_reduces"] == other["all_reduces"] == 4 + 1  # every bucket's collective, then the failure flag
    assert max(owner["after_s"], other["after_s"]) < 10
