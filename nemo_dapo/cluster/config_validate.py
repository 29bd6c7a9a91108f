"""Validate DAPO actor configs (conf/gpt_dapo_actor.yaml + an override-only recipe) without NeMo; loading them:
``config_load.py``.

``check_config(cfg)`` returns every problem found, each naming the keys involved and a fix; ``validate_config``
raises :class:`ConfigError` with all of them. The rules mirror what would fail later, at scale, inside
megatron-core 0.10 / NeMo 2.1 / NeMo-Aligner 0.7.0 (world size vs TP x PP x CP, expert-parallel groups with
ETP = TP, micro-batch arithmetic, the TRT-LLM length assertion) plus the DAPO-specific ranges of the loss.
Architecture facts (heads, experts) are read from ``model.*`` (after the checkpoint config is merged) and else
from ``plan.arch.*`` (what the recipe declares for ``nemo-dapo plan``).
"""
from __future__ import annotations

import math
from typing import Any

from nemo_dapo.cluster.config_load import (ALGORITHM_BLOCK, ALGORITHM_KEYS, moved_keys_in, moved_message, select,
                                           to_plain)
from nemo_dapo.cluster.engine_owners import engine_owners, megatron_mp_groups
from nemo_dapo.core import engine_registry  # torch-free: trainer.dapo.rollout_engine's values
from nemo_dapo.core import settings as algorithm  # torch-free: the rules of the algorithm block, shared with the CLI
from nemo_dapo.core.settings import ConfigError  # the one config error of both paths

AGG_MODES, BUDGET_POLICIES = algorithm.AGG_MODES, algorithm.BUDGET_POLICIES
VERIFIERS = ("dapo", "tolerant", "math_verify")  # the CPU path's reward.verifier choices (local/config_schema.py)
DATA_FORMATS = ("dapo_math", "verl", "aime2024", "aime2025", "math500", "gsm8k")  # nemo_dapo.data.readers.READERS
DISTRIBUTED_OPTIMIZERS = ("distributed_fused_adam", "mcore_distributed_optim")
ENGINE_SLEEP_LEVELS = (0, 1, 2)  # trainer.dapo.engine_server.sleep_level
ENGINE_PLACEMENTS = ("colocated", "separate")  # trainer.dapo.engine_server.placement
ROLLOUT_MODES = ("abort", "suspend")  # trainer.dapo.rollout.on_filler_full (aligner/trainer.rollout_mode)
OFFLOAD_TRAINING_STATE = "model.dapo.offload_training_state"  # read by the trainer AND by `nemo-dapo plan`
# The planner's former own key for the same quantity: refused, so that a plan never assumes what the run does not do
GENERATE_OFFLOAD_GONE = (f"plan.generate_offload is not read any more: the planner plans what the trainer does, "
                         f"from {OFFLOAD_TRAINING_STATE}; fix: remove plan.generate_offload and set "
                         f"{OFFLOAD_TRAINING_STATE}=True for a whole-training-state offload while generating (False: "
                         "none beyond model.dapo.offload_adam_states)")

def _arch(cfg: dict, key: str) -> Any:
    """An architecture fact: the merged checkpoint config (model.*) wins over the recipe's plan.arch.*."""
    return select(cfg, f"model.{key}", select(cfg, f"plan.arch.{key}"))


SIZE_KEYS = (("nodes", "trainer.num_nodes"), ("devices", "trainer.devices"),
             ("tp", "model.tensor_model_parallel_size"), ("pp", "model.pipeline_model_parallel_size"),
             ("cp", "model.context_parallel_size"), ("ep", "model.expert_model_parallel_size"))


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def sizes(cfg: dict) -> dict:
    """World size and parallel sizes (defaults 1) of a plain config dict. ``bad`` lists the sizes that are not
    integers >= 1 (each message names its key and the fix); those count as 1 here and ``dp`` is None, so that the
    rules' arithmetic never meets a string, a fraction or a zero."""
    s, bad = {}, []
    for name, key in SIZE_KEYS:
        value = select(cfg, key, 1)
        if not _is_count(value):
            bad.append(f"{key}={value!r} must be an integer >= 1; fix: set {key} to a whole number of "
                       f"{'nodes' if name == 'nodes' else 'GPUs per node' if name == 'devices' else 'ranks'} "
                       "(1 or more)")
        s[name] = value if _is_count(value) else 1
    s["world"], s["bad"] = s.pop("nodes") * s.pop("devices"), bad
    model_size = s["tp"] * s["pp"] * s["cp"]
    s["dp"] = s["world"] // model_size if not bad and s["world"] % model_size == 0 else None
    reshard = select(cfg, "trainer.dapo.trt_llm.reshard", False) and select(cfg, "trainer.dapo.trt_llm.enable", False)
    s["dp_gen"] = None if s["dp"] is None else s["dp"] * (s["pp"] if reshard else 1)
    return s


