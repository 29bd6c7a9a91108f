"""The trainer's mapping from trainer.dapo / model.dapo(.algorithm) to the shared step loop's settings and batch
filler."""
import pytest
from omegaconf import OmegaConf

from tests.aligner.conftest import needs_nemo

pytestmark = [needs_nemo, pytest.mark.nemo]


def _cfgs(**algorithm_over):
    """(trainer.dapo, model) of conf/gpt_dapo_actor.yaml at the paper's lengths, with ``algorithm_over`` merged into
    model.dapo.algorithm."""
    from nemo_dapo.cluster.config_load import load_config

    a = "model.dapo.algorithm."
    cfg = load_config(None, ["model.dapo.length_params.max_length=20480", "model.encoder_seq_length=22528",
                             f"{a}overlong.l_cache=4096", "trainer.dapo.seed=3",
                             f"{a}dynamic_sampling.prior_pass_rate=0.4", f"{a}dynamic_sampling.safety=1.2"])
    cfg.model.dapo.algorithm = OmegaConf.merge(cfg.model.dapo.algorithm, OmegaConf.create(algorithm_over))
    return cfg.trainer.dapo, cfg.model


def test_loop_settings_follow_the_paper_recipe():
    from nemo_dapo.aligner.trainer import aligner_loop_parts

    s = aligner_loop_parts(*_cfgs())[0]
    assert (s.group_size, s.mini_batch_size, s.max_new_tokens, s.overlong.l_cache, s.seed) == (16, 512, 20480, 4096, 3)
    assert s.overlong.enabled and s.temperature == 1.0


def test_overlong_l_max_must_be_the_generation_cap():
    from nemo_dapo.aligner.trainer import aligner_loop_parts

    with pytest.raises(ValueError, match="model.dapo.algorithm.overlong.l_max"):
        aligner_loop_parts(*_cfgs(overlong={"l_max": 16384}))[0]


def test_greedy_sampling_maps_to_temperature_zero():
    from nemo_dapo.aligner.trainer import aligner_loop_parts

    trainer, model = _cfgs()
    model.dapo.sampling_params.use_greedy = True
    assert aligner_loop_parts(trainer, model)[0].temperature == 0.0


def test_rollout_mode_maps_abort_to_blocking_batches_and_suspend_to_rounds_in_prompt_order():
    from nemo_dapo.aligner.trainer import aligner_loop_parts, partial_rollout_args

    trainer, model = _cfgs()
    s = aligner_loop_parts(trainer, model)[0]  # the YAML's default
    assert (s.streaming, s.on_filler_full, s.fill_order) == (False, "abort", "finish")
    trainer.rollout.on_filler_full, trainer.rollout.round_tokens = "suspend", 512
    s = aligner_loop_parts(trainer, model)[0]
    assert (s.streaming, s.on_filler_full, s.fill_order) == (True, "suspend", "prompt")
    assert partial_rollout_args(trainer) == {"max_staleness": 1, "round_tokens": 512, "overlap": False}
    trainer.rollout.overlap = "yes"
    with pytest.raises(ValueError, match=r"trainer.dapo.rollout.overlap='yes' must be true or false"):
        partial_rollout_args(trainer)
    trainer.rollout.on_filler_full = "finish"
    with pytest.raises(ValueError, match=r"trainer.dapo.rollout.on_filler_full='finish' must be one of"):
        aligner_loop_parts(trainer, model)


def test_batch_filler_takes_every_dynamic_sampling_key():
    from nemo_dapo.aligner.trainer import aligner_loop_parts

    f = aligner_loop_parts(*_cfgs())[1]
    assert (f.num_groups, f.enabled, f.max_gen_batches, f.on_budget_exhausted) == (512, True, 10, "train_partial")
    assert (f.max_gen_batch_size, f.prior_pass_rate, f.safety) == (1536, 0.4, 1.2)
    assert not aligner_loop_parts(*_cfgs(dynamic_sampling={"enabled": False}))[1].enabled


@pytest.mark.parametrize("key", ["model.dapo.algorithm.adv_eps", "model.dapo.algorithm.dynamic_sampling.safety",
                                 "model.dapo.algorithm.overlong.l_cache", "model.dapo.algorithm.eps_high",
                                 "model.dapo.algorithm.tis_cap", "model.dapo.algorithm.group_size",
                                 "model.dapo.algorithm.dynamic_sampling.skip_history.max_skips",
                                 "trainer.dapo.shuffle_minibatches", "trainer.dapo.seed",
                                 "trainer.dapo.rollout.on_filler_full"])
