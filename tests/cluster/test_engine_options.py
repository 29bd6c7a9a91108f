"""nemo_dapo.cluster.engine_options: the engine server's options from trainer.dapo.engine_server, read strictly,
and accepted by the adapter's constructor (its signature, inspected: no TensorRT-LLM needed) for every recipe."""
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from nemo_dapo.cluster import config_load as cl
from nemo_dapo.cluster.engine_options import EngineOptionsError, engine_options
from nemo_dapo.engines.local import LocalEngine
from nemo_dapo.engines.trtllm import TRTLLMEngine

ROOT = Path(__file__).resolve().parents[2]
ES = "trainer.dapo.engine_server"
CLUSTER = sorted(p.stem for p in (ROOT / "conf" / "recipes").glob("*.yaml") if not p.stem.startswith("tiny_cpu"))


def cfg_of(recipe, *overrides):
    return OmegaConf.to_container(cl.load_config(recipe, overrides), resolve=True)


def accepted(factory, options):
    """Options the constructor takes by name (a **kwargs catch-all does not count: TRTLLMEngine refuses unknowns)."""
    params = inspect.signature(factory).parameters
    named = {k for k, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    return sorted(set(options) - named)


@pytest.mark.parametrize("recipe", CLUSTER)
def test_each_cluster_recipe_gives_options_the_trtllm_adapter_accepts(recipe):
    cfg = cfg_of(recipe)
    out = engine_options(cfg)
    srv = cfg["trainer"]["dapo"]["engine_server"]
    assert out["engine"] == "trtllm" == cfg["trainer"]["dapo"]["rollout_engine"]
    assert accepted(TRTLLMEngine.__init__, out["options"]) == []
    opts = out["options"]
    assert out["engine_gpus"] == srv["tensor_parallel_size"] * srv["pipeline_parallel_size"]
    assert opts["tensor_parallel_size"] == srv["tensor_parallel_size"]
    assert opts["moe_expert_parallel_size"] == srv["expert_parallel_size"]
    assert opts["prompt_budget"] == opts["max_input_len"] == srv["max_input_len"]
    assert opts["response_budget"] == cfg["model"]["dapo"]["length_params"]["max_length"]
    for k in ("max_batch_size", "max_num_tokens", "free_gpu_memory_fraction", "enable_block_reuse",
              "capacity_scheduler"):
        assert opts[k] == srv[k], k
    assert opts["capacity_scheduler"] == "max_utilization" and opts["dtype"] == "bfloat16"
    assert opts["enable_sleep"] is (srv["sleep_level"] > 0)


def test_overrides_reach_the_options_and_unhonourable_values_are_refused():
    out = engine_options(cfg_of("qwen2.5-32b_h100", f"{ES}.max_batch_size=64", f"{ES}.dtype=null",
                                f"{ES}.capacity_scheduler=guaranteed_no_evict", f"{ES}.max_seq_len=30000"))
    o = out["options"]
    assert (o["max_batch_size"], o["dtype"], o["capacity_scheduler"]) == (64, "auto", "guaranteed_no_evict")
    assert o["prompt_budget"] + o["response_budget"] == 30000
    with pytest.raises(EngineOptionsError, match=f"{ES}.pipeline_parallel_size=2 cannot be honoured by the "
                                                 "'trtllm' engine adapter"):
        engine_options(cfg_of("qwen2.5-32b_h100", f"{ES}.pipeline_parallel_size=2", f"{ES}.tensor_parallel_size=4"))
    with pytest.raises(EngineOptionsError, match=f"{ES}.free_gpu_memory_fraction=0.5 cannot be honoured by the "
                                                 "'vllm' engine adapter"):
        engine_options(cfg_of("qwen2.5-32b_h100", "trainer.dapo.rollout_engine=vllm"))
    with pytest.raises(EngineOptionsError, match=f"{ES}.tensor_parallel_size=8 cannot be honoured by the 'local'"):
        engine_options(cfg_of("qwen2.5-32b_h100", "trainer.dapo.rollout_engine=local"))
    with pytest.raises(EngineOptionsError, match="runs no engine server"):
        engine_options(cfg_of("qwen2.5-32b_h100", "trainer.dapo.rollout_engine=legacy"))


def test_local_engine_options_fit_its_factory():
    out = engine_options(cfg_of("qwen2.5-32b_h100", "trainer.dapo.rollout_engine=local", "trainer.devices=1",
                                "trainer.num_nodes=1", *(f"{ES}.{k}=1" for k in ("tensor_parallel_size",
                                                                                "expert_parallel_size"))))
    assert out["engine_gpus"] == 1 and out["options"] == {"max_batch_size": 256, "max_seq_len": 2048 + 20480}
    assert accepted(LocalEngine.__init__, out["options"]) == []


@pytest.mark.parametrize("key", ["max_num_tokens", "enable_block_reuse", "capacity_scheduler", "max_seq_len"])
def test_a_missing_key_is_an_error_naming_it(key):
    cfg = cfg_of("qwen2.5-32b_h100")
    del cfg["trainer"]["dapo"]["engine_server"][key]
    with pytest.raises(EngineOptionsError, match=f"{ES}.{key} is missing"):
        engine_options(cfg)


def test_cli_writes_the_json_file_and_fails_clearly(tmp_path):
    out = tmp_path / "engine_options.json"
    cmd = [sys.executable, "-m", "nemo_dapo.cluster.engine_options", "--config-name", "recipes/qwen2.5-32b_h100",
           f"{ES}.max_batch_size=128", "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True)
    data = json.loads(out.read_text())
    assert data == engine_options(cfg_of("qwen2.5-32b_h100", f"{ES}.max_batch_size=128"))
    assert data["options"]["max_batch_size"] == 128
    bad = subprocess.run([*cmd[:-2], f"{ES}.capacity_scheduler=fifo", "--out", str(tmp_path / "x.json")],
                         cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and f"{ES}.capacity_scheduler='fifo' must be one of" in bad.stderr
    assert not (tmp_path / "x.json").exists()


def test_several_tp_engines_get_nccl_allreduce_and_a_single_one_keeps_the_default():
    """TensorRT-LLM's AsyncLLM (llmapi/async_llm.py) forces allreduce_strategy NCCL for RL with several instances."""
    many = engine_options(cfg_of("qwen2.5-32b_h100", "trainer.num_nodes=2", "trainer.devices=8"))["options"]
    assert many["tensor_parallel_size"] == 8 and many["allreduce_strategy"] == "NCCL"
    one = engine_options(cfg_of("qwen2.5-32b_h100", "trainer.num_nodes=1", "trainer.devices=8"))["options"]
    assert "allreduce_strategy" not in one  # one engine: TensorRT-LLM's default
    tp1 = engine_options(cfg_of("qwen2.5-32b_h100", "trainer.num_nodes=1", "trainer.devices=8",
                                f"{ES}.tensor_parallel_size=1", f"{ES}.expert_parallel_size=1"))["options"]
    assert "allreduce_strategy" not in tp1  # no TP all-reduce at all
    assert accepted(TRTLLMEngine.__init__, many) == []


def test_a_max_seq_len_that_exactly_fits_is_taken_and_a_null_count_is_refused():
    o = engine_options(cfg_of("qwen2.5-32b_h100", f"{ES}.max_seq_len={2048 + 20480}"))["options"]
    assert (o["prompt_budget"], o["response_budget"]) == (2048, 20480)
    with pytest.raises(EngineOptionsError, match=f"{ES}.max_batch_size is null; set a value"):
        engine_options(cfg_of("qwen2.5-32b_h100", f"{ES}.max_batch_size=null"))
