"""Config loading: the base documents every key, recipes only override, overrides and errors name the key."""
import os
import re
from dataclasses import fields, is_dataclass

import pytest

from nemo_dapo.local.config import CONF_DIR, Config, ConfigError, _all_keys, load_config


def _leaf_keys(cls, prefix=""):
    out = []
    for f in fields(cls):
        default = f.default_factory() if callable(f.default_factory) else None
        if is_dataclass(default):
            out.extend(_leaf_keys(type(default), prefix + f.name + "."))
        else:
            out.append(prefix + f.name)
    return out


def _yaml_keys_with_comments(path):
    """(dotted key, has a comment) for every key line of a YAML file, from its indentation."""
    stack, out = [], []
    for line in open(path, encoding="utf-8"):
        m = re.match(r"^( *)([A-Za-z_][\w]*):(.*)$", line.rstrip("\n"))
        if not m:
            continue
        depth = len(m.group(1)) // 2
        stack = stack[:depth] + [m.group(2)]
        out.append((".".join(stack), "#" in m.group(3)))
    return out


def _base_keys() -> dict:
    """{dotted key: has a comment} of conf/dapo_base.yaml and of conf/algorithm/dapo.yaml, which it mounts at
    algorithm.*"""
    keys = dict(_yaml_keys_with_comments(os.path.join(CONF_DIR, "dapo_base.yaml")))
    keys.update((f"algorithm.{k}", c) for k, c in _yaml_keys_with_comments(os.path.join(CONF_DIR, "algorithm",
                                                                                       "dapo.yaml")))
    return keys


def test_base_yaml_sets_and_documents_every_schema_key():
    cfg = load_config("dapo_base")
    assert isinstance(cfg, Config) and cfg.run_dir == os.path.join("runs", "dapo")
    keys = _base_keys()
    missing = [k for k in _leaf_keys(Config) if k not in keys]
    undocumented = [k for k, has_comment in keys.items() if not has_comment]
    assert not missing, f"keys of the schema without a value in dapo_base.yaml: {missing}"
    assert not undocumented, f"keys of dapo_base.yaml without a comment: {undocumented}"


def test_base_has_the_paper_values():
    cfg = load_config("dapo_base")
    a = cfg.algorithm
    assert (a.eps_low, a.eps_high, a.group_size, a.agg) == (0.2, 0.28, 16, "token-mean")
    assert (cfg.rollout.max_new_tokens, cfg.algorithm.overlong.l_cache) == (20480, 4096)
    assert (cfg.trainer.train_batch_size, cfg.trainer.mini_batch_size, cfg.optim.lr) == (512, 512, 1e-6)
    assert a.dynamic_sampling.enabled and a.dynamic_sampling.max_gen_batches == 10
    assert (cfg.eval.n_samples, cfg.eval.top_p) == (32, 0.7)


@pytest.mark.parametrize("recipe", sorted(f[:-5] for f in os.listdir(os.path.join(CONF_DIR, "recipes"))
                                          if f.startswith("tiny_cpu")))
def test_cpu_recipes_only_override_existing_keys(recipe):
    base = _base_keys()
    for key, _ in _yaml_keys_with_comments(os.path.join(CONF_DIR, "recipes", recipe + ".yaml")):
        assert key == "defaults" or key in base or any(b.startswith(key + ".") for b in base), key
    assert load_config(recipe).name == recipe


def test_naive_grpo_recipe_is_the_papers_baseline():
    dapo, grpo = load_config("tiny_cpu"), load_config("tiny_cpu_grpo")
    a = grpo.algorithm
    assert a.eps_low == a.eps_high == 0.2 and a.clip_c is None and a.agg == "seq-mean-token-mean"
    assert not a.dynamic_sampling.enabled and not a.overlong_filter and not grpo.algorithm.overlong.enabled
    # Everything else is the DAPO run's: same model, task, warm-up, budget.
    for section in ("data", "model", "warmup", "rollout", "optim", "trainer", "eval"):
        assert getattr(dapo, section) == getattr(grpo, section), section
    assert dapo.algorithm.eps_high == 0.28 and dapo.algorithm.dynamic_sampling.enabled