# ---- rules: each yields messages naming the keys and the fix ----------------------------------------------------
def _layout(cfg: dict, s: dict):
    tp, pp, cp, world = s["tp"], s["pp"], s["cp"], s["world"]
    if s["bad"]:
        yield from s["bad"]
        return
    if world % (tp * pp * cp):
        yield (f"trainer.num_nodes x trainer.devices = {world} GPUs is not divisible by "
               f"model.tensor_model_parallel_size x pipeline_model_parallel_size x context_parallel_size = "
               f"{tp}x{pp}x{cp} = {tp * pp * cp}; "
               "fix: pick sizes whose product divides the world size (DP = world / (TP x PP x CP))")
    if cp != 1:
        yield (f"model.context_parallel_size={cp}: NeMo-Aligner 0.7.0's GPT actor does not split sequences over "
               "context-parallel ranks (CP exists only for its SFT/DPO); fix: set it to 1 and use full recompute")
    vpp = select(cfg, "model.virtual_pipeline_model_parallel_size")
    if vpp not in (None, 1):
        yield (f"model.virtual_pipeline_model_parallel_size={vpp}: NeMo-Aligner's actors and the Megatron "
               "distributed optimizer reject virtual pipelining; fix: set it to null")
    layers = _arch(cfg, "num_layers")
    if _is_count(layers) and layers % pp:
        stages = [d for d in range(1, layers + 1) if layers % d == 0 and d <= world]
        yield (f"num_layers={layers} (model/plan.arch) is not divisible by model.pipeline_model_parallel_size={pp}: "
               "NeMo 2.1 refuses an uneven split (MegatronGPTModel.build_transformer_config), and so does "
               f"`nemo-dapo convert`; fix: a pipeline size that divides the layers ({', '.join(map(str, stages))}), "
               "with TP / EP resized to fit (`nemo-dapo plan`)")
    heads, groups = _arch(cfg, "num_attention_heads"), _arch(cfg, "num_query_groups")
    if heads and heads % tp:
        yield (f"num_attention_heads={heads} (model/plan.arch) is not divisible by "
               f"model.tensor_model_parallel_size={tp}; fix: choose a TP that divides it")
    if groups and groups % tp:
        yield (f"num_query_groups={groups} (model/plan.arch) is not divisible by model.tensor_model_parallel_size={tp}"
               " (megatron-core requires it); fix: choose TP <= and dividing the number of KV heads")


def _layer_spec(cfg: dict, s: dict):
    if select(cfg, "trainer.accelerator") != "cpu" and not select(cfg, "model.transformer_engine", False):
        yield ("model.transformer_engine=False on GPUs (trainer.accelerator is not cpu): NeMo 2.1 then builds "
               "megatron-core 0.10's local layer spec, whose norm in the NeMo container (apex installed) is apex's "
               "FusedLayerNorm, which refuses normalization=rmsnorm, and whose attention is unfused (memory quadratic "
               "in the sequence length); fix: model.transformer_engine=True")
    if select(cfg, "model.moe_grouped_gemm", False) and not select(cfg, "model.transformer_engine", False):
        yield ("model.moe_grouped_gemm=True without model.transformer_engine: megatron-core 0.10 then builds the "
               "legacy GroupedMLP (the grouped_gemm package, CUDA only), whose experts.weight1 / weight2 the engine "
               "refit does not map; fix: model.transformer_engine=True (TE's grouped linear) or "
               "model.moe_grouped_gemm=False")