def test_a_missing_key_is_an_error_naming_it(key):
    from nemo_dapo.cluster.config_validate import ConfigError
    from nemo_dapo.aligner.trainer import aligner_loop_parts

    trainer, model = _cfgs()
    root = {"trainer.dapo": trainer, "model": model}
    head = "trainer.dapo" if key.startswith("trainer.dapo.") else "model"
    parent, _, leaf = key[len(head) + 1:].rpartition(".")
    node = OmegaConf.select(root[head], parent) if parent else root[head]
    del node[leaf]
    with pytest.raises(ConfigError, match=f"config key {key} is missing"):
        aligner_loop_parts(trainer, model)


def test_the_loss_is_built_from_model_dapo_strictly():
    from nemo_dapo.cluster.config_validate import ConfigError
    from nemo_dapo.aligner.trainer import aligner_loop_parts

    trainer, model = _cfgs(clip_c=3.0, agg="seq-mean-token-sum-norm")
    loss = aligner_loop_parts(trainer, model)[2]
    s = loss.settings
    assert (s.eps_low, s.eps_high, s.clip_c, s.agg, loss.max_new_tokens) == (0.2, 0.28, 3.0,
                                                                           "seq-mean-token-sum-norm", 20480)
    del model.dapo.algorithm["clip_c"]
    with pytest.raises(ConfigError, match="config key model.dapo.algorithm.clip_c is missing"):
        aligner_loop_parts(trainer, model)


# ---- training length ------------------------------------------------------------------------------------------------
def test_training_steps_names_the_bound_that_holds(caplog):
    from nemo_dapo.aligner.trainer import training_steps

    # de-duplicated DAPO-Math-17k (~17.4k prompts) at 512 per step: 33 steps per epoch
    steps, why = training_steps(17398, 512, 1, 375)
    assert steps == 33 and "max_epochs" in why and "33 steps per epoch" in why
    assert "cut to 33 by max_epochs=1" in caplog.text  # the cap is explicit in the log
    assert training_steps(17398, 512, 12, 375) == (375, training_steps(17398, 512, 12, 375)[1])
    assert "max_steps" in training_steps(17398, 512, 12, 375)[1]
    assert training_steps(17398, 512, None, 375)[0] == 375 and training_steps(17398, 512, 2, -1)[0] == 66
    with pytest.raises(ValueError, match="trainer.dapo.max_steps"):
        training_steps(100, 10, None, -1)


def test_recipes_train_for_the_reference_step_count():
    """~6k optimizer updates (REFERENCE.md: ~375 rollout steps at 512 / 512 x 16 updates) on de-duplicated data:
    every cluster recipe's max_steps binds there (not one epoch's ~33 steps), and its multi-hour steps are each
    checkpointed."""
    from pathlib import Path

    from nemo_dapo.aligner.trainer import training_steps

    names = sorted(p.stem for p in Path("conf/recipes").glob("*.yaml") if not p.stem.startswith("tiny_cpu"))
    assert len(names) == 10
    for name in names:
        t = OmegaConf.load(f"conf/recipes/{name}.yaml").trainer.dapo
        steps, why = training_steps(17000, int(t.prompts_per_step), t.get("max_epochs", 1), t.max_steps)
        assert 320 <= steps <= 400 and steps == int(t.max_steps), (name, steps, why)
        assert int(t.get("save_interval", t.val_check_interval)) == 1, \
            f"{name}: a multi-hour step must be checkpointed every step"


# ---- progress and the time budget ---------------------------------------------------------------------------------
def test_progress_saves_every_step_and_validates_every_tenth():
    from nemo_dapo.aligner.trainer import progress

    plan = [progress(step, 25, 10, 1) for step in range(1, 26)]
    assert all(save for _, save, _ in plan)
    assert [step for step, (val, _, _) in enumerate(plan, 1) if val] == [10, 20, 25]
    assert plan[-1][2] and not any(end for _, _, end in plan[:-1])
    assert progress(3, 25, 0, 0) == (False, False, False)


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_time_budget_keeps_room_for_the_checkpoint_and_learns_durations():
    from nemo_dapo.aligner.trainer import TimeBudget

    clock, limit = _Clock(), 1000.0
    b = TimeBudget(lambda: limit - clock.t, save_s=100.0, clock=clock)
    assert not b.should_stop("generate")  # nothing measured yet: fits while the checkpoint fits
    clock.t += 300.0  # one generation batch took 300 s
    assert not b.should_stop("generate")  # 700 s left >= 300 + 100
    clock.t += 350.0  # the longest batch so far: 350 s (measured when the loop asks next)
    assert b.should_stop("generate")  # 350 s left < 350 + 100: save now instead
    assert b.estimate["generate"] == 350.0
    b.record("save", 40.0)  # a measured save replaces the configured guess
    assert b.estimate["save"] == 40.0 and b.fits("validation")  # no validation timed yet
    b.record("validation", 320.0)
    assert not b.fits("validation") and b.fits("save")  # 350 s left < 320 + 40; a save alone fits


