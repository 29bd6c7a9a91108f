"""conf/gpt_dapo_actor.yaml, the cluster recipes and the config validator (no NeMo needed)."""
import copy
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from nemo_dapo.cluster import config_load as cl
from nemo_dapo.cluster import config_validate as cv
from nemo_dapo.cluster.yaml_compose import compose_file

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "conf" / "gpt_dapo_actor.yaml"
RECIPES = sorted(p.stem for p in (ROOT / "conf" / "recipes").glob("*.yaml")
                 if cl.recipe_base(OmegaConf.load(p)) == "gpt_dapo_actor")
DENSE, MOE = "qwen2.5-32b_h100", "moe-mixtral-8x22b_h100"


def uncommented_keys(text: str) -> list:
    """Keys (``name:`` lines) with neither an inline comment nor a comment line right above them."""
    lines, bad = text.splitlines(), []
    for i, line in enumerate(lines):
        m = re.match(r"\s*([A-Za-z_][\w-]*):", line)
        if not m or line.lstrip().startswith("#"):
            continue
        above = lines[i - 1].strip() if i else ""
        if "#" not in line and not above.startswith("#"):
            bad.append(f"line {i + 1}: {m.group(1)}")
    return bad


def test_comment_checker_flags_an_undocumented_key():
    assert uncommented_keys("a: 1  # doc\n# doc of b\nb: 2\nc: 3\n") == ["line 4: c"]


def test_every_key_of_the_base_config_is_commented():
    assert uncommented_keys(BASE.read_text()) == []
    assert uncommented_keys((BASE.parent / "algorithm" / "dapo.yaml").read_text()) == []  # the block it mounts


def test_base_config_alone_is_valid():
    assert cv.check_config(cl.load_config()) == []


def test_there_are_dense_and_moe_recipes_for_h100_and_h20():
    assert {"qwen2.5-32b_h100", "qwen2.5-32b_h20", "moe-mixtral-8x22b_h100", "moe-mixtral-8x22b_h20"} <= set(RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_composes_and_validates(recipe):
    cfg = cl.load_config(recipe)
    assert cv.check_config(cfg) == []
    # the cluster recipes are 16 x 8 GPUs; Qwen3-30B-A3B is the small MoE to try first, on 4 x 8
    assert cv.sizes(OmegaConf.to_container(cfg))["world"] == (32 if recipe.startswith("qwen3-30b-a3b") else 128)


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r.startswith(("qwen2.5-32b", "moe-"))])
def test_recipes_carry_the_paper_settings(recipe):
    c = OmegaConf.to_container(cl.load_config(recipe))
    t, m = c["trainer"]["dapo"], c["model"]
    a = m["dapo"]["algorithm"]
    assert (t["prompts_per_step"], a["group_size"], m["global_batch_size"]) == (512, 16, 512)
    assert (t["trt_llm"]["max_input_len"], m["dapo"]["length_params"]["max_length"]) == (2048, 20480)
    assert (a["overlong"]["l_max"], a["overlong"]["l_cache"]) == (20480, 4096)
    assert (a["eps_low"], a["eps_high"], a["clip_c"], a["agg"]) == (0.2, 0.28, 10.0, "token-mean")
    assert a["dynamic_sampling"]["max_gen_batch_size"] == 1536
    assert m["optim"]["lr"] == 1e-6 and m["optim"]["sched"]["warmup_steps"] > 0
    assert (t["val"]["n_samples"], t["val"]["top_p"], t["val"]["temperature"]) == (32, 0.7, 1.0)
    assert c["plan"]["gpu"] == recipe.rsplit("_", 1)[1]


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r.startswith("moe-")])
def test_moe_recipes_use_expert_parallelism_and_rl_router_settings(recipe):
    m = OmegaConf.to_container(cl.load_config(recipe))["model"]
    assert m["expert_model_parallel_size"] > 1 and m["optim"]["name"] == "mcore_distributed_optim"
    assert m["moe_router_load_balancing_type"] == "none" and m["moe_aux_loss_coeff"] == 0


def test_the_validator_flags_old_keys_in_a_merged_config():
    cfg = OmegaConf.to_container(cl.load_config(DENSE))
    cfg["trainer"]["dapo"]["dynamic_sampling"] = {"enabled": False}  # e.g. Hydra's +trainer.dapo.dynamic_sampling
    problems = cv.check_config(cfg)
    assert len(problems) == 1 and "trainer.dapo.dynamic_sampling is not read any more" in problems[0]
    assert "model.dapo.algorithm.dynamic_sampling instead" in problems[0]