def _experts(cfg: dict, s: dict):
    tp, pp, ep, world = s["tp"], s["pp"], s["ep"], s["world"]
    experts = _arch(cfg, "num_moe_experts")
    etp = select(cfg, "model.expert_tensor_parallel_size")
    if s["bad"]:
        return  # reported by _layout
    if etp is not None and etp != tp:
        yield (f"model.expert_tensor_parallel_size={etp} differs from model.tensor_model_parallel_size={tp}: "
               "NeMo 2.1's parallel-state setup cannot set it (ETP = TP on this stack); fix: remove it or set it "
               "equal to TP")
    if ep > 1 and not experts:
        yield (f"model.expert_model_parallel_size={ep} needs an MoE model (num_moe_experts in the checkpoint or "
               "plan.arch.num_moe_experts); fix: set EP to 1 for a dense model")
    if experts and experts % ep:
        yield (f"num_moe_experts={experts} is not divisible by model.expert_model_parallel_size={ep}; "
               "fix: pick an EP that divides the number of experts")
    if ep > 1 and world % (tp * ep * pp):
        yield (f"{world} GPUs are not divisible by model.tensor_model_parallel_size x expert_model_parallel_size x "
               f"pipeline_model_parallel_size = {tp}x{ep}x{pp} (megatron-core's expert-data-parallel group, "
               "ETP = TP); fix: make TP x EP x PP divide the world size")
    if ep > 1:
        if not select(cfg, "model.megatron_amp_O2", False):
            yield "model.expert_model_parallel_size > 1 needs model.megatron_amp_O2=True (NeMo 2.1 raises otherwise)"
        if select(cfg, "model.optim.name") == "distributed_fused_adam":
            yield ("model.expert_model_parallel_size > 1 with model.optim.name=distributed_fused_adam: NeMo 2.1 "
                   "supports EP only with Megatron's optimizer; fix: model.optim.name=mcore_distributed_optim")
    if experts and tp > 1 and not select(cfg, "model.sequence_parallel", False):
        yield (f"MoE with model.tensor_model_parallel_size={tp} needs model.sequence_parallel=True "
               "(megatron-core's MoE layer refuses to train without it); fix: set it True")


def _optimizer(cfg: dict, s: dict):
    if select(cfg, "model.optim.name") == "mcore_distributed_optim" and select(cfg, "model.dapo.offload_adam_states"):
        yield ("model.dapo.offload_adam_states=True with model.optim.name=mcore_distributed_optim: NeMo-Aligner "
               "0.7.0 offloads only apex DistributedFusedAdam states; fix: set offload_adam_states=False")
    for key in ("overlap_param_sync", "overlap_param_gather_with_optimizer_step"):
        if select(cfg, f"model.optim.{key}", False):
            yield (f"model.optim.{key}=True: the optimizer then leaves the other ranks' updated weight shards to be "
                   "gathered at the next forward, and the refit reads the weights before any forward, so the engine "
                   f"would get a mix of new and stale shards; fix: model.optim.{key}=False")
    # The DAPO loss divides by the global token count itself; NeMo-Aligner's actors call mcore's schedule with the
    # 2-tuple loss contract, so per-token loss scaling in Megatron would divide twice.
    if select(cfg, "model.calculate_per_token_loss", False):
        yield ("model.calculate_per_token_loss=True: the DAPO actor normalises by the global token count itself; "
               "fix: leave it False")


def _schedule(cfg: dict, s: dict):
    """NeMo 2.1 fills a null ``model.optim.sched.max_steps`` with ``trainer.max_steps``, rollout steps here, while the
    trainer steps the schedule once per optimizer step: only a schedule that is constant after warm-up survives."""
    sched = select(cfg, "model.optim.sched") or {}
    if not sched or sched.get("max_steps") is not None:
        return
    if sched.get("name") == "WarmupPolicy" and sched.get("min_lr") == select(cfg, "model.optim.lr"):
        return  # after its max_steps WarmupPolicy holds min_lr, here the same lr
    counts = [select(cfg, k) for k in ("trainer.dapo.ppo_epochs", "trainer.dapo.prompts_per_step",
                                       ALGORITHM_KEYS["group_size"], "model.global_batch_size")]
    if not all(_is_count(v) for v in counts):
        return  # reported by _batches
    per_step = counts[0] * counts[1] * counts[2] // counts[3]
    steps = select(cfg, "trainer.dapo.max_steps")
    total = (f"{per_step * steps} for trainer.dapo.max_steps={steps}" if _is_count(steps)
             else f"{per_step} x the rollout steps")
    yield (f"model.optim.sched ({sched.get('name')}, min_lr={sched.get('min_lr')}) has no max_steps: NeMo 2.1 then "
           "sets it to trainer.max_steps, counted in rollout steps, while the schedule steps once per optimizer step "
           f"({per_step} per rollout step: ppo_epochs x prompts_per_step x group_size / global_batch_size), so it "
           f"would end after 1/{per_step} of the run; fix: set model.optim.sched.max_steps to the run's optimizer "
           f"steps ({total})")