def test_time_budget_durations_survive_a_resume():
    """A resumed run knows how long validation took: it skips one that would not end (with its checkpoint) before
    the allocation does, where a fresh budget (0 s measured) would start it and lose the step before it."""
    from nemo_dapo.aligner.trainer import TimeBudget

    first = TimeBudget(lambda: 1e9, save_s=100.0)
    first.record("validation", 300.0)
    first.record("save", 40.0)
    assert first.state_dict() == {"save": 40.0, "validation": 300.0}
    fresh, resumed = (TimeBudget(lambda: 320.0, save_s=100.0) for _ in range(2))
    resumed.load_state_dict(first.state_dict())
    assert fresh.fits("validation") and not resumed.fits("validation")  # 320 s left < 300 + 40
    assert resumed.fits("save") and resumed.estimate["save"] == 40.0


def test_time_budget_takes_rank_zeros_decision():
    from nemo_dapo.aligner.trainer import TimeBudget

    b = TimeBudget(lambda: 1e9, save_s=0.0, agree=lambda ok: False)  # rank 0 says: no time left
    assert b.should_stop("generate") and not b.fits("validation")


def test_loop_stops_between_generation_batches_and_resumes_the_partial_step():
    """The core loop's hook: interrupted after the first generation batch, the partial step survives state_dict and
    the resumed loop finishes it with exactly the metrics of an uninterrupted run."""
    import copy

    from tests.core.test_loop import make_loop, steady

    def loop():  # dynamic sampling with a small generation batch: a step needs several batches
        lp = make_loop(ds=True, groups=4, max_gen_batches=20)
        lp.filler.adaptive, lp.filler.gen_batch_size = False, 2
        return lp

    ref = loop()
    expected = steady(ref.step())
    assert ref.counters["gen_batches"] >= 2, "the test needs a step of several generation batches"

    calls = []

    def stop_after_first_batch(phase):
        calls.append(phase)
        return len(calls) > 1

    a = loop()
    assert a.step(should_stop=stop_after_first_batch) is None
    assert calls == ["generate", "generate"] and a.counters["rollout_steps"] == 0
    assert a.counters["gen_batches"] == 1
    state = copy.deepcopy(a.state_dict())
    b = loop()
    b.load_state_dict(state)
    phases = []
    got = b.step(should_stop=lambda phase: phases.append(phase) or False)
    assert phases[-1] == "update" and phases.count("generate") == ref.counters["gen_batches"] - 1
    assert b.counters == ref.counters
    drop = ("filter/", "response/", "train/reward", "train/acc", "train/overlong", "rollout/generated",
            "perf/", "timing/")  # this step's generation statistics cover only the batches it generated
    assert {k: v for k, v in got.items() if not k.startswith(drop)} == \
        {k: v for k, v in expected.items() if not k.startswith(drop)}


def test_allocation_time_left_reads_the_slurm_job_end():
    import math

    from nemo_dapo.aligner.trainer import allocation_time_left

    assert allocation_time_left({"SLURM_JOB_END_TIME": "1000"}, now=400.0) == 600.0
    assert allocation_time_left({}, now=400.0) == math.inf
    assert allocation_time_left({"SLURM_JOB_END_TIME": "0"}, now=400.0) == math.inf  # no limit set


def test_time_budget_keeps_the_longest_duration_and_counts_the_save_once():
    from nemo_dapo.aligner.trainer import TimeBudget

    b = TimeBudget(lambda: 80.0, save_s=30.0)
    b.record("generate", 50.0)
    b.record("generate", 10.0)  # a quick batch does not make the next one quick
    assert b.estimate["generate"] == 50.0
    assert b.fits("generate")  # 80 s left: exactly a batch and its checkpoint
    # a save needs its own time only, not a second save after it
    assert TimeBudget(lambda: 40.0, save_s=30.0).fits("save")