# (recipe, overrides, a key the message must name)
# an engine per data-parallel replica on GPUs of its own (placement separate)
SEPARATE = ["trainer.dapo.engine_server.placement=separate", "trainer.dapo.engine_server.weight_transport=gloo",
            "trainer.dapo.engine_server.sleep_level=0"]
BAD = [
    (DENSE, ["trainer.num_nodes=1", "trainer.devices=12"], "trainer.num_nodes x trainer.devices"),
    (DENSE, ["model.context_parallel_size=2"], "model.context_parallel_size"),
    (DENSE, ["model.transformer_engine=False"], "model.transformer_engine=False on GPUs"),
    (MOE, ["trainer.accelerator=cpu", "model.transformer_engine=False", "model.moe_grouped_gemm=True"],
     "model.moe_grouped_gemm=True without model.transformer_engine"),
    (DENSE, ["+model.virtual_pipeline_model_parallel_size=2"], "model.virtual_pipeline_model_parallel_size"),
    (DENSE, ["model.tensor_model_parallel_size=16"], "num_query_groups"),
    (DENSE, ["model.pipeline_model_parallel_size=3"], "num_layers=64 (model/plan.arch) is not divisible"),
    # the layout the Qwen3-235B recipes had: NeMo 2.1 raises on 94 layers over 8 stages
    ("qwen3-235b-a22b_h100", ["model.pipeline_model_parallel_size=8", "model.expert_model_parallel_size=4"],
     "a pipeline size that divides the layers (1, 2, 47, 94)"),
    (DENSE, ["model.expert_model_parallel_size=2"], "num_moe_experts"),
    (MOE, ["model.expert_model_parallel_size=3"], "num_moe_experts=8 is not divisible"),
    (MOE, ["model.pipeline_model_parallel_size=4"], "tensor_model_parallel_size x expert_model_parallel_size"),
    (MOE, ["+model.expert_tensor_parallel_size=1"], "model.expert_tensor_parallel_size"),
    (MOE, ["model.optim.name=distributed_fused_adam"], "model.optim.name"),
    (MOE, ["model.sequence_parallel=False"], "model.sequence_parallel"),
    (MOE, ["model.megatron_amp_O2=False"], "model.megatron_amp_O2"),
    (MOE, ["model.dapo.offload_adam_states=True"], "model.dapo.offload_adam_states"),
    (MOE, ["+model.optim.overlap_param_sync=True"], "model.optim.overlap_param_sync=True"),
    (DENSE, ["+model.optim.overlap_param_gather_with_optimizer_step=True"],
     "model.optim.overlap_param_gather_with_optimizer_step=True"),
    # NeMo would end a decaying schedule after trainer.max_steps optimizer steps: 1/16 of the run
    (DENSE, ["model.optim.sched.name=CosineAnnealing"], "set model.optim.sched.max_steps to the run's optimizer "
                                                        "steps (6000 for trainer.dapo.max_steps=375)"),
    (DENSE, ["model.optim.sched.min_lr=0"], "would end after 1/16 of the run"),
    (DENSE, ["+model.calculate_per_token_loss=True"], "model.calculate_per_token_loss"),
    (DENSE, ["model.global_batch_size=500"], "model.global_batch_size=500"),
    (DENSE, ["model.micro_batch_size=0"], "model.micro_batch_size"),
    (DENSE, ["trainer.dapo.prompts_per_step=100"], "trainer.dapo.prompts_per_step x model.dapo.algorithm.group_size"),
    (DENSE, ["trainer.dapo.prompts_per_step=520"], "trainer.dapo.prompts_per_step=520 prompts"),
    (DENSE, ["model.dapo.algorithm.group_size=1"], "model.dapo.algorithm.group_size"),
    (DENSE, ["model.dapo.algorithm.dynamic_sampling.max_gen_batch_size=1000"], "max_gen_batch_size=1000"),
    (DENSE, ["model.dapo.algorithm.dynamic_sampling.on_budget_exhausted=crash"], "on_budget_exhausted"),
    (DENSE, ["model.dapo.algorithm.dynamic_sampling.max_gen_batches=0"], "max_gen_batches"),
    (DENSE, ["trainer.dapo.trt_llm.max_input_len=4096"], "max_input_len + model.dapo.length_params.max_length"),
    (DENSE, ["model.data.max_prompt_tokens=4096"], "model.data.max_prompt_tokens"),
    (DENSE, ["model.data.train_format=csv"], "model.data.train_format"),
    (DENSE, ["model.data.prompt_template=no-placeholder"], "model.data.prompt_template"),
    (DENSE, ["reward.num_workers=0"], "reward.num_workers"),
    (DENSE, ["model.dapo.algorithm.overlong.l_cache=20480"], "model.dapo.algorithm.overlong.l_cache"),
    (DENSE, ["model.dapo.algorithm.overlong.l_max=16384"], "model.dapo.algorithm.overlong.l_max=16384"),
    (DENSE, ["model.dapo.algorithm.eps_low=1.0"], "model.dapo.algorithm.eps_low"),
    (DENSE, ["model.dapo.algorithm.eps_high=-0.1"], "model.dapo.algorithm.eps_high"),
    (DENSE, ["model.dapo.algorithm.clip_c=1.0"], "model.dapo.algorithm.clip_c"),
    (DENSE, ["model.dapo.algorithm.agg=seq-mean"], "model.dapo.algorithm.agg"),
    (DENSE, ["model.dapo.algorithm.tis_cap=0"], "model.dapo.algorithm.tis_cap"),
    (DENSE, ["model.dapo.algorithm.reject_logp_diff=0.05"], "model.dapo.algorithm.reject_logp_diff=0.05 needs tis_cap"),
    (DENSE, ["model.dapo.algorithm.tis_level=sequence"], "model.dapo.algorithm.tis_level='sequence' weights nothing"),
    (DENSE, ["model.dapo.algorithm.tis_level=prefix", "model.dapo.algorithm.tis_cap=2.0"],
     "model.dapo.algorithm.tis_level='prefix' is not one of"),
    (DENSE, ["+trainer.dapo.group_size=8"], "model.dapo.algorithm.group_size instead"),
    (DENSE, ["+model.dapo.eps_high=0.3"], "model.dapo.algorithm.eps_high instead"),
    (DENSE, ["model.dapo.sampling_params.temperature=0"], "model.dapo.sampling_params.temperature"),
    (DENSE, ["model.dapo.sampling_params.temperature=0.000000001"], "temperature=1e-09 must be a number >= 0.0001"),
    (DENSE, ["model.dapo.sampling_params.temperature=nan"], "model.dapo.sampling_params.temperature='nan' must be"),
    (DENSE, ["model.dapo.logprob_chunk_size=0"], "model.dapo.logprob_chunk_size=0 must be an integer >= 1"),
    (DENSE, ["model.dapo.micro_batch_tokens=0"], "model.dapo.micro_batch_tokens=0 must be an integer >= 1 or null"),
    (DENSE, ["trainer.dapo.val.top_p=0"], "trainer.dapo.val.top_p"),
    (DENSE, ["trainer.dapo.val.n_samples=0"], "trainer.dapo.val.n_samples"),
    (DENSE, ["trainer.dapo.ppo_epochs=0"], "trainer.dapo.ppo_epochs"),
    (DENSE, ["reward.verifier=llm_judge"], "reward.verifier"),
    (DENSE, ["+model.num_layers=48"], "plan.arch.num_layers"),
    (DENSE, ["trainer.dapo.rollout.on_filler_full=finish"], "trainer.dapo.rollout.on_filler_full='finish' must be"),
    (DENSE, ["trainer.dapo.rollout.round_tokens=0"], "trainer.dapo.rollout.round_tokens=0"),
    (DENSE, ["trainer.dapo.rollout.max_staleness=-1"], "trainer.dapo.rollout.max_staleness=-1"),
    (DENSE, ["trainer.dapo.rollout_engine=legacy", "trainer.dapo.rollout.on_filler_full=suspend",
             "model.dapo.algorithm.tis_cap=2.0"], "suspend continues suspended samples through an engine server"),
    (DENSE, ["trainer.dapo.rollout.on_filler_full=suspend"], "set model.dapo.algorithm.tis_cap"),
    (DENSE, ["trainer.dapo.engine_server.placement=remote"], "engine_server.placement='remote' must be one of"),
    (DENSE, ["trainer.dapo.engine_server.weight_transport=pigeon"], "engine_server.weight_transport='pigeon'"),
    (DENSE, ["trainer.dapo.engine_server.weight_transport=nccl"], "NCCL refuses two ranks of one group on one GPU"),
    (DENSE, SEPARATE[:1] + SEPARATE[2:], "weight_transport=shm with placement separate"),
    (DENSE, SEPARATE[:2] + ["trainer.dapo.engine_server.address=tcp://e:{port}"],
     "with placement separate: the engines share no GPU"),
    (DENSE, ["trainer.dapo.rollout.overlap=2"], "trainer.dapo.rollout.overlap=2 must be true or false"),
    (DENSE, ["trainer.dapo.rollout.overlap=true"], "overlap=true runs a round of partial rollouts while"),
    (DENSE, ["trainer.dapo.rollout.overlap=true", "trainer.dapo.rollout.on_filler_full=suspend",
             "model.dapo.algorithm.tis_cap=2.0"], "set trainer.dapo.engine_server.sleep_level=0"),
]


