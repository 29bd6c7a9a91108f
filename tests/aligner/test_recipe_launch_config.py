"""Every GPU recipe through the launcher's config path up to the model build, with NeMo 2.1 and NeMo-Aligner 0.7's
own code: Hydra's (struct) config of ``--config-name recipes/<name>``, the validator, NeMo-Aligner's
``load_and_override_model_config`` over the ``model_config.yaml`` that ``nemo-dapo convert`` writes for the recipe's
``plan.arch`` (the model's config.json facts), the validator again, NeMo's trainer builder
(``resolve_and_create_trainer``, on the CPU accelerator: the one override), then NeMo's ``build_transformer_config``
into megatron-core 0.10's ``TransformerConfig`` (whose ``__post_init__`` checks run), which must come out as the
recipe means it, and the recompute reset NeMo-Aligner's ``prepare_for_inference`` does before generating.

The model itself is not built (235B parameters): NeMo's methods run on an actor object made without ``__init__``,
given only what they read (the config, the trainer's precision and the dtypes ``MegatronBaseModel.__init__``
derives). Runs in a NeMo process of its own (tests/support/nemo_cpu.py). Before this test, two faults passed the
CPU tests, whose tiny NeMo-written checkpoints carry every NeMo key: the Qwen3-235B recipes' 94 layers over 8
pipeline stages ("num_layers (94) should be divisible by pipeline_model_parallel_size (8)"), and every recipe over a
converted checkpoint stopped in the trainer builder ("Key 'gradient_as_bucket_view' is not in struct").
"""
import pytest
from omegaconf import OmegaConf

from nemo_dapo.cluster import config_load as cl
from nemo_dapo.cluster.plan import arch_from_config
from tests.aligner.conftest import needs_nemo
from tests.support.dist import ROOT, run_json

GPU_RECIPES = sorted(p.stem for p in (ROOT / "conf" / "recipes").glob("*.yaml") if not p.stem.startswith("tiny"))
FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size",
          "tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
          "sequence_parallel", "bf16", "normalization", "qk_layernorm", "gated_linear_unit", "add_bias_linear",
          "add_qkv_bias", "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_router_pre_softmax",
          "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_token_dispatcher_type", "moe_grouped_gemm",
          "recompute_granularity", "recompute_method", "recompute_num_layers")

SCRIPT = r'''
import json, os, sys, tempfile, types
from tests.support import nemo_cpu  # noqa: F401  (first)
import torch
import yaml
from hydra import compose, initialize_config_dir
from nemo_aligner.utils.train_script_utils import resolve_and_create_trainer
from nemo_aligner.utils.utils import load_and_override_model_config
from omegaconf import OmegaConf
from nemo_dapo.aligner.actor import MegatronGPTDAPOActorModel
from nemo_dapo.cluster.config_load import register_resolvers
from nemo_dapo.cluster.config_validate import validate_config
from nemo_dapo.megatron.convert import load_hf_config
from nemo_dapo.megatron.convert_ckpt import nemo_model_config
from nemo_dapo.megatron.convert_shard import Parallel
from tests.aligner.test_recipe_launch_config import FIELDS, hf_config_json

register_resolvers()
CPU = ["trainer.accelerator=cpu", "trainer.devices=1", "trainer.num_nodes=1"]


def launch_config(recipe, checkpoint):
    with initialize_config_dir(config_dir=os.path.abspath("conf"), version_base=None):
        cfg = compose(config_name=f"recipes/{recipe}")  # what @hydra_runner hands train_gpt_dapo.main
    validate_config(cfg)
    with open(f"{checkpoint}/config.json", "w") as f:
        json.dump(hf_config_json(OmegaConf.to_container(cfg, resolve=True)), f)
    hf = load_hf_config(checkpoint)
    with open(f"{checkpoint}/model_config.yaml", "w") as f:  # as convert_ckpt.save_nemo_checkpoint writes it
        yaml.safe_dump(nemo_model_config(hf, Parallel(tp=1, pp=1, ep=1), precision="bf16",
                                         padded_vocab=hf.vocab_size), f, sort_keys=False)
    cfg.model = load_and_override_model_config(checkpoint, cfg.model)
    validate_config(cfg)
    return cfg


def stage(recipe):
    with tempfile.TemporaryDirectory() as checkpoint:
        cfg = launch_config(recipe, checkpoint)
    yield "trainer"
    on_cpu = OmegaConf.merge(cfg, OmegaConf.from_dotlist(CPU))
    OmegaConf.set_struct(on_cpu, True)
    resolve_and_create_trainer(on_cpu, "dapo")
    yield "TransformerConfig"
    model = MegatronGPTDAPOActorModel.__new__(MegatronGPTDAPOActorModel)
    torch.nn.Module.__init__(model)
    model._cfg = cfg.model
    model.__dict__["_trainer"] = types.SimpleNamespace(precision=cfg.trainer.precision)
    model.torch_dtype = model.autocast_dtype = torch.bfloat16  # MegatronBaseModel.__init__ for precision bf16
    model.params_dtype = torch.bfloat16 if cfg.model.megatron_amp_O2 else torch.float32
    model.megatron_timers = None
    tc = model.build_transformer_config()
    yield "recompute reset"
    model.model = [types.SimpleNamespace(decoder=types.SimpleNamespace(config=tc))]  # the built GPTModel's config
    before = OmegaConf.to_container(cfg.model)
    model._reset_activation_checkpointing_args()  # NeMo-Aligner's prepare_for_inference, before generating
    model._restore_activation_checkpointing_args()
    assert OmegaConf.to_container(cfg.model) == before, "the recompute keys did not come back"
    yield {k: getattr(tc, k) for k in FIELDS}


out = {}
for recipe in sys.argv[1:]:
    where = "config"
    try:
        for where in stage(recipe):
            pass
        out[recipe] = where
    except Exception as e:
        out[recipe] = {"error": f"{where}: {type(e).__name__}: {str(e).splitlines()[0]}"}
print(json.dumps(out))
'''