def test_overrides_set_add_and_delete():
    cfg = load_config("tiny_cpu", ["trainer.max_steps=3", "optim.lr=1e-3", "algorithm.clip_c=null",
                                   "++model.extra.attention_dropout=0.1", "optim.betas=[0.8,0.9]"])
    assert cfg.trainer.max_steps == 3 and cfg.optim.lr == 1e-3 and cfg.algorithm.clip_c is None
    assert cfg.model.extra == {"attention_dropout": 0.1} and cfg.optim.betas == [0.8, 0.9]
    cfg = load_config("tiny_cpu", ["+model.extra.rope_scaling=null", "~model.extra.rope_scaling"])
    assert cfg.model.extra == {}
    assert load_config("tiny_cpu", ["name=x"]).run_dir == os.path.join("runs", "x")


@pytest.mark.parametrize("override, pattern", [
    ("trainer.max_step=3", r"unknown config key 'trainer.max_step'.*did you mean 'trainer.max_steps'"),
    ("++trainer.bogus=1", r"unknown config key 'trainer.bogus'"),
    ("trainer.max_steps=abc", r"config key 'trainer.max_steps'.*abc"),
    ("optim.lr=fast", r"config key 'optim.lr'"),
    ("algorithm.group_size=2.5", r"config key 'algorithm.group_size'"),
    ("+trainer.max_steps=3", r"'trainer.max_steps' already exists"),
    ("~trainer.nothing", r"no key 'trainer.nothing'"),
    ("trainer.max_steps", r"not of the form key=value"),
    ("algorithm.agg=token_mean", r"'algorithm.agg' = 'token_mean' is not one of"),
    ("algorithm.eps_low=1.5", r"algorithm.eps_low"),
    ("algorithm.reject_logp_diff=0", r"'algorithm.reject_logp_diff' = 0.0 must be > 0"),
    ("algorithm.reject_logp_diff=0.05", r"'algorithm.reject_logp_diff' = 0.05 needs tis_cap"),
    ("algorithm.tis_level=seq", r"'algorithm.tis_level' = 'seq' is not one of \('token', 'sequence'\)"),
    ("algorithm.tis_level=sequence", r"'algorithm.tis_level' = 'sequence' weights nothing without tis_cap"),
    ("algorithm.overlong.l_cache=100", r"'algorithm.overlong.l_cache' = 100 must be an integer in \(0, l_max=\d+\)"),
    ("trainer.mini_batch_size=0", r"'trainer.mini_batch_size' must be >= 1"),
    ("~trainer.max_steps", r"'trainer.max_steps' has no value"),
    ("data.task=file", r"'data.train_file'"),
    # counted at load, not found by minutes of draws (tiny_cpu's task holds ~86k held-out problems)
    ("data.heldout_size=100000", r"'data.heldout_size' = 100000: this arithmetic task has at most 8\d{4} distinct"),
    ("data.max_terms=3", r"'data.train_size' = 20000: this arithmetic task has at most \d{4} distinct train"),
    # the overlong block moved from reward into the algorithm block: an old key names its new place
    ("reward.overlong.l_cache=8", r"it moved: use 'algorithm.overlong.l_cache'"),
    ("++reward.overlong.enabled=false", r"it moved: use 'algorithm.overlong"),
])
def test_bad_overrides_name_the_key(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config("tiny_cpu", [override])


@pytest.mark.parametrize("override, key, example", [
    ("algorithm.dynamic_sampling.skip_history=5", "algorithm.dynamic_sampling.skip_history",
     "algorithm.dynamic_sampling.skip_history.enabled="),
    ("++algorithm.dynamic_sampling.skip_history=5", "algorithm.dynamic_sampling.skip_history",
     "algorithm.dynamic_sampling.skip_history.enabled="),
    ("algorithm.dynamic_sampling=[1,2]", "algorithm.dynamic_sampling", "algorithm.dynamic_sampling.enabled="),
    ("trainer=true", "trainer", "trainer.train_batch_size="),
    ("model.extra=5", "model.extra", "++model.extra.NAME="),
])
def test_a_single_value_for_a_block_names_the_block_and_its_keys(override, key, example):
    with pytest.raises(ConfigError) as e:
        load_config("tiny_cpu", [override])
    text = str(e.value)
    assert f"config key '{key}' is a block of keys" in text and example in text and "'?'" not in text


def test_a_recipe_giving_a_block_a_value_names_the_block(tmp_path):
    recipe = tmp_path / "flat.yaml"
    recipe.write_text("defaults:\n  - /dapo_base\n  - _self_\nalgorithm:\n  overlong: 4\n")
    with pytest.raises(ConfigError, match=r"config key 'algorithm.overlong' is a block of keys \(its keys: enabled"):
        load_config(str(recipe))


def test_a_recipe_with_the_old_overlong_block_names_the_new_one(tmp_path):
    recipe = tmp_path / "old.yaml"
    recipe.write_text("defaults:\n  - /dapo_base\n  - _self_\nreward:\n  overlong:\n    l_cache: 8\n")
    with pytest.raises(ConfigError, match=r"it moved: use 'algorithm.overlong"):
        load_config(str(recipe))


def test_bad_files_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="known configs"):
        load_config("no_such_recipe")
    bad = tmp_path / "bad.yaml"
    bad.write_text("defaults:\n  - /nope\n  - _self_\nname: x\n")
    with pytest.raises(ConfigError, match="defaults entry '/nope' not found"):
        load_config(str(bad))
    typo = tmp_path / "typo.yaml"
    typo.write_text("defaults:\n  - /dapo_base\n  - _self_\ntrainer:\n  max_stpes: 4\n")
    with pytest.raises(ConfigError, match="trainer.max_stpes"):
        load_config(str(typo), config_dir=CONF_DIR)