def test_engines_on_gpus_of_their_own_validate_on_a_recipe():
    for address in ("tcp://engine-{engine}:{port}", "tcp://h1:29600,tcp://h2:29600", "unix:/e/{node}-{local}.sock"):
        cfg = crafted(DENSE, SEPARATE + [f"trainer.dapo.engine_server.address={address}"])
        assert cv.check_config(cfg) == []
    nccl = [*SEPARATE, "trainer.dapo.engine_server.weight_transport=nccl",
            "trainer.dapo.engine_server.address=tcp://e:{engine}"]
    assert cv.check_config(crafted(DENSE, nccl)) == []


def test_partial_rollouts_validate_on_a_recipe():
    on = ["trainer.dapo.rollout.on_filler_full=suspend", "model.dapo.algorithm.tis_cap=2.0"]
    assert cv.check_config(crafted(DENSE, on)) == []
    # max_staleness 0 continues nothing: no importance weights needed
    assert cv.check_config(crafted(DENSE, on[:1] + ["trainer.dapo.rollout.max_staleness=0"])) == []
    # one-step-off: a round on the engines of their own while the trainer trains
    overlap = [*on, *SEPARATE, "trainer.dapo.rollout.overlap=true", "trainer.dapo.engine_server.address=tcp://e:{port}"]
    assert cv.check_config(crafted(DENSE, overlap)) == []


