"""One algorithm config, two backends: the CPU path's builder (conf/dapo_base.yaml) and the aligner path's builder
(conf/gpt_dapo_actor.yaml) give the same settings, loss and gradients for the same global batch; and the aligner
layer reads the YAML's keys strictly (no ``.get(key, default)`` whose default could drift from the YAML)."""
import ast
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.aligner.conftest import needs_nemo

ROOT = Path(__file__).resolve().parents[2]

# The same run in both layouts: CPU (algorithm.* / trainer.* / rollout.*) and aligner
# (model.dapo.algorithm.* / trainer.dapo.* / model.*).
A = "model.dapo.algorithm."
CPU = ["algorithm.dynamic_sampling.on_budget_exhausted=train_partial", "algorithm.group_size=4", "algorithm.eps_high=0.3", "algorithm.clip_c=3.0", "algorithm.tis_cap=2.0",
       "algorithm.agg=seq-mean-token-sum-norm", "algorithm.overlong_filter=true", "trainer.train_batch_size=2",
       "trainer.mini_batch_size=4", "rollout.max_new_tokens=6", "algorithm.overlong.l_cache=2", "seed=5",
       "algorithm.dynamic_sampling.max_gen_batch_size=6"]
ALIGNER = [f"{A}group_size=4", f"{A}eps_high=0.3", f"{A}clip_c=3.0", f"{A}tis_cap=2.0",
           f"{A}agg=seq-mean-token-sum-norm", f"{A}overlong_filter=True", "trainer.dapo.prompts_per_step=2",
           "model.global_batch_size=4", "model.dapo.length_params.max_length=6", f"{A}overlong.l_cache=2",
           "model.seed=5", f"{A}dynamic_sampling.max_gen_batch_size=6", f"{A}dynamic_sampling.max_gen_batches=4"]
# tiny_cpu.yaml sets algorithm.dynamic_sampling.max_gen_batches=4; on_budget_exhausted is train_partial in both


def _both():
    from nemo_dapo.cluster.config_load import load_config as load_aligner
    from nemo_dapo.local.config import load_config as load_cpu
    from nemo_dapo.local.run import local_loop_parts as cpu_build

    cpu = cpu_build(load_cpu("tiny_cpu", CPU))
    cfg = load_aligner(None, ALIGNER)
    return cpu, cfg


@needs_nemo
def test_the_two_builders_agree_on_settings_loss_and_gradients():
    from nemo_dapo.aligner.trainer import aligner_loop_parts as aligner_build

    (s1, f1, l1), cfg = _both()
    s2, f2, l2 = aligner_build(cfg.trainer.dapo, cfg.model)
    # the CPU path's algorithm.overlong.l_max is null (the cap); the aligner's YAML interpolates the cap
    assert s1.penalty_l_max == s2.penalty_l_max == 6
    assert replace(s1, overlong=replace(s1.overlong, l_max=None)) == replace(s2, overlong=replace(s2.overlong, l_max=None))
    filler_keys = ("num_groups", "enabled", "max_gen_batches", "on_budget_exhausted", "max_age", "gen_batch_size",
                   "adaptive", "max_gen_batch_size", "prior_pass_rate", "prior_weight", "pass_rate_memory", "safety")
    assert {k: getattr(f1, k) for k in filler_keys} == {k: getattr(f2, k) for k in filler_keys}
    assert l1 == l2 and l1.tis_cap == 2.0 and l1.max_new_tokens == 6

    from nemo_dapo.core.types import RolloutBatch

    g = torch.Generator().manual_seed(0)
    b, t = 4, 6
    old = -torch.rand(b, t, generator=g) - 0.1
    new = old + 0.4 * torch.randn(b, t, generator=g)
    mask = (torch.rand(b, t, generator=g) > 0.2).float()
    batch = RolloutBatch(prompt_ids=torch.ones(b, 2, dtype=torch.long), prompt_mask=torch.ones(b, 2),
                         response_ids=torch.ones(b, t, dtype=torch.long), response_mask=mask,
                         group_ids=torch.tensor([0, 0, 1, 1]), truncated=torch.tensor([False, True, False, False]),
                         engine_logp=old + 0.2 * torch.randn(b, t, generator=g), old_logp=old,
                         advantages=torch.randn(b, generator=g))
    out = []
    for loss_fn in (l1, l2):
        x = new.clone().requires_grad_(True)
        loss, _ = loss_fn(x, None, batch, float(b))
        loss.backward()
        out.append((loss.detach(), x.grad))
    assert torch.isfinite(out[0][0]) and out[0][1].abs().sum() > 0
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