def test_schema_key_list_is_complete():
    keys = _all_keys(Config)
    assert "algorithm.dynamic_sampling.max_gen_batches" in keys and "algorithm.overlong.l_cache" in keys


def test_every_warmup_setting_of_the_local_backend_is_configurable():
    from nemo_dapo.local.warmup import WarmupConfig

    ours = {f.name for f in fields(load_config("tiny_cpu").warmup)} - {"enabled"}
    theirs = {f.name for f in fields(WarmupConfig)} - {"seed"}  # the run's seed is passed in
    assert ours == theirs


def test_paper_base_loads_but_the_tiny_model_cannot_train_on_it():
    from nemo_dapo.local.config import check_trainable

    cfg = load_config("dapo_base")  # the paper's 20480-token cap documents the keys; the built-in model has 256
    with pytest.raises(ConfigError, match=r"'rollout.max_new_tokens' = 20480 leaves no room .* 256 positions"):
        check_trainable(cfg)
    assert check_trainable(load_config("tiny_cpu")).rollout.max_new_tokens == 40


def test_hydra_composition_equals_our_loader():
    """The CPU recipes compose under Hydra (the algorithm block mounted by dapo_base's defaults list) as our loader
    composes them; cluster/yaml_compose.py is the loader of both paths."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from nemo_dapo.local.config import _load_tree, find_config

    recipes = sorted(f[:-5] for f in os.listdir(os.path.join(CONF_DIR, "recipes")) if f.startswith("tiny_cpu"))
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        for recipe in recipes:
            ours = _load_tree(find_config(recipe), CONF_DIR)
            assert OmegaConf.to_container(compose(config_name=f"recipes/{recipe}"), resolve=True) == \
                OmegaConf.to_container(ours, resolve=True), recipe
            assert ours.algorithm.eps_high == 0.28 or recipe == "tiny_cpu_grpo"  # from conf/algorithm/dapo.yaml


def test_the_algorithm_schema_is_derived_from_the_settings():
    """A field of core/settings appears in this schema without an edit here (a toy field in the test)."""
    from dataclasses import fields as dc_fields

    from nemo_dapo.core.settings import FIELDS, field_types
    from nemo_dapo.local.config import ALGORITHM_KEYS, AlgorithmConfig, _schema

    assert sorted(_leaf_keys(AlgorithmConfig)) == sorted(FIELDS)
    assert set(ALGORITHM_KEYS.values()) == {f"algorithm.{name}" for name in FIELDS}
    toy = _schema("Toy", {**field_types(), "overlong.toy_option": bool})
    overlong = next(f for f in dc_fields(toy) if f.name == "overlong").default_factory
    assert "toy_option" in {f.name for f in dc_fields(overlong)}