def _training_offload(cfg: dict, s: dict):
    """``model.dapo.offload_training_state`` (aligner/training_offload.py): one key for the trainer and the planner,
    and only where the trainer can honour it."""
    if select(cfg, "plan.generate_offload") is not None:
        yield GENERATE_OFFLOAD_GONE
    on = select(cfg, OFFLOAD_TRAINING_STATE)
    if on is not None and not isinstance(on, bool):
        yield f"{OFFLOAD_TRAINING_STATE}={on!r} must be True or False"
        return
    if not on:
        return
    engine = select(cfg, "trainer.dapo.rollout_engine")
    if engine in engine_registry.rollout_engines() and not engine_registry.is_served(engine):
        yield (f"{OFFLOAD_TRAINING_STATE}=True with trainer.dapo.rollout_engine={engine!r}: the legacy generators "
               "generate with the actor's own weights, which this offload removes from the GPU; fix: a served "
               f"engine (one of {[e for e in engine_registry.rollout_engines() if engine_registry.is_served(e)]}) "
               f"or {OFFLOAD_TRAINING_STATE}=False")
    if select(cfg, "model.optim.name") == "distributed_fused_adam":
        yield (f"{OFFLOAD_TRAINING_STATE}=True with model.optim.name=distributed_fused_adam: apex's distributed Adam "
               "keeps its states and gradients in bucket objects the training-state offload does not walk; fix: "
               f"{OFFLOAD_TRAINING_STATE}=False with model.dapo.offload_adam_states=True (NeMo-Aligner's own Adam "
               "offload), or model.optim.name=mcore_distributed_optim")


def _batches(cfg: dict, s: dict):
    dp, dp_gen = s["dp"], s["dp_gen"]
    mbs, gbs = select(cfg, "model.micro_batch_size"), select(cfg, "model.global_batch_size")
    prompts, group = select(cfg, "trainer.dapo.prompts_per_step"), select(cfg, ALGORITHM_KEYS["group_size"])
    for key, value in (("model.micro_batch_size", mbs), ("model.global_batch_size", gbs),
                       ("trainer.dapo.prompts_per_step", prompts),
                       ("model.dapo.rollout_micro_batch_size", select(cfg, "model.dapo.rollout_micro_batch_size")),
                       ("model.dapo.forward_micro_batch_size", select(cfg, "model.dapo.forward_micro_batch_size"))):
        if not _is_count(value):
            yield f"{key}={value!r} must be an integer >= 1"
            return
    if not isinstance(group, int) or group < 2:
        return  # the algorithm's own rule names it (core/settings.py)
    if dp is None:
        return
    if gbs % (mbs * dp):
        yield (f"model.global_batch_size={gbs} (samples per optimizer step) is not divisible by "
               f"model.micro_batch_size x DP = {mbs}x{dp} = {mbs * dp}; fix: make it a multiple of {mbs * dp}")
    rollout = prompts * group
    if rollout % gbs:
        yield (f"trainer.dapo.prompts_per_step x {ALGORITHM_KEYS['group_size']} = {prompts}x{group} = {rollout} "
               f"samples is not a multiple of model.global_batch_size={gbs}; fix: the rollout batch must split "
               "into whole optimizer steps (paper: 512 x 16 = 16 x 512)")
    if rollout % dp:
        yield (f"trainer.dapo.prompts_per_step x {ALGORITHM_KEYS['group_size']} = {rollout} samples do not split "
               f"evenly over DP={dp} ranks; fix: make it a multiple of {dp}")
    yield from _gen_batches(cfg, prompts, dp_gen)


