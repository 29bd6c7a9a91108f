"""Loading the cluster configs without NeMo (nemo_dapo/cluster/config_load.py): the base merged with an override-only
recipe and command-line overrides as Hydra would, and the algorithm block's former keys refused by their new names."""
import re

import pytest
from omegaconf import OmegaConf

from nemo_dapo.cluster import config_load as cl
from nemo_dapo.core.settings import ConfigError
from tests.cluster.test_config_validate import DENSE, RECIPES, ROOT


def test_hydra_composition_equals_our_loader():
    """What train_gpt_dapo.py gets from Hydra (--config-name recipes/<name>) is what `plan` and the tests check."""
    from hydra import compose, initialize_config_dir

    cl.register_resolvers()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        for recipe in RECIPES:
            hydra_cfg = compose(config_name=f"recipes/{recipe}", overrides=["trainer.dapo.max_steps=3"])
            ours = cl.load_config(recipe, ["trainer.dapo.max_steps=3"])
            assert OmegaConf.to_container(hydra_cfg, resolve=True) == OmegaConf.to_container(ours), recipe


def test_a_recipe_may_only_override_existing_keys(tmp_path):
    bad = tmp_path / "typo.yaml"
    bad.write_text("defaults:\n  - /gpt_dapo_actor\n  - _self_\nmodel:\n  dapo:\n    algorithm:\n      eps_hihg: 0.3\n")
    with pytest.raises(ValueError, match="eps_hihg"):
        cl.load_config(bad)


# ---- the algorithm block's keys moved from trainer.dapo.* / model.dapo.* to model.dapo.algorithm.* -------------
def _old_key(name: str) -> str:
    from nemo_dapo.core.settings import LOSS_FIELDS

    return ("model.dapo." if name in LOSS_FIELDS else "trainer.dapo.") + name


def test_the_algorithm_block_is_one_block_under_model_dapo():
    from nemo_dapo.core.settings import FIELDS

    cfg = cl.load_config()
    assert set(cl.ALGORITHM_KEYS.values()) == {f"model.dapo.algorithm.{name}" for name in FIELDS}
    for name in FIELDS:
        assert OmegaConf.select(cfg, cl.ALGORITHM_KEYS[name], default="absent") != "absent", name
        assert OmegaConf.select(cfg, _old_key(name), default="absent") == "absent", _old_key(name)
    # the interpolation that pointed at the generation cap still resolves from its new place
    assert cl.load_config(None, ["model.dapo.length_params.max_length=777"]).model.dapo.algorithm.overlong.l_max \
        == 777


@pytest.mark.parametrize("prefix", ["", "+", "++"])
def test_an_old_algorithm_override_is_an_error_naming_the_new_key(prefix):
    from nemo_dapo.core.settings import FIELDS

    for name in FIELDS:
        with pytest.raises(ConfigError, match=re.escape(f"set model.dapo.algorithm.{name} instead")) as err:
            cl.load_config(DENSE, ["trainer.dapo.max_steps=2", f"{prefix}{_old_key(name)}=1"])
        assert len(err.value.problems) == 1 and _old_key(name) in err.value.problems[0]
    with pytest.raises(ConfigError, match=re.escape("set model.dapo.algorithm.overlong instead")):
        cl.load_config(DENSE, ["trainer.dapo.overlong={l_cache: 8}"])  # a whole old sub-block
    assert cl.moved_key("trainer.dapo.max_steps") is None and cl.moved_key("model.dapo.algorithm.eps_low") is None
    assert cl.moved_key("model.dapo.sampling_params.top_p") is None


def test_the_launcher_check_names_the_new_key_before_hydra():
    cl.reject_moved_overrides(["trainer.dapo.max_steps=2", "model.dapo.algorithm.group_size=8"])  # current keys
    with pytest.raises(ConfigError) as err:
        cl.reject_moved_overrides(["trainer.dapo.group_size=8", "model.dapo.max_length=2",
                                   "model.dapo.eps_high=0.3"])
    assert [p.split(":")[0] for p in err.value.problems] == ["override 'trainer.dapo.group_size=8'",
                                                             "override 'model.dapo.eps_high=0.3'"]
    assert "model.dapo.algorithm.group_size instead" in err.value.problems[0]


def test_a_recipe_with_old_algorithm_keys_is_refused_naming_the_new_ones(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("defaults:\n  - /gpt_dapo_actor\n  - _self_\ntrainer:\n  dapo:\n    group_size: 8\n"
                   "    dynamic_sampling:\n      max_age: 0\nmodel:\n  dapo:\n    eps_high: 0.3\n")
    with pytest.raises(ConfigError) as err:
        cl.load_config(old)
    assert [p.rpartition("set ")[2] for p in err.value.problems] == [
        "model.dapo.algorithm.group_size instead", "model.dapo.algorithm.dynamic_sampling instead",
        "model.dapo.algorithm.eps_high instead"]


def test_a_recipe_must_name_the_base(tmp_path):
    bad = tmp_path / "nobase.yaml"
    bad.write_text("model:\n  dapo:\n    eps_high: 0.3\n")
    with pytest.raises(ValueError, match="defaults"):
        cl.load_config(bad)


def test_overrides_are_typed_and_checked():
    cfg = cl.load_config(DENSE, ["model.dapo.algorithm.eps_high=0.3", "+model.extra_key=7"])
    assert cfg.model.dapo.algorithm.eps_high == 0.3 and cfg.model.extra_key == 7
    with pytest.raises(ValueError, match="no key 'model.dapo.algorithm.eps_hihg'"):
        cl.load_config(DENSE, ["model.dapo.algorithm.eps_hihg=0.3"])


def test_unknown_recipe_lists_the_known_ones():
    with pytest.raises(FileNotFoundError, match=DENSE):
        cl.find_config("no-such-recipe")
