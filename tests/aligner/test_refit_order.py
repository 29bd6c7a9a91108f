"""The memory phases of a colocated step (aligner/engine_generation.py, module doc): contract tests with a fake
engine client and a fake GPU.

A GPU cannot run here, so the device is a ledger (``FakeGPU``): each allocation is named, the total is checked
against a budget after every change (over it is an out-of-memory error), and every call of the engine client, the
actor and the allocator is recorded. The code under test is real: ``core.loop.DAPOLoop.step`` (the phase order:
sleep, updates, update_weights, generate), ``AlignerEngineGenerator`` (refit: optimizer offload, release of the
training peak, the refit with the KV cache asleep) and ``engines.generator.EngineGenerator`` (sleep / wake).

The sizes (GB) are those of one H100 of a Qwen2.5-32B recipe in round numbers: resident training state (bf16
weights + fp32 gradient buffer) 24.6, Adam states (fp32 exp_avg, exp_avg_sq, master shard) 16.4, the training peak
left in the caching allocator 21.5, the engine's weights 8.2, its KV cache 38, the refit's transient buffers
(trainer-side gather + engine-side copy) 8. Budget 76: every phase fits only in the order of the module doc.
"""
import itertools

import pytest
import torch
import torch.distributed as dist

from nemo_dapo.aligner import engine_generation as eg
from nemo_dapo.engines.base import Completion, EngineError, Sample
from nemo_dapo.engines.generator import EngineGenerator
from tests.core.test_loop import make_loop

GB = {"training_state": 24.6, "adam": 16.4, "training_peak": 21.5, "engine_weights": 8.2, "kv_cache": 38.0,
      "refit_buffers": 8.0}
BUDGET = 76.0
EOS = 2


class FakeOOM(RuntimeError):
    pass


class FakeGPU:
    """Named allocations on one GPU; ``events`` records every call in order (what the order tests compare)."""

    def __init__(self, budget=BUDGET):
        self.budget, self.held, self.events, self.peak = budget, {}, [], 0.0

    def alloc(self, name, gb=None):
        self.held[name] = GB[name] if gb is None else gb
        total = sum(self.held.values())
        self.peak = max(self.peak, total)
        if total > self.budget + 1e-9:
            raise FakeOOM(f"{total:.1f} GB > {self.budget} GB holding {sorted(self.held)} (at {name})")

    def free(self, name):
        self.held.pop(name, None)

    def note(self, event):
        self.events.append(event)


class FakeClient:
    """The ``EngineClient`` face ``EngineGenerator`` and ``refit_wake`` use. ``releases``: what each sleep level
    frees ("kv_cache", "weights"); ``wake_tags``: whether the server wakes weights alone (None: an old server
    whose hello says neither)."""

    def __init__(self, gpu, releases=None, wake_tags=("weights", "kv_cache")):
        self.gpu, self.name = gpu, "fake@test"
        self.info = {} if releases is None else {"sleep_releases": releases, "wake_tags": list(wake_tags or ())}
        self._releases = releases or {"1": ["kv_cache"], "2": ["kv_cache", "weights"]}
        self.sleeping, self.released, self.queue = False, set(), []
        self.updates, self.held_at_submit = 0, set()
        gpu.alloc("engine_weights")
        gpu.alloc("kv_cache")

    def sleep(self, level):
        self.gpu.note(f"sleep:{level}")
        self.sleeping = True
        for tag in self._releases[str(level)]:
            self.released.add(tag)
            self.gpu.free("engine_weights" if tag == "weights" else tag)

    def _wake(self, tags):
        for tag in tags:
            if tag in self.released:
                self.released.discard(tag)
                self.gpu.alloc("engine_weights" if tag == "weights" else tag)

    def wake(self, tags=None):
        if tags is not None:
            assert list(tags) == ["weights"], tags
            self.gpu.note("wake:weights")
            self._wake(["weights"])
            return
        self.gpu.note("wake")
        self._wake(["weights", "kv_cache"])
        self.sleeping = False

    def update_weights(self, buckets):
        self.gpu.note("update_weights")
        if "weights" in self.released:
            raise EngineError("fake engine: weights written while released (a sleeping engine's memory)")
        n = 0
        for bucket in buckets:
            self.gpu.alloc("refit_buffers")  # the bucket in flight on both sides
            n += len(bucket)
        self.gpu.free("refit_buffers")
        self.updates += 1
        return {"buckets": 1, "tensors": n, "bytes": 0}

    def submit(self, requests):
        self.gpu.note("submit")
        if self.sleeping or self.released:
            raise EngineError("fake engine: asleep; send wake before submitting requests")
        self.held_at_submit.add(tuple(sorted(self.gpu.held)))
        for r in requests:
            toks = [3 + (r.seed + k) % 40 for k in range(1 + r.seed % r.max_new_tokens)]
            self.queue.append(Completion(r.id, [Sample(toks, [-0.5] * len(toks), "length")]))

    def next_completion(self, timeout_s=None):
        return self.queue.pop(0)

    def idle_seconds(self):  # EngineClient's: a clock that advances 0.25 s per reading here
        self.idle_reads = getattr(self, "idle_reads", 0) + 1
        return 0.25 * self.idle_reads