def _chunks(cfg: dict, s: dict):
    """The actor's token budgets: the log-prob chunk (an int) and the packed micro-batch (an int, or null: rows)."""
    for key, nullable in (("model.dapo.logprob_chunk_size", False), ("model.dapo.micro_batch_tokens", True)):
        value = select(cfg, key)
        if not (value is None and nullable) and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            yield f"{key}={value!r} must be an integer >= 1{' or null' if nullable else ''} (tokens)"


def _gen_batches(cfg: dict, prompts: int, dp_gen: int):
    """Groups are never split between ranks while scoring, so every generation batch is whole prompts per rank."""
    ds = f"{ALGORITHM_BLOCK}.dynamic_sampling"
    sized = [("trainer.dapo.prompts_per_step", prompts)]
    if select(cfg, f"{ds}.enabled", True):
        for key in ("gen_batch_size", "max_gen_batch_size"):
            if select(cfg, f"{ds}.{key}") is not None:
                sized.append((f"{ds}.{key}", select(cfg, f"{ds}.{key}")))
    for key, value in sized:
        if not _is_count(value) or value % dp_gen:
            yield (f"{key}={value} prompts do not split evenly over the {dp_gen} generation ranks (DP, x PP when "
                   f"trainer.dapo.trt_llm.reshard); fix: make it a multiple of {dp_gen}")


def _moved(cfg: dict, s: dict):
    yield from (moved_message(key) for key in moved_keys_in(cfg))


def _rollout_engine(cfg: dict, s: dict):
    engine = select(cfg, "trainer.dapo.rollout_engine")
    if engine not in engine_registry.rollout_engines():
        yield f"trainer.dapo.rollout_engine={engine!r} must be one of {engine_registry.rollout_engines()}"


def _rollout(cfg: dict, s: dict):
    """trainer.dapo.rollout: partial rollouts need an engine server and truncated importance weights."""
    key = "trainer.dapo.rollout"
    mode, stale, rounds = (select(cfg, f"{key}.{k}") for k in ("on_filler_full", "max_staleness", "round_tokens"))
    if mode not in ROLLOUT_MODES:
        yield f"{key}.on_filler_full={mode!r} must be one of {ROLLOUT_MODES}"
    if not isinstance(stale, int) or isinstance(stale, bool) or stale < 0:
        yield f"{key}.max_staleness={stale!r} must be an integer >= 0 (weight versions; 0 = abort)"
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        yield f"{key}.round_tokens={rounds!r} must be an integer >= 1 (tokens per sample and round)"
    overlap = select(cfg, f"{key}.overlap")
    if not isinstance(overlap, bool):
        yield f"{key}.overlap={overlap!r} must be true or false"
    elif overlap and (mode != "suspend" or stale == 0):
        yield (f"{key}.overlap=true runs a round of partial rollouts while the trainer trains: it needs "
               f"{key}.on_filler_full=suspend and {key}.max_staleness >= 1")
    elif overlap and select(cfg, "trainer.dapo.engine_server.sleep_level") != 0:
        yield (f"{key}.overlap=true keeps the engines generating while the trainer trains: set "
               "trainer.dapo.engine_server.sleep_level=0 (with placement separate, engines on GPUs of their own)")
    if mode != "suspend" or stale == 0:
        return
    engine = select(cfg, "trainer.dapo.rollout_engine")
    if not engine_registry.is_served(engine):
        served = [e for e in engine_registry.rollout_engines() if engine_registry.is_served(e)]
        yield (f"{key}.on_filler_full=suspend continues suspended samples through an engine server: set "
               f"trainer.dapo.rollout_engine to one of {served} (it is {engine!r})")
    if select(cfg, ALGORITHM_KEYS["tis_cap"]) is None:
        yield (f"{key}.on_filler_full=suspend trains tokens sampled by older weights: set "
               f"{ALGORITHM_KEYS['tis_cap']} (e.g. 2.0) for their truncated importance weights, or "
               f"{key}.max_staleness=0")


_ABSENT = object()


