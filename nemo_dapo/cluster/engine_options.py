"""The engine server's constructor options from the run's config (``trainer.dapo.engine_server``), so that the
engine the launcher starts is the engine the config (and ``nemo-dapo plan``) describes. Imports nothing of NeMo.

    python -m nemo_dapo.cluster.engine_options --config-name recipes/qwen2.5-32b_h100 [key=value ...] --out FILE

writes ``{"engine": NAME, "engine_gpus": TP x PP, "options": {...}}``; ``containers/dapo.sbatch`` starts every
server with ``--options-file FILE`` and takes its GPUs per engine from ``engine_gpus``.

Read strictly: a key missing from the config is an error naming it (every default lives in conf/gpt_dapo_actor.yaml,
none here). A value the chosen adapter cannot honour (PP > 1 on TensorRT-LLM's adapter, EP on the local engine) is
refused, never dropped. Lengths: ``max_seq_len`` null means ``max_input_len + model.dapo.length_params.max_length``
(the YAML's documented meaning); TensorRT-LLM gets it as prompt_budget = max_input_len and response_budget =
max_seq_len - max_input_len.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from nemo_dapo.core import engine_registry

KEY = "trainer.dapo.engine_server"
LENGTH_KEY = "model.dapo.length_params.max_length"
SCHEDULERS = ("max_utilization", "guaranteed_no_evict")
# engine_server.dtype (the dtype weights are sent in) -> the engine's dtype; null: the checkpoint's
ENGINE_DTYPES = {None: "auto", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# keys read for every engine; null allowed only where the YAML documents what null means
SERVER_KEYS = ("tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size", "max_batch_size",
               "max_num_tokens", "max_input_len", "max_seq_len", "free_gpu_memory_fraction", "enable_block_reuse",
               "capacity_scheduler", "dtype", "sleep_level")
NULLABLE = ("max_seq_len", "dtype")


class EngineOptionsError(ValueError):
    """The config cannot be turned into engine options; the message names the key and the fix."""


def _at(cfg: dict, dotted: str):
    node = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise EngineOptionsError(f"{dotted} is missing from the config; set it (conf/gpt_dapo_actor.yaml "
                                     "documents it)")
        node = node[part]
    return node


def read_server(cfg: dict) -> dict:
    """The engine_server keys of a resolved plain-dict config, strictly, with ``max_seq_len`` resolved."""
    srv = _at(cfg, KEY)
    if not isinstance(srv, dict):
        raise EngineOptionsError(f"{KEY} must be a mapping, got {srv!r}")
    out = {}
    for k in SERVER_KEYS:
        if k not in srv:
            raise EngineOptionsError(f"{KEY}.{k} is missing; set it (conf/gpt_dapo_actor.yaml documents it)")
        if srv[k] is None and k not in NULLABLE:
            raise EngineOptionsError(f"{KEY}.{k} is null; set a value (conf/gpt_dapo_actor.yaml documents it)")
        out[k] = srv[k]
    if out["capacity_scheduler"] not in SCHEDULERS:
        raise EngineOptionsError(f"{KEY}.capacity_scheduler={out['capacity_scheduler']!r} must be one of "
                                 f"{SCHEDULERS}")
    if out["dtype"] not in ENGINE_DTYPES:
        raise EngineOptionsError(f"{KEY}.dtype={out['dtype']!r} must be null, bf16, fp16 or fp32")
    l_max = _at(cfg, LENGTH_KEY)
    if out["max_seq_len"] is None:
        out["max_seq_len"] = out["max_input_len"] + l_max
    elif out["max_seq_len"] < out["max_input_len"] + l_max:
        raise EngineOptionsError(f"{KEY}.max_seq_len={out['max_seq_len']} < max_input_len ({out['max_input_len']})"
                                 f" + {LENGTH_KEY} ({l_max}); fix: raise it or set it to null")
    out["max_length"] = l_max
    return out


def _refuse(engine: str, key: str, value, why: str):
    raise EngineOptionsError(f"{KEY}.{key}={value!r} cannot be honoured by the {engine!r} engine adapter ({why}); "
                             f"fix: change {KEY}.{key} or trainer.dapo.rollout_engine")


def trtllm_options(s: dict) -> dict:
    """nemo_dapo/engines/trtllm.py TRTLLMEngine; it has no pipeline parallelism. Several TP engines in one run get
    ``allreduce_strategy="NCCL"``: TensorRT-LLM's own AsyncLLM (llmapi/async_llm.py) forces it for RL, whose default
    AllReduce gave wrong log-probs at large batch with several rollout instances (nvbugs/5727691); verl does the same."""
    if s["pipeline_parallel_size"] != 1:
        _refuse("trtllm", "pipeline_parallel_size", s["pipeline_parallel_size"], "TRTLLMEngine has no PP option")
    nccl = {"allreduce_strategy": "NCCL"} if s["tensor_parallel_size"] > 1 and s["num_engines"] > 1 else {}
    return {**nccl, "prompt_budget": s["max_input_len"], "response_budget": s["max_seq_len"] - s["max_input_len"],
            "max_input_len": s["max_input_len"], "max_batch_size": s["max_batch_size"],
            "max_num_tokens": s["max_num_tokens"], "free_gpu_memory_fraction": s["free_gpu_memory_fraction"],
            "enable_block_reuse": bool(s["enable_block_reuse"]), "capacity_scheduler": s["capacity_scheduler"],
            "tensor_parallel_size": s["tensor_parallel_size"],
            "moe_expert_parallel_size": s["expert_parallel_size"], "dtype": ENGINE_DTYPES[s["dtype"]],
            "enable_sleep": s["sleep_level"] > 0}


def vllm_options(s: dict) -> dict:
    """nemo_dapo/engines/vllm.py VLLMEngine (its **engine_kwargs go to vllm.EngineArgs)."""
    # vLLM sizes its KV cache by gpu_memory_utilization, a share of the TOTAL memory that includes the weights;
    # free_gpu_memory_fraction is a share of what is free after loading: no static conversion exists.
    _refuse("vllm", "free_gpu_memory_fraction", s["free_gpu_memory_fraction"],
            "vLLM budgets a share of the total GPU memory (gpu_memory_utilization), not of the memory free after "
            "loading; the cluster launcher has no vLLM memory mapping yet")


def local_options(s: dict) -> dict:
    """nemo_dapo/engines/local.py LocalEngine.from_path: one device, a dense cache of max_batch_size x max_seq_len
    (the KV pool keys - fraction, block reuse, scheduler, max_num_tokens - size nothing there)."""
    for k in ("tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size"):
        if s[k] != 1:
            _refuse("local", k, s[k], "LocalEngine runs on one device")
    return {"max_batch_size": s["max_batch_size"], "max_seq_len": s["max_seq_len"]}


def engine_options(cfg: dict) -> dict:
    """``{"engine", "engine_gpus", "options"}`` for ``trainer.dapo.rollout_engine`` of a resolved plain-dict config;
    raises :class:`EngineOptionsError` naming the key and the fix."""
    from nemo_dapo.cluster.config_validate import _engine_server, sizes

    engine = _at(cfg, "trainer.dapo.rollout_engine")
    spec = engine_registry.ENGINES.get(engine) if isinstance(engine, str) else None
    if spec is None or spec.options is None:
        mapped = sorted(n for n, e in engine_registry.ENGINES.items() if e.options is not None)
        raise EngineOptionsError(f"trainer.dapo.rollout_engine={engine!r} runs no engine server; the servers are "
                                 f"{mapped}")
    problems = list(_engine_server(cfg, sizes(cfg)))
    if problems:
        raise EngineOptionsError("; ".join(problems))
    s = read_server(cfg)
    s["num_engines"] = max(1, sizes(cfg)["world"] // (s["tensor_parallel_size"] * s["pipeline_parallel_size"]))
    return {"engine": engine, "engine_gpus": s["tensor_parallel_size"] * s["pipeline_parallel_size"],
            "options": engine_registry.load(spec.options)(s)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m nemo_dapo.cluster.engine_options", description=__doc__.split("\n\n")[0])
    p.add_argument("--config-name", required=True, help="recipe (recipes/NAME, a name under conf/recipes/ or a path)")
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (+key=value adds a key)")
    args = p.parse_intermixed_args(argv)
    from omegaconf import OmegaConf

    from nemo_dapo.cluster.config_load import load_config

    try:
        cfg = OmegaConf.to_container(load_config(args.config_name, args.overrides), resolve=True)
        result = engine_options(cfg)
    except (FileNotFoundError, ValueError) as e:  # EngineOptionsError is a ValueError
        print(f"engine_options: error: {e}", file=sys.stderr)
        return 2
    Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"engine_options: {result['engine']} engines of {result['engine_gpus']} GPUs -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