# the cluster's deliberate differences from conf/algorithm/dapo.yaml, written in conf/gpt_dapo_actor.yaml beside its
# mount: train on what was kept when the budget runs out, bound the batch explicitly, the cap written out as L_max,
# L_cache sized for the 2k default cap
CLUSTER_OVERRIDES = {"dynamic_sampling.on_budget_exhausted", "dynamic_sampling.max_gen_batch_size", "overlong.l_cache",
                     "overlong.l_max"}


def _flat(node, prefix="") -> dict:
    out = {}
    for k, v in node.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def test_the_block_is_one_file_mounted_at_both_places():
    """conf/algorithm/dapo.yaml holds every field of core/settings; the CPU base takes it as it is, the cluster base
    overrides exactly the documented keys beside its mount, and neither base file writes another of its values."""
    from nemo_dapo.cluster.config_load import ALGORITHM_KEYS, load_config as load_aligner, read_yaml
    from nemo_dapo.core.settings import FIELDS
    from nemo_dapo.local.config import ALGORITHM_KEYS as CPU_KEYS, CONF_DIR, _load_tree

    assert set(CPU_KEYS) == set(ALGORITHM_KEYS) == set(FIELDS)
    block = _flat(OmegaConf.to_container(read_yaml(ROOT / "conf/algorithm/dapo.yaml")))
    assert set(block) == set(FIELDS)
    cpu = OmegaConf.to_container(_load_tree(str(ROOT / "conf/dapo_base.yaml"), CONF_DIR))
    assert _flat(cpu["algorithm"]) == block
    al = _flat(OmegaConf.to_container(load_aligner(None, resolve=False).model.dapo.algorithm))
    assert set(al) == set(FIELDS) and {k for k in FIELDS if al[k] != block[k]} == CLUSTER_OVERRIDES
    # the values live once: the base files mount the block and write only the overrides
    assert "algorithm" not in OmegaConf.to_container(read_yaml(ROOT / "conf/dapo_base.yaml"))
    raw = OmegaConf.to_container(read_yaml(ROOT / "conf/gpt_dapo_actor.yaml"))
    assert set(_flat(raw["model"]["dapo"]["algorithm"])) == CLUSTER_OVERRIDES


# ---- strict reads -------------------------------------------------------------------------------------------------
def _yaml_leaves(node, prefix="") -> dict:
    """{leaf key name: set of YAML values} of a plain YAML tree (interpolations kept as strings)."""
    out: dict = {}
    if isinstance(node, dict):
        for k, v in node.items():
            for name, values in _yaml_leaves(v, f"{prefix}{k}.").items():
                out.setdefault(name, set()).update(values)
            if not isinstance(v, dict):
                out.setdefault(str(k), set()).add(repr(v))
    return out