class FakeActor:
    """NeMo-Aligner actor's offload / onload pair (megatron_gpt_ppo_actor.py) on the ledger. The Adam states reach
    the GPU at the first update (the start-up, before the first push, is not modelled)."""

    def __init__(self, gpu):
        self.gpu, self._optimizer, self.distributed_adam_offload_manager = gpu, object(), None
        gpu.alloc("training_state")

    def offload_adam_states(self):
        self.gpu.note("offload_adam")
        self.distributed_adam_offload_manager = "entered"
        self.gpu.free("adam")

    def prepare_for_training(self):  # onload_adam_states
        if "adam" not in self.gpu.held:
            self.gpu.note("onload_adam")
            self.gpu.alloc("adam")
        self.distributed_adam_offload_manager = None


class LedgerPolicy:
    """The loop's Policy as ActorPolicy behaves on the GPU: updates onload the optimizer and leave the training
    peak cached in the allocator until something empties the cache."""

    def __init__(self, gpu, actor):
        self.gpu, self.actor, self.version = gpu, actor, 0

    def logprobs(self, batch):
        self.gpu.note("logprobs")
        self.gpu.alloc("training_peak")
        mask = batch.response_mask
        return -0.5 * mask, mask.clone()

    def train_step(self, minibatch, *, norm, loss_fn):
        self.actor.prepare_for_training()
        self.gpu.note("train_step")
        self.gpu.alloc("training_peak")
        self.version += 1
        return {"loss": 0.0, "skipped": 0.0}

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class LedgerWeights:
    def hf_weight_buckets(self, bucket_bytes):
        return iter([[("model.embed_tokens.weight", torch.zeros(2, 2))], [("lm_head.weight", torch.zeros(2, 2))]])


@pytest.fixture
def world_of_one(tmp_path):
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    if started:
        dist.destroy_process_group()


@pytest.fixture
def gpu(monkeypatch):
    """The ledger, with torch.cuda.empty_cache (release_training_memory) emptying its cached training peak."""
    ledger = FakeGPU()

    def empty_cache():
        ledger.note("empty_cache")
        ledger.free("training_peak")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    eg._warned_servers.clear()
    return ledger


def colocated_loop(gpu, *, sleep_level=1, **client_kw):
    actor = FakeActor(gpu)
    client = FakeClient(gpu, **client_kw)
    engine = EngineGenerator(client, eos_id=EOS, pad_id=0, sleep_level=sleep_level)
    gen = eg.AlignerEngineGenerator(actor, engine, owners=[0], mp_group=None, hf_config=None, pad_id=0)
    gen._weights = LedgerWeights()
    gen.push_initial_weights()  # as build_engine_generator does
    policy = LedgerPolicy(gpu, actor)
    return make_loop(generator=gen, policy=policy, groups=4, group_size=2, mini=4, max_new_tokens=6), gen, client