def _algorithm(cfg: dict, s: dict):
    """The algorithm block (nemo_dapo.core.settings.problems, the CLI validator's rules); a missing key is named."""
    values = {}
    for name, key in ALGORITHM_KEYS.items():
        node: Any = cfg
        for part in key.split("."):  # unlike select, a null value is present
            node = node.get(part, _ABSENT) if isinstance(node, dict) else _ABSENT
        value = node
        if value is _ABSENT:
            yield f"{key} is missing; every key of the algorithm block is required (see conf/gpt_dapo_actor.yaml)"
        else:
            values[name] = value
    gen = select(cfg, "model.dapo.length_params.max_length")
    for name, message in algorithm.problems(values, gen if isinstance(gen, int) else None):
        yield f"{ALGORITHM_KEYS[name]}={values[name]!r} {message}"


def _lengths(cfg: dict, s: dict):
    seq = select(cfg, "model.encoder_seq_length")
    gen = select(cfg, "model.dapo.length_params.max_length")
    inp = select(cfg, "trainer.dapo.trt_llm.max_input_len")
    if not all(_is_count(v) for v in (seq, gen, inp)):
        yield (f"model.encoder_seq_length={seq}, model.dapo.length_params.max_length={gen}, "
               f"trainer.dapo.trt_llm.max_input_len={inp} must all be positive integers")
        return
    if inp + gen > seq:
        yield (f"trainer.dapo.trt_llm.max_input_len + model.dapo.length_params.max_length = {inp} + {gen} = "
               f"{inp + gen} > model.encoder_seq_length={seq} (NeMo-Aligner's TRT-LLM wrapper asserts this); "
               f"fix: raise encoder_seq_length to {inp + gen} or shorten the prompt or generation budget")
    prompt = select(cfg, "model.data.max_prompt_tokens")
    if prompt is not None and prompt > inp:
        yield (f"model.data.max_prompt_tokens={prompt} > trainer.dapo.trt_llm.max_input_len={inp}: the engine "
               "would reject such prompts; fix: lower the former or raise the latter")
    ov = f"{ALGORITHM_BLOCK}.overlong"
    if not select(cfg, f"{ov}.enabled", False):
        return
    l_max = select(cfg, f"{ov}.l_max")
    if l_max is not None and l_max != gen:
        yield (f"{ov}.l_max={l_max} differs from the generation cap model.dapo.length_params.max_length={gen}; "
               "fix: set them equal (the penalty must reach -1 exactly at the cap)")


def _number(value) -> float:
    """``value`` as a float, nan for what is not a number (a YAML string such as 'nan' or '1e-9' stays a string)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def _sampling(cfg: dict, s: dict):
    for key in ("model.dapo.sampling_params", "trainer.dapo.val"):
        if select(cfg, f"{key}.use_greedy", False):
            continue
        temperature, top_p = select(cfg, f"{key}.temperature", 1.0), select(cfg, f"{key}.top_p", 1.0)
        if not _number(temperature) >= algorithm.MIN_TEMPERATURE:
            yield (f"{key}.temperature={temperature!r} must be a number >= {algorithm.MIN_TEMPERATURE} (below it "
                   f"sampling is greedy in effect and a tiny one gives NaN log-probs; or set {key}.use_greedy=True)")
        if not 0 < _number(top_p) <= 1:
            yield f"{key}.top_p={top_p!r} must be a number in (0, 1]"
    for key in ("trainer.dapo.val.n_samples", "trainer.dapo.val.batch_size", "trainer.dapo.ppo_epochs"):
        value = select(cfg, key, 1)
        if not _is_count(value):
            yield f"{key}={value!r} must be an integer >= 1"


def _reward(cfg: dict, s: dict):
    verifier, workers = select(cfg, "reward.verifier"), select(cfg, "reward.num_workers")
    if verifier not in VERIFIERS:
        yield f"reward.verifier={verifier!r} must be one of {VERIFIERS}"
    if workers is not None and not _is_count(workers):
        yield f"reward.num_workers={workers!r} must be an integer >= 1, or null (cores per rank)"


def _data(cfg: dict, s: dict):
    for key in ("model.data.train_format", "model.data.validation_format"):
        if select(cfg, key) not in DATA_FORMATS:
            yield f"{key}={select(cfg, key)!r} must be one of {DATA_FORMATS} (nemo_dapo.data.readers)"
    if "{prompt}" not in str(select(cfg, "model.data.prompt_template", "{prompt}")):
        yield "model.data.prompt_template must contain {prompt} (where the templated problem goes)"


def _arch_agrees(cfg: dict, s: dict):
    """After the checkpoint config is merged, the recipe's plan.arch must describe the same model."""
    for key in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "num_moe_experts",
                "kv_channels"):
        declared, actual = select(cfg, f"plan.arch.{key}"), select(cfg, f"model.{key}")
        if declared is not None and actual is not None and declared != actual:
            yield (f"plan.arch.{key}={declared} but the model config says {actual}: the recipe describes another "
                   "model; fix plan.arch (it only feeds `nemo-dapo plan` and these checks)")
    qk_norm = select(cfg, "plan.arch.qk_norm")
    if select(cfg, "model.num_layers") is not None and qk_norm and not select(cfg, "model.qk_layernorm", False):
        yield ("plan.arch.qk_norm=True (Qwen3) but the checkpoint's model config has no model.qk_layernorm=True: the "
               "actor would build the model without QK-norm and drop the checkpoint's q/k norms; fix: convert with "
               "`nemo-dapo convert hf-to-nemo` (writes it) or pass ++model.qk_layernorm=True")


