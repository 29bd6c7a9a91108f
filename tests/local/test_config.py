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
    from nemo_dapo.local.config import ALGORITHM_KEYS, AlgorithmConfig
    from nemo_dapo.local.config_schema import _schema

    assert sorted(_leaf_keys(AlgorithmConfig)) == sorted(FIELDS)
    assert set(ALGORITHM_KEYS.values()) == {f"algorithm.{name}" for name in FIELDS}
    toy = _schema("Toy", {**field_types(), "overlong.toy_option": bool})
    overlong = next(f for f in dc_fields(toy) if f.name == "overlong").default_factory
    assert "toy_option" in {f.name for f in dc_fields(overlong)}


# ---- the edges of each range: one step outside is refused naming the key, the edge itself is accepted ------------
@pytest.mark.parametrize("override, pattern", [
    ("optim.eps=0", r"'optim.eps' = 0.0 is out of range: it must be in \(0, inf\]"),
    ("optim.weight_decay=-0.1", r"'optim.weight_decay' = -0.1 is out of range: it must be in \[0, inf\]"),
    ("warmup.weight_decay=-0.1", r"'warmup.weight_decay' = -0.1 is out of range"),
    ("optim.betas=[0.9,1.0]", r"'optim.betas\[1\]' = 1.0 must be in \[0, 1\)"),  # beta2 = 1: Adam never forgets
    ("optim.betas=[0.9]", r"'optim.betas' must hold two numbers"),
    ("optim.grad_clip=0", r"'optim.grad_clip' = 0.0 is out of range: it must be in \(0, inf\]"),
    ("warmup.grad_clip=0", r"'warmup.grad_clip' = 0.0 is out of range"),
    ("warmup.target_high=1.5", r"'warmup.target_high' = 1.5 is out of range: it must be in \[0, 1\]"),
    ("warmup.target_high=0.2", r"'warmup.target_low' = 0.3 and 'warmup.target_high' = 0.2: need target_low <="),
    ("trainer.max_entropy_fraction=0", r"'trainer.max_entropy_fraction' = 0.0 is out of range: it must be in "
                                       r"\(0, 1\]"),
    ("eval.top_p=0", r"'eval.top_p' = 0.0 is out of range: it must be in \(0, 1\]"),
    ("rollout.top_p=0", r"'rollout.temperature'/'rollout.top_p' need temperature >= 0 and 0 < top_p <= 1"),
    ("data.max_prompt_tokens=0", r"'data.max_prompt_tokens' must be >= 1, got 0"),
    ("warmup.min_steps=-1", r"'warmup.min_steps' must be >= 0, got -1"),
    ("trainer.keep_last=0", r"'trainer.keep_last' must be >= 1, got 0"),  # 0 would delete every checkpoint
    ("model.rope_theta=0", r"'model.rope_theta' must be > 0, got 0"),
    ("model.hidden_size=36", r"the head dimension 9 is odd, RoPE needs an even one"),  # 36 / 4 heads
    ("data.tokenizer_vocab_size=259", r"'data.tokenizer_vocab_size' = 259 leaves no room for merges"),
    ("trainer.mini_batch_size=129", r"'trainer.mini_batch_size' = 129 is more than the 128 responses"),  # 16 x 8
    ("rollout.streaming=true", r"'rollout.streaming' needs an engine server"),  # tiny_cpu samples in process
    ("name=..", r"'name' = '..' must be a plain folder name"),
])
def test_one_step_outside_each_range_is_refused_naming_the_key(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config("tiny_cpu", [override])


@pytest.mark.parametrize("overrides", [
    ["optim.betas=[0.0,0.999]"],  # beta1 = 0: RMSProp-like Adam, a valid choice
    ["eval.temperature=0"],  # greedy evaluation (only rollouts must sample)
    ["warmup.target_low=0.4", "warmup.target_high=0.4"],  # a band of one value
    ["trainer.mini_batch_size=128"],  # the whole step's 16 x 8 responses in one update
    ["trainer.max_entropy_fraction=1.0"],
    ["warmup.min_steps=0", "optim.warmup_steps=0", "trainer.max_skipped_updates=0"],
    ["data.tokenizer_vocab_size=260"],  # 256 bytes + 3 special tokens + one merge
], ids=lambda o: " ".join(o))
def test_the_edge_of_each_range_is_accepted(overrides):
    cfg = load_config("tiny_cpu", overrides)
    for item in overrides:
        key, value = item.split("=")
        obj = cfg
        for part in key.split("."):
            obj = getattr(obj, part)
        assert str(obj).replace(" ", "") == value or obj == float(value), key


def test_a_generation_cap_one_below_the_positions_is_trainable():
    from nemo_dapo.local.config import check_trainable

    cfg = load_config("tiny_cpu", ["rollout.max_new_tokens=255"])  # the model has 256 positions
    assert check_trainable(cfg).rollout.max_new_tokens == 255


def test_the_arithmetic_tasks_exact_count_of_train_problems_may_be_asked_for():
    from nemo_dapo.local.run_data import make_task

    most = make_task(load_config("tiny_cpu", ["data.max_terms=3", "data.train_size=10"])).most_distinct("train")
    assert load_config("tiny_cpu", ["data.max_terms=3", f"data.train_size={most}"]).data.train_size == most
    with pytest.raises(ConfigError, match=rf"'data.train_size' = {most + 1}: this arithmetic task has at most {most}"):
        load_config("tiny_cpu", ["data.max_terms=3", f"data.train_size={most + 1}"])


# partial rollouts on an engine server (rollout.engine=local), each rule refusing one missing piece
SUSPEND = ["rollout.engine=local", "rollout.streaming=true", "rollout.on_filler_full=suspend", "algorithm.tis_cap=2.0"]


@pytest.mark.parametrize("extra, pattern", [
    (["algorithm.tis_cap=null"], r"'rollout.on_filler_full' = suspend trains tokens sampled by older weights"),
    (["rollout.overlap=true", "rollout.server.sleep_level=1"], r"'rollout.overlap' = true .* needs .*sleep_level=0"),
    (["rollout.overlap=true", "rollout.max_staleness=0"], r"'rollout.overlap' = true .* rollout.max_staleness >= 1"),
])
def test_partial_rollouts_name_what_they_miss(extra, pattern):
    assert load_config("tiny_cpu", SUSPEND + ["rollout.overlap=true"]).rollout.overlap  # the complete set is valid
    with pytest.raises(ConfigError, match=pattern):
        load_config("tiny_cpu", SUSPEND + extra)