@functools.lru_cache(maxsize=None)
def resolved(recipe: str) -> dict:
    return OmegaConf.to_container(cl.load_config(recipe))


def crafted(recipe: str, overrides) -> dict:
    """The resolved recipe as a plain dict with ``key=value`` overrides applied literally (no re-interpolation)."""
    cfg = copy.deepcopy(resolved(recipe))
    for item in overrides:
        key, _, value = item.lstrip("+").partition("=")
        *parents, leaf = key.split(".")
        node = cfg
        for part in parents:
            node = node[part]
        node[leaf] = yaml.safe_load(value)
    return cfg


def test_crafted_configs_start_from_valid_ones():
    assert cv.check_config(crafted(DENSE, [])) == [] and cv.check_config(crafted(MOE, [])) == []


@pytest.mark.parametrize("recipe,overrides,key", BAD, ids=[b[1][0] for b in BAD])
def test_each_rule_rejects_a_crafted_config_naming_the_key(recipe, overrides, key):
    cfg = crafted(recipe, overrides)
    with pytest.raises(cv.ConfigError, match=re.escape(key)) as err:
        cv.validate_config(cfg)
    assert any(key in p for p in err.value.problems)


def test_validator_accepts_plain_dicts_and_reports_all_problems_at_once():
    cfg = OmegaConf.to_container(cl.load_config(DENSE, ["model.dapo.algorithm.eps_low=2",
                                                        "model.dapo.algorithm.clip_c=0.5"]))
    problems = cv.check_config(cfg)
    assert len(problems) == 2 and "eps_low" in problems[0] and "clip_c" in problems[1]


def test_mirrored_choices_agree_with_the_core():
    from nemo_dapo.local.config import CHOICES
    from nemo_dapo.core.dynamic_sampling import BUDGET_POLICIES
    from nemo_dapo.core.loss import AGG_MODES
    from nemo_dapo.data.readers import READERS

    assert cv.AGG_MODES == AGG_MODES and cv.BUDGET_POLICIES == BUDGET_POLICIES
    assert cv.VERIFIERS == CHOICES["reward.verifier"] and set(cv.DATA_FORMATS) == set(READERS)