def _engine_ownership(cfg: dict, s: dict):
    """Colocated engines: every model-parallel group must own an engine (cluster/engine_owners.py). A rule of its own,
    not part of _engine_server, which the planner also runs on other frameworks' published layouts."""
    key = "trainer.dapo.engine_server"
    srv, devices = select(cfg, key), select(cfg, "trainer.devices")
    if not engine_registry.is_served(select(cfg, "trainer.dapo.rollout_engine")) or not isinstance(srv, dict):
        return
    tp, pp = srv.get("tensor_parallel_size", 1) or 1, srv.get("pipeline_parallel_size", 1) or 1
    if (srv.get("placement", "colocated") != "colocated" or not isinstance(tp, int) or not isinstance(pp, int)
            or not _is_count(devices) or s["bad"] or s["dp"] is None or devices % (tp * pp)
            or select(cfg, "model.use_tp_pp_dp_mapping", False)):
        return  # the layout's own problems are reported by _layout and _engine_server; NeMo's other rank order is
        # left to the trainer, which matches owners on the groups it gets
    try:
        engine_owners(s["world"], tp * pp, megatron_mp_groups(s["world"], tp=s["tp"], pp=s["pp"], cp=s["cp"]))
    except ValueError as e:
        yield f"{key}: {e} (engines of {tp * pp} GPUs, model TP{s['tp']} x PP{s['pp']}, megatron-core's rank order)"