def test_the_sampling_top_p_reaches_the_loop():
    from nemo_dapo.aligner.trainer import aligner_loop_parts

    trainer, model = _cfgs()
    model.dapo.sampling_params.top_p = 0.7
    assert aligner_loop_parts(trainer, model)[0].top_p == 0.7


class _Recorder:
    """Records calls by name into a shared list."""

    def __init__(self, events, **attrs):
        self.__dict__.update(attrs)
        self._events = events

    def __getattr__(self, name):
        return lambda *a, **kw: self._events.append(name)


@pytest.mark.parametrize("offloaded_parts, adam_offloaded", [(("grads", "optimizer", "weights"), False), ((), True),
                                                             ((), False)])
def test_a_save_brings_offloaded_state_back_and_sends_it_away_again(monkeypatch, offloaded_parts, adam_offloaded):
    # DAPOTrainer.save between a refit and the next generation: the engine sleeps and the training state comes back
    # before NeMo's checkpoint reads every tensor; afterwards the optimizer states leave again and the engine gets
    # a full refit (its sleep may have released its weights)
    from nemo_dapo.aligner import trainer as tr
    from nemo_dapo.aligner.compat import unpack_state

    events = []
    t = object.__new__(tr.DAPOTrainer)
    t.generator = _Recorder(events, training_offload=type("Offload", (), {"offloaded_parts": offloaded_parts})())
    t.model = _Recorder(events, distributed_adam_offload_manager="entered" if adam_offloaded else None,
                        trainer_state=None)
    saved = []
    t.ckpt_callback = type("Callback", (), {"custom_save": lambda self, **kw: events.append("custom_save")
                                            or saved.append(kw)})()
    t.loop = type("Loop", (), {"counters": {"gen_batches": 7}})()
    t.state_dict = lambda: {"step": 3, "consumed_samples": 12, "loop": {"filler": "groups"}}
    monkeypatch.setattr(tr.dist, "barrier", lambda: events.append("barrier"))
    t.save({"val_accuracy": 0.5}, is_train_end=True)
    expected = ["sleep"] * bool(offloaded_parts) + ["prepare_for_training", "barrier", "custom_save",
                                                     "finish_training"]
    expected += ["offload_adam_states"] * adam_offloaded + ["update_weights"] * bool(offloaded_parts)
    assert events == expected
    assert unpack_state(t.model.trainer_state) == t.state_dict()  # the whole state travels inside the checkpoint
    (kw,) = saved
    assert kw["is_train_end"] and sorted(kw["monitor_candidates"]) == ["consumed_samples", "step", "val_accuracy"]
    assert t._saved_at == 7


def test_training_steps_warns_of_a_cut_only_when_max_epochs_cuts(caplog):
    from nemo_dapo.aligner.trainer import training_steps

    # 17398 // 512 = 33 steps per epoch: max_steps=33 is reached at the end of the first epoch, nothing is cut
    steps, why = training_steps(17398, 512, 1, 33)
    assert steps == 33 and "bound by max_steps" in why and "cut to" not in caplog.text


class _Loop:
    """DAPOLoop's face for DAPOTrainer.fit: each step asks should_stop before each of its two generation batches;
    from step ``deadline_step`` on, after ``deadline_after`` batches of it (or once ``done_at`` steps are done), the
    run's time is up."""

    def __init__(self, deadline_step=None, deadline_after=0, done_at=None):
        self.counters = {"rollout_steps": 0, "gen_batches": 0, "optimizer_steps": 0, "consumed_prompts": 0}
        self.sampler = type("Sampler", (), {"epoch": 0})()
        self.deadline_step, self.deadline_after, self.done_at = deadline_step, deadline_after, done_at
        self.out_of_time, self.caps = False, []

    def step(self, should_stop, sample_cap):
        self.caps.append(sample_cap)
        for batch in range(2):
            if self.counters["rollout_steps"] + 1 == self.deadline_step and batch == self.deadline_after:
                self.out_of_time = True
            if should_stop("generate"):
                return None
            self.counters["gen_batches"] += 1
        self.counters["rollout_steps"] += 1
        self.out_of_time = self.counters["rollout_steps"] == self.done_at
        return {"loss": 0.0}