def _get_calls(path: Path):
    """(line, key, default repr) of every ``<x>.get("<key>", <default>)`` / ``.setdefault(...)`` in ``path``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("get", "setdefault")
                and len(node.args) == 2 and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
                # not config: the time budget's measured durations (trainer.TimeBudget.estimate)
                and not (isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "estimate")):
            try:
                default = repr(ast.literal_eval(node.args[1]))
            except ValueError:
                default = None  # not a literal (another key's value): only the strict rule applies
            yield node.lineno, node.args[0].value, default


# Files whose reads of YAML keys may have a code default (each must still agree with the YAML): the validator and
# the planner judge configs that may be partial (a recipe before the checkpoint is merged, `nemo-dapo plan` on a
# sketch) and must report every problem rather than stop at the first missing key. The runtime modules have none;
# NeMo's own model keys go through config_load.nemo_model_key (NeMo's defaults, checked below).
KNOWN = {"plan.py": "*", "config_validate.py": "*"}


def _aligner_leaves() -> dict:
    """The leaves of conf/gpt_dapo_actor.yaml as composed (the algorithm block mounted), interpolations unresolved."""
    from nemo_dapo.cluster.config_load import load_config

    return _yaml_leaves(OmegaConf.to_container(load_config(None, resolve=False)))


def test_no_code_default_for_a_yaml_key_in_the_aligner_layer():
    from nemo_dapo.core.settings import FIELDS

    leaves = _aligner_leaves()
    block = {f.rpartition(".")[2] for f in FIELDS}
    strict, disagree = [], []
    for path in sorted((ROOT / "nemo_dapo/aligner").glob("*.py")):
        known = KNOWN.get(path.name, set())
        for line, key, default in _get_calls(path):
            if key not in leaves:
                continue
            where = f"{path.name}:{line} .get({key!r}, {default})"
            if key in block or (known != "*" and key not in known):
                strict.append(where)
            elif default is not None and default not in leaves[key] and not any("${" in v for v in leaves[key]):
                disagree.append(f"{where}: the YAML has {sorted(leaves[key])}")
    assert not strict, f"read these YAML keys strictly (config_load.required): {strict}"
    assert not disagree, f"code defaults that disagree with conf/gpt_dapo_actor.yaml: {disagree}"


def test_the_strict_read_check_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(d):\n    return d.get('l_cache', 4096), d.get('eps_low', 0.2), d.setdefault('seed', 1)\n")
    assert sorted((k, v) for _, k, v in _get_calls(bad)) == [("eps_low", "0.2"), ("l_cache", "4096"), ("seed", "1")]
    leaves = _aligner_leaves()
    assert "'4096'" not in leaves["l_cache"] and "4096" not in leaves["l_cache"]  # the YAML says 512


def _nemo_model_defaults() -> dict:
    """{key: set of literal defaults} of NeMo 2.1's ``cfg.get('<key>', <default>)`` reads in megatron_base_model.py
    and megatron_gpt_model.py (parsed from the installed source, not imported)."""
    import importlib.util

    spec = importlib.util.find_spec("nemo")
    if spec is None:
        pytest.skip("needs NeMo's source (bash scripts/install.sh .venv full)")
    base = Path(spec.submodule_search_locations[0]) / "collections/nlp/models/language_modeling/megatron"
    out: dict = {}
    for name in ("megatron_base_model.py", "megatron_gpt_model.py"):
        for _, key, default in _get_calls(base.parent / name):
            if default is not None:
                out.setdefault(key, set()).add(default)
    return out


def test_nemo_model_keys_keep_nemo_defaults():
    """The only YAML keys the runtime reads with a default are NeMo's own model keys, each with NeMo's default: a
    checkpoint config may lack them, NeMo then builds the model with that default (bias: NeMo adds linear biases)."""
    from nemo_dapo.cluster.config_load import NEMO_MODEL_DEFAULTS

    assert set(NEMO_MODEL_DEFAULTS) == {"tensor_model_parallel_size", "sequence_parallel", "context_parallel_size",
                                        "expert_model_parallel_size", "qkv_bias", "bias", "num_moe_experts"}
    nemo = _nemo_model_defaults()
    for key, ours in NEMO_MODEL_DEFAULTS.items():
        assert nemo.get(key) == {repr(ours)}, f"{key}: ours {ours!r}, NeMo reads it with {nemo.get(key)}"


def test_the_nemo_default_check_can_fail(monkeypatch):
    from nemo_dapo.cluster import config_load

    monkeypatch.setitem(config_load.NEMO_MODEL_DEFAULTS, "bias", False)  # the default generation.py had
    with pytest.raises(AssertionError, match="bias: ours False"):
        test_nemo_model_keys_keep_nemo_defaults()


@pytest.mark.parametrize("override, key", [(f"{A}group_size=1", f"{A}group_size"),
                                           (f"{A}eps_low=1.0", f"{A}eps_low")])
def test_both_validators_share_the_rules(override, key):
    from nemo_dapo.cluster.config_load import load_config as load_aligner
    from nemo_dapo.cluster.config_validate import check_config
    from nemo_dapo.local.config import ConfigError, load_config as load_cpu

    problems = check_config(load_aligner(None, [override]))
    assert any(p.startswith(key) for p in problems), problems
    cpu_key = "algorithm." + key.rpartition(".")[2]
    with pytest.raises(ConfigError, match=cpu_key):
        load_cpu("tiny_cpu", [cpu_key + "=" + override.partition("=")[2]])


def test_both_paths_raise_the_one_config_error():
    from nemo_dapo.cluster import config_load, config_validate
    from nemo_dapo.core.settings import ConfigError
    from nemo_dapo.local import config as cpu_config

    with pytest.raises(ConfigError) as cpu:
        cpu_config.load_config("tiny_cpu", ["algorithm.eps_low=1.0"])
    with pytest.raises(ConfigError) as aligner:
        config_validate.validate_config(config_load.load_config(None, [f"{A}eps_low=1.0"]))
    assert cpu.value.problems == [str(cpu.value)] and "algorithm.eps_low" in str(cpu.value)
    assert str(aligner.value).startswith("invalid DAPO config:\n  - ")
    assert any(p.startswith(f"{A}eps_low") for p in aligner.value.problems)