def _phases(events):
    """The events of the first step from the engine's sleep to the next step's generation, repeats folded."""
    start = [i for i, e in enumerate(events) if e.startswith("sleep:")][1]  # [0]: before the first push
    end = events.index("submit", start)
    return [k for k, _ in itertools.groupby(events[start:end + 1])]


TRTLLM_LIKE = {"1": ["kv_cache"], "2": ["kv_cache", "weights"]}  # level 1 keeps the weights resident
VLLM_LIKE = {"1": ["kv_cache", "weights"], "2": ["kv_cache", "weights"]}  # level 1 offloads the weights too


@pytest.mark.parametrize("releases, level, wake, order", [
    (TRTLLM_LIKE, 1, eg.ASLEEP, ["sleep:1", "logprobs", "onload_adam", "train_step", "offload_adam", "empty_cache",
                                 "update_weights", "wake", "submit"]),
    (TRTLLM_LIKE, 2, eg.WEIGHTS_WOKEN, ["sleep:2", "logprobs", "onload_adam", "train_step", "offload_adam",
                                        "empty_cache", "wake:weights", "update_weights", "wake", "submit"]),
    (VLLM_LIKE, 1, eg.WEIGHTS_WOKEN, ["sleep:1", "logprobs", "onload_adam", "train_step", "offload_adam",
                                      "empty_cache", "wake:weights", "update_weights", "wake", "submit"]),
])
def test_refit_runs_with_the_kv_cache_asleep_and_every_phase_fits(world_of_one, gpu, releases, level, wake, order):
    loop, gen, client = colocated_loop(gpu, sleep_level=level, releases=releases)
    for _ in range(2):
        loop.step()
    assert gen.last_refit_wake == wake
    assert client.updates == 3  # the first push and one refit per step
    assert _phases(gpu.events) == order
    assert gpu.peak <= BUDGET
    # every generation runs beside the resident training state only: Adam states and the training peak are gone
    assert client.held_at_submit == {("engine_weights", "kv_cache", "training_state")}


def test_the_old_order_does_not_fit(world_of_one, gpu):
    # A server whose hello does not say what its sleep releases is woken whole before the refit (the behaviour
    # before this order): its KV cache then sits beside the refit's buffers and the fake GPU runs out.
    with pytest.raises(RuntimeError, match="GB > 76"):
        colocated_loop(gpu, releases=None)  # already the first push
    assert gpu.events == ["sleep:1", "offload_adam", "empty_cache", "wake", "update_weights"]


def test_a_server_that_cannot_wake_weights_alone_is_woken_whole(world_of_one, gpu, caplog):
    gpu.budget = 200.0  # only the order is under test here
    loop, gen, client = colocated_loop(gpu, sleep_level=2, releases=TRTLLM_LIKE, wake_tags=())
    loop.step()
    loop.step()
    assert gen.last_refit_wake == eg.ALL_WOKEN
    assert _phases(gpu.events)[-4:] == ["empty_cache", "wake", "update_weights", "submit"]
    assert "woken whole before each refit" in caplog.text


@pytest.mark.parametrize("skip", ["offload_adam_states", "release_training_memory"])
def test_generation_does_not_fit_beside_the_training_memory(world_of_one, gpu, monkeypatch, skip):
    # without the optimizer offload or without emptying the cache, waking the KV cache for generation runs out
    monkeypatch.setattr(eg, "offload_optimizer_states" if skip == "offload_adam_states" else skip, lambda *a: None)
    loop, gen, client = colocated_loop(gpu, releases=TRTLLM_LIKE)
    loop.step()
    with pytest.raises(RuntimeError, match="GB > 76"):
        loop.step()
    assert gpu.events[-1] == "wake"  # the KV cache, woken for the first generation after training


