"""The trainer's mapping from trainer.dapo / model.dapo to the shared step loop's settings and batch filler."""
import pytest
from omegaconf import OmegaConf

from tests.aligner.conftest import needs_nemo

pytestmark = [needs_nemo, pytest.mark.nemo]


def _cfgs(**trainer_over):
    trainer = OmegaConf.create({"group_size": 16, "prompts_per_step": 512, "ppo_epochs": 1, "seed": 3,
                                "overlong": {"enabled": True, "l_max": 20480, "l_cache": 4096, "penalty_factor": 1.0},
                                "dynamic_sampling": {"enabled": True, "max_gen_batches": 10, "max_age": 1,
                                                     "on_budget_exhausted": "train_partial", "adaptive": True,
                                                     "gen_batch_size": None, "max_gen_batch_size": 1536,
                                                     "prior_pass_rate": 0.4, "safety": 1.2}})
    trainer = OmegaConf.merge(trainer, OmegaConf.create(trainer_over))
    model = OmegaConf.create({"global_batch_size": 512, "seed": 1234, "dapo": {
        "length_params": {"max_length": 20480}, "sampling_params": {"temperature": 1.0, "top_p": 1.0}}})
    return trainer, model


def test_loop_settings_follow_the_paper_recipe():
    from nemo_dapo.aligner.trainer import loop_settings

    s = loop_settings(*_cfgs())
    assert (s.group_size, s.mini_batch_size, s.max_new_tokens, s.l_cache, s.seed) == (16, 512, 20480, 4096, 3)
    assert s.overlong_shaping and s.temperature == 1.0


def test_overlong_l_max_must_be_the_generation_cap():
    from nemo_dapo.aligner.trainer import loop_settings

    with pytest.raises(ValueError, match="trainer.dapo.overlong.l_max"):
        loop_settings(*_cfgs(overlong={"l_max": 16384}))


def test_greedy_sampling_maps_to_temperature_zero():
    from nemo_dapo.aligner.trainer import loop_settings

    trainer, model = _cfgs()
    model.dapo.sampling_params.use_greedy = True
    assert loop_settings(trainer, model).temperature == 0.0


def test_batch_filler_takes_every_dynamic_sampling_key():
    from nemo_dapo.aligner.trainer import batch_filler

    f = batch_filler(_cfgs()[0])
    assert (f.num_groups, f.enabled, f.max_gen_batches, f.on_budget_exhausted) == (512, True, 10, "train_partial")
    assert (f.max_gen_batch_size, f.prior_pass_rate, f.safety) == (1536, 0.4, 1.2)
    assert not batch_filler(_cfgs(dynamic_sampling={"enabled": False})[0]).enabled