def test_config_modules_import_neither_nemo_nor_torch():
    code = ("import sys, nemo_dapo.cluster.config_load, nemo_dapo.cluster.config_validate, nemo_dapo.cluster.plan, "
            "nemo_dapo.cluster.registry; "
            "heavy = [m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'nemo', 'nemo_aligner', 'megatron', 'tensorrt_llm', 'hydra')]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def yaml_key_names(node) -> set:
    if isinstance(node, dict):
        return set(node) | {k for v in node.values() for k in yaml_key_names(v)}
    return set()


def config_keys_read_by(path: Path) -> set:
    """String keys the runtime reads with ``<cfg-ish>.get("key", ...)`` (receivers named like config nodes)."""
    import ast

    receivers = {"cfg", "d", "trt", "sp", "ov", "ds", "v", "dapo", "model_cfg"}
    keys = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and isinstance(node.func.value, ast.Name) and node.func.value.id in receivers and node.args
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            keys.add(node.args[0].value)
    return keys


def test_every_config_key_the_runtime_reads_is_documented_in_the_base():
    documented = yaml_key_names(OmegaConf.to_container(OmegaConf.load(BASE)))
    read = set()
    for name in ("actor", "trainer", "generation"):
        path = ROOT / "nemo_dapo" / "aligner" / f"{name}.py"
        if path.is_file():
            read |= config_keys_read_by(path)
    assert read - documented == set()


def test_a_decaying_schedule_with_its_own_length_is_accepted():
    assert cv.check_config(crafted(DENSE, ["model.optim.sched.name=CosineAnnealing",
                                           "model.optim.sched.max_steps=6000"])) == []


# ---- one step past the edge of each engine_server / length rule (the BAD list above is far from the edges) ---------
ES = "trainer.dapo.engine_server"
EDGES = [
    ([f"{ES}.connect_timeout_s=0"], f"{ES}.connect_timeout_s=0 must be a positive number of seconds"),
    ([f"{ES}.free_gpu_memory_fraction=1.0"], f"{ES}.free_gpu_memory_fraction=1.0 must be in (0, 1)"),
    ([f"{ES}.expert_parallel_size=3"], f"{ES}.expert_parallel_size=3 must divide tensor_parallel_size=8"),
    ([f"{ES}.max_seq_len=22527"], f"{ES}.max_input_len (2048) + model.dapo.length_params.max_length (20480) exceeds"),
    (["model.data.max_prompt_tokens=2049"], "model.data.max_prompt_tokens=2049 > trainer.dapo.trt_llm.max_input_len"),
    (["model.dapo.algorithm.overlong.l_max=20481"], "overlong.l_max=20481 differs from the generation cap"),
    (["trainer.devices=true"], "trainer.devices=True must be an integer >= 1"),  # a YAML bool is not a count
    *[([f"{key}=true"], f"{key}=True must be an integer >= 1")
      for key in ("model.micro_batch_size", "trainer.dapo.val.n_samples", "trainer.dapo.ppo_epochs",
                  "reward.num_workers")],
    (["model.encoder_seq_length=true"], "model.encoder_seq_length=True, "),
]


@pytest.mark.parametrize("overrides,key", EDGES, ids=[e[0][0] for e in EDGES])
def test_one_step_past_each_edge_is_refused_naming_the_key(overrides, key):
    problems = cv.check_config(crafted(DENSE, overrides))
    assert any(key in p for p in problems), problems


def test_the_edges_themselves_are_accepted():
    seq = resolved(DENSE)["model"]["encoder_seq_length"]
    edges = [f"{ES}.max_seq_len={2048 + 20480}", "model.data.max_prompt_tokens=2048", f"{ES}.connect_timeout_s=0.5",
             f"trainer.dapo.trt_llm.max_input_len={seq - 20480}", f"{ES}.max_input_len={seq - 20480}"]
    assert cv.check_config(crafted(DENSE, edges)) == []


def test_the_defaults_list_is_merged_in_its_order_as_hydra_does(tmp_path):
    """cluster/yaml_compose.py on the cases the repo's recipes do not use (_self_ first, a nested group, a loop)."""
    (tmp_path / "opt" / "sub").mkdir(parents=True)
    (tmp_path / "base.yaml").write_text("a: base\nb: base\n")
    (tmp_path / "opt" / "sub" / "x.yaml").write_text("c: mounted\n")
    (tmp_path / "self_first.yaml").write_text("defaults:\n  - _self_\n  - base\n  - opt/sub: x\na: self\n")
    (tmp_path / "self_last.yaml").write_text("defaults:\n  - base\n  - _self_\na: self\n")
    (tmp_path / "loop.yaml").write_text("defaults:\n  - loop\na: 1\n")

    def ours(name):
        tree = compose_file(str(tmp_path / f"{name}.yaml"), str(tmp_path), OmegaConf.load, ValueError)
        return OmegaConf.to_container(tree)

    assert ours("self_first") == {"a": "base", "b": "base", "opt": {"sub": {"c": "mounted"}}}  # later entries win
    assert ours("self_last") == {"a": "self", "b": "base"}
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        for name in ("self_first", "self_last"):
            assert OmegaConf.to_container(compose(config_name=name)) == ours(name), name
    with pytest.raises(ValueError, match="includes itself through its defaults list"):
        ours("loop")