def test_a_failing_weights_wake_is_raised_after_the_gather_is_drained(world_of_one, gpu):
    loop, gen, client = colocated_loop(gpu, sleep_level=2, releases=TRTLLM_LIKE)
    gen.sleep()

    def broken(tags=None):
        raise EngineError("fake engine: wake refused")

    client.wake = broken
    drained = []
    gen._weights = type("W", (), {"hf_weight_buckets": lambda self, b: (drained.append(i) or [] for i in range(3))})()
    with pytest.raises(EngineError, match="wake refused"):
        gen.update_weights()
    assert drained == [0, 1, 2]  # every bucket of the gather ran (the other ranks' collectives complete)


def test_the_engine_idle_time_is_logged_on_a_rank_that_owns_an_engine_and_only_there(world_of_one, gpu):
    gpu.budget = 200.0
    loop, gen, client = colocated_loop(gpu, releases=TRTLLM_LIKE)
    metrics = loop.step()
    assert metrics["timing/engine_idle_s"] == 0.25  # the client's clock read at the step's start and end
    assert metrics["timing/engine_idle_frac"] == pytest.approx(0.25 / metrics["timing/step_s"])
    owner_less = eg.AlignerEngineGenerator(FakeActor(gpu), None, owners=[1], mp_group=None, hf_config=None, pad_id=0)
    assert not hasattr(owner_less, "idle_seconds")  # no client: no number (the loop then logs none)


class LedgerOffload:
    """``StateOffload``'s face (offload(parts), onload, offloaded_parts) recording its moves on the ledger."""

    def __init__(self, gpu):
        self.gpu, self.parts = gpu, []

    @property
    def offloaded_parts(self):
        return tuple(self.parts)

    def offload(self, parts):
        self.gpu.note("offload:" + "+".join(parts))
        self.parts += [p for p in parts if p not in self.parts]
        return 0

    def onload(self):
        self.gpu.note("onload")
        self.parts = []
        return 0


class NotedWeights:
    """The refit's gather, noting each bucket as the engine reads it."""

    def __init__(self, gpu):
        self.gpu = gpu

    def hf_weight_buckets(self, bucket_bytes):
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            self.gpu.note("gather")
            yield [(name, torch.zeros(2, 2))]


def test_the_training_state_leaves_around_the_refit_and_comes_back_after_the_engine_sleeps(world_of_one, gpu):
    # model.dapo.offload_training_state: grads and optimizer states leave BEFORE the gather (it reads the weights),
    # the weights after it; the next sleep frees the KV cache first, then onloads everything
    gpu.budget = 200.0  # only the order is under test here
    client = FakeClient(gpu, releases=TRTLLM_LIKE)
    offload = LedgerOffload(gpu)
    actor = FakeActor(gpu)
    gen = eg.AlignerEngineGenerator(actor, EngineGenerator(client, eos_id=EOS, pad_id=0, sleep_level=1), owners=[0],
                                    mp_group=None, hf_config=None, pad_id=0, training_offload=offload)
    gen._weights = NotedWeights(gpu)
    assert actor.training_state_offload is offload  # ActorPolicy's guard (onload_for_use) reads it there
    gen.update_weights()
    assert [e for e in gpu.events if e.startswith(("offload:", "gather"))] == [
        "offload:grads+optimizer", "gather", "gather", "offload:weights"]
    assert offload.offloaded_parts == ("grads", "optimizer", "weights")
    gen.sleep()
    assert gpu.events[-2:] == ["sleep:1", "onload"] and offload.offloaded_parts == ()


def test_the_actor_onloads_a_state_still_offloaded_before_using_it(gpu, caplog):
    from nemo_dapo.aligner.training_offload import onload_for_use

    offload = LedgerOffload(gpu)
    actor = type("Actor", (), {"training_state_offload": offload})()
    onload_for_use(actor)
    assert "onload" not in gpu.events  # nothing offloaded: nothing moves
    offload.offload(("grads", "optimizer"))
    onload_for_use(actor)
    assert gpu.events[-1] == "onload" and offload.offloaded_parts == ()
    assert "was still offloaded when the actor needed it" in caplog.text