def _engine_server(cfg: dict, s: dict):
    """trainer.dapo.engine_server when the rollout engine is an engine server (aligner/engine_generation.py)."""
    if not engine_registry.is_served(select(cfg, "trainer.dapo.rollout_engine")):
        return
    key = "trainer.dapo.engine_server"
    srv = select(cfg, key)
    if srv is None:
        yield f"{key} is missing; rollout_engine={select(cfg, 'trainer.dapo.rollout_engine')!r} needs it " \
              "(see conf/gpt_dapo_actor.yaml)"
        return
    for k in ("tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size", "max_batch_size",
              "max_num_tokens", "max_seq_len", "max_input_len", "bucket_mb"):
        v = srv.get(k)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            yield f"{key}.{k}={v!r} must be an integer >= 1"
    if srv.get("sleep_level", 1) not in ENGINE_SLEEP_LEVELS:
        yield (f"{key}.sleep_level={srv.get('sleep_level')!r} must be one of {ENGINE_SLEEP_LEVELS} (0 awake, 1 KV "
               "cache, 2 KV cache and weights)")
    frac = srv.get("free_gpu_memory_fraction")
    if frac is not None and not (isinstance(frac, (int, float)) and 0 < frac < 1):
        yield f"{key}.free_gpu_memory_fraction={frac!r} must be in (0, 1)"
    if srv.get("dtype") not in (None, "bf16", "fp16", "fp32"):
        yield f"{key}.dtype={srv.get('dtype')!r} must be null (the model's), bf16, fp16 or fp32"
    for k in ("connect_timeout_s", "request_timeout_s", "weight_timeout_s"):
        v = srv.get(k)
        if v is not None and not (isinstance(v, (int, float)) and v > 0):
            yield f"{key}.{k}={v!r} must be a positive number of seconds"
    addr = srv.get("address")
    if not isinstance(addr, str) or not addr.startswith(("unix:", "tcp://")):
        yield f"{key}.address={addr!r} must be a unix:/path or tcp://HOST:PORT template ({{node}} {{local}} {{port}})"
    yield from _engine_placement(key, srv)
    tp, pp = srv.get("tensor_parallel_size", 1) or 1, srv.get("pipeline_parallel_size", 1) or 1
    ep = srv.get("expert_parallel_size", 1) or 1
    devices = select(cfg, "trainer.devices")
    if isinstance(tp, int) and isinstance(pp, int) and _is_count(devices) and devices % (tp * pp):
        yield (f"{key}: an engine of tensor_parallel_size x pipeline_parallel_size = {tp * pp} GPUs does not tile "
               f"a node of trainer.devices={devices}; engines must not span nodes")
    if isinstance(ep, int) and isinstance(tp, int) and tp % ep:
        yield (f"{key}.expert_parallel_size={ep} must divide tensor_parallel_size={tp} (TensorRT-LLM: "
               "moe_tensor_parallel_size x moe_expert_parallel_size = tensor_parallel_size)")
    mtp = s["tp"]  # 1 when invalid (reported by _layout)
    if isinstance(tp, int) and isinstance(pp, int) and tp * pp > mtp and (tp * pp) % mtp:
        yield (f"{key}: engines of {tp * pp} GPUs vs model.tensor_model_parallel_size={mtp}: one must divide the "
               "other so that every tensor-parallel group reaches an engine")
    max_seq, max_in = srv.get("max_seq_len"), srv.get("max_input_len")
    gen = select(cfg, "model.dapo.length_params.max_length")
    if isinstance(max_seq, int) and isinstance(gen, int) and isinstance(max_in, int) and max_in + gen > max_seq:
        yield (f"{key}.max_input_len ({max_in}) + model.dapo.length_params.max_length ({gen}) exceeds "
               f"max_seq_len ({max_seq}): raise max_seq_len to {max_in + gen}")


def _engine_placement(key: str, srv: dict):
    """placement and weight_transport: what reaches an engine on the training GPUs, or on GPUs of its own."""
    placement, transport = srv.get("placement", "colocated"), srv.get("weight_transport", "shm")
    if placement not in ENGINE_PLACEMENTS:
        yield f"{key}.placement={placement!r} must be one of {list(ENGINE_PLACEMENTS)}"
    if transport not in engine_registry.WEIGHT_TRANSPORTS:
        yield f"{key}.weight_transport={transport!r} must be one of {list(engine_registry.WEIGHT_TRANSPORTS)}"
    if placement == "colocated" and transport == "nccl":
        yield (f"{key}.weight_transport=nccl with placement colocated: an owner's GPU is its engine's first, and NCCL "
               "refuses two ranks of one group on one GPU; use shm, or placement separate")
    if placement != "separate":
        return
    if transport == "shm":
        yield (f"{key}.weight_transport=shm with placement separate: the engines run on GPUs of their own, on other "
               "nodes; use gloo (across images) or nccl (GPU to GPU, the same NCCL release on both sides)")
    if srv.get("sleep_level") != 0:
        yield (f"{key}.sleep_level={srv.get('sleep_level')!r} with placement separate: the engines share no GPU with "
               "training, so sleeping frees nothing and costs a wake every step; set sleep_level=0")


RULES = (_moved, _layout, _layer_spec, _experts, _optimizer, _schedule, _training_offload, _batches, _chunks,
         _rollout_engine, _rollout, _algorithm, _lengths, _sampling, _reward, _data, _arch_agrees, _engine_server,
         _engine_ownership)


def check_config(cfg) -> list[str]:
    """Every problem of ``cfg`` (DictConfig or plain dict), each naming its keys and the fix; [] when valid."""
    plain = to_plain(cfg)
    s = sizes(plain)
    return [message for rule in RULES for message in rule(plain, s)]


def validate_config(cfg) -> None:
    problems = check_config(cfg)
    if problems:
        raise ConfigError(problems)