def _fit(monkeypatch, loop, max_steps=3):
    from contextlib import nullcontext

    from nemo_dapo.aligner import trainer as tr

    monkeypatch.delenv("SLURM_JOB_END_TIME", raising=False)
    events = []
    t = object.__new__(tr.DAPOTrainer)
    t.cfg = OmegaConf.create({"save_time_s": 10.0, "val_check_interval": 0, "save_interval": 1})
    t.loop, t.max_steps, t.val_ds, t.generator, t.history = loop, max_steps, None, object(), []
    t._durations = {}  # no checkpoint resumed from: no measured durations
    t.run_timer = type("Timer", (), {"start_time": lambda self: None,
                                     "get_time_remaining": lambda self: 0.0 if loop.out_of_time else 1e9})()
    t.timer = type("Scoped", (), {"__call__": lambda self, name: nullcontext(),
                                  "consume_durations": lambda self: {}})()
    t.logger = _Recorder(events)
    t._rank0_decides = lambda ok: ok

    def save(extra=None, is_train_end=False):
        events.append(("save", loop.counters["rollout_steps"], is_train_end))
        t._saved_at = loop.counters["gen_batches"]

    t.save = save
    t.fit()
    return [e for e in events if e != "log_metrics"]


def test_fit_saves_every_step_draws_nothing_ahead_at_the_last_and_finalizes(monkeypatch):
    loop = _Loop()
    assert _fit(monkeypatch, loop) == [("save", 1, False), ("save", 2, False), ("save", 3, True), "finalize"]
    assert loop.caps == [None, None, 0]  # the last step starts no prompt that no step would train


def test_fit_at_the_last_step_with_no_time_left_ends_as_a_normal_run(monkeypatch):
    loop = _Loop(done_at=3)  # not even one more generation batch would fit, but there is none to run
    assert _fit(monkeypatch, loop) == [("save", 1, False), ("save", 2, False), ("save", 3, True), "finalize"]


@pytest.mark.parametrize("after, saves", [(1, [("save", 1, False), ("save", 1, False)]), (0, [("save", 1, False)])])
def test_a_time_limit_inside_a_step_saves_its_generated_batches_only_if_there_are_some(monkeypatch, after, saves):
    loop = _Loop(deadline_step=2, deadline_after=after)
    assert _fit(monkeypatch, loop) == saves  # stopped: no finalize, the next launch resumes from the save
    assert loop.counters["rollout_steps"] == 1 and loop.counters["gen_batches"] == 2 + after


class _StepActor:
    """The DAPO actor's face for ActorPolicy.train_step: records the batch the loss gets (field -> shape)."""

    def __init__(self):
        self.tokenizer, self.batches, self.calls = type("Tok", (), {"eos_id": 2})(), [], []
        self.training_state_offload = None  # nothing offloaded (onload_for_use's guard)

    def __getattr__(self, name):
        if name not in ("prepare_for_training", "prepare_for_training_step", "finish_training_step"):
            raise AttributeError(name)
        return lambda *a, **kw: self.calls.append(name)

    def get_loss_and_metrics(self, batch, forward_only, *, norm, loss_fn, reduce_over_dp):
        assert not forward_only and not reduce_over_dp  # this DP rank's share; the loop reduces over DP
        self.batches.append({k: tuple(v.shape) for k, v in batch.items()})
        return 0.5, {"loss": 0.5}


@pytest.mark.parametrize("tis_cap", [None, 2.0])
def test_a_rank_without_samples_trains_on_blank_rows_with_every_field_its_loss_reads(monkeypatch, tis_cap):
    # token-balanced shares can leave a rank no sample of a mini-batch: it still runs the update (collectives)
    # on 0 rows, which must carry the engine log-probs when truncated importance sampling reads them
    from nemo_dapo.aligner import trainer as tr

    monkeypatch.setattr(tr, "skip_update", lambda loss, grad_norm: (loss, False))  # no DP group here
    steps = []
    optimizer = type("Opt", (), {"param_groups": [{"lr": 0.1}], "zero_grad": lambda self: None,
                                 "step": lambda self: steps.append("optimizer")})()
    scheduler = type("Sched", (), {"step": lambda self: steps.append("scheduler")})()
    actor = _StepActor()
    out = tr.ActorPolicy(actor, optimizer, scheduler, gradient_clip_val=None).train_step(
        None, norm=4.0, loss_fn=type("Loss", (), {"tis_cap": tis_cap})())
    (batch,) = actor.batches
    fields = {"response_tokens", "mask", "prev_logprobs", "advantages", "is_end"}
    assert set(batch) == fields | ({"engine_logprobs"} if tis_cap else set())
    assert all(shape[0] == 0 for shape in batch.values())
    assert steps == ["optimizer", "scheduler"] and out["lr"] == 0.1 and out["skipped"] == 0.0
    assert actor.calls == ["prepare_for_training", "prepare_for_training_step", "finish_training_step"]