def hf_config_json(cfg: dict) -> dict:
    """The config.json keys ``nemo-dapo convert`` reads, for a recipe's ``plan.arch`` (from the model's own
    config.json); the family from its shape: experts and QK-norm = Qwen3-MoE, experts = Mixtral, QK-norm = Qwen3,
    else Qwen2 (Qwen2.5)."""
    a = arch_from_config(cfg)
    raw = dict(num_hidden_layers=a.num_layers, hidden_size=a.hidden_size, intermediate_size=a.ffn_hidden_size,
               num_attention_heads=a.num_attention_heads, num_key_value_heads=a.num_query_groups,
               head_dim=a.kv_channels, vocab_size=a.vocab_size, tie_word_embeddings=a.tied_embeddings,
               max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, hidden_act="silu")
    if a.num_moe_experts and a.qk_norm:
        raw.update(model_type="qwen3_moe", num_experts=a.num_moe_experts, num_experts_per_tok=a.moe_router_topk,
                   moe_intermediate_size=a.moe_ffn_hidden_size, norm_topk_prob=True, decoder_sparse_step=1,
                   mlp_only_layers=[])
    elif a.num_moe_experts:
        raw.update(model_type="mixtral", num_local_experts=a.num_moe_experts, num_experts_per_tok=a.moe_router_topk)
    else:
        raw.update(model_type="qwen3" if a.qk_norm else "qwen2")
    return raw


@pytest.fixture(scope="module")
def built():
    return run_json("-c", SCRIPT, *GPU_RECIPES, timeout=600)


def test_there_are_ten_gpu_recipes():
    assert len(GPU_RECIPES) == 10, GPU_RECIPES


@needs_nemo
@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_the_launch_config_path_accepts_the_recipe_and_builds_its_transformer_config_as_meant(built, recipe):
    tc = built[recipe]
    assert "error" not in tc, f"{recipe}: the launch stops at {tc.get('error')}"
    cfg = OmegaConf.to_container(cl.load_config(recipe), resolve=True)
    m, a = cfg["model"], arch_from_config(cfg)
    assert (tc["num_layers"], tc["hidden_size"], tc["num_attention_heads"], tc["num_query_groups"],
            tc["kv_channels"]) == (a.num_layers, a.hidden_size, a.num_attention_heads, a.num_query_groups,
                                   a.kv_channels)
    assert (tc["tensor_model_parallel_size"], tc["pipeline_model_parallel_size"], tc["expert_model_parallel_size"]) \
        == (m["tensor_model_parallel_size"], m["pipeline_model_parallel_size"], m.get("expert_model_parallel_size", 1))
    assert tc["num_layers"] % tc["pipeline_model_parallel_size"] == 0  # megatron-core 0.10 builds L // PP a stage
    assert tc["sequence_parallel"] is True and tc["bf16"] is bool(m["megatron_amp_O2"])
    assert (tc["normalization"], tc["gated_linear_unit"], tc["add_bias_linear"]) == ("RMSNorm", True, False)
    assert tc["qk_layernorm"] is a.qk_norm and tc["add_qkv_bias"] is a.qkv_bias
    assert (tc["recompute_granularity"], tc["recompute_method"], tc["recompute_num_layers"]) == ("full", "uniform", 1)
    if a.is_moe:
        assert (tc["num_moe_experts"], tc["moe_router_topk"], tc["moe_ffn_hidden_size"]) == \
            (a.num_moe_experts, a.moe_router_topk, a.moe_ffn_hidden_size)
        # top-k of the logits, then a softmax over them: HF's renormalised top-k (Qwen3-MoE, Mixtral); no balancing
        assert tc["moe_router_pre_softmax"] is False
        assert (tc["moe_router_load_balancing_type"], tc["moe_aux_loss_coeff"]) == ("none", 0.0)
        assert (tc["moe_token_dispatcher_type"], tc["moe_grouped_gemm"]) == ("alltoall", False)
    else:
        assert tc["num_moe_experts"] is None and tc["ffn_hidden_size"] == a.ffn_hidden_size
