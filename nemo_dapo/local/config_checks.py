"""The CPU job's config checks beyond types: each error names the key and what to set it to. ``validate`` runs at
every load (``config.load_config``), ``check_trainable`` before a job that trains or generates (it needs the model).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import fields, is_dataclass

from nemo_dapo.core.affinity import cpu_set_problem
from nemo_dapo.core.settings import MIN_TEMPERATURE, ConfigError, problems
from nemo_dapo.local.config_schema import ALGORITHM_KEYS, Config, algorithm_values, choices, value_at


def _check_algorithm(cfg: Config) -> None:
    """The rules of nemo_dapo.core.settings (shared with the NeMo-side validator), first problem raised."""
    values = algorithm_values(cfg)
    for name, message in problems(values, cfg.rollout.max_new_tokens):
        key = ALGORITHM_KEYS[name]
        raise ConfigError(f"config key '{key}' = {values[name]!r} {message}"
                          + (" (l_max is algorithm.overlong.l_max, or rollout.max_new_tokens when null)"
                             if name == "overlong.l_cache" else ""))


def _float_keys(obj, prefix: str = "") -> list:
    """(dotted key, value) of every float leaf (lists included) of a config dataclass."""
    out = []
    for f in fields(obj):
        value, key = getattr(obj, f.name), prefix + f.name
        if is_dataclass(value):
            out.extend(_float_keys(value, key + "."))
        elif isinstance(value, float):
            out.append((key, value))
        elif isinstance(value, list):
            out.extend((f"{key}[{i}]", v) for i, v in enumerate(value) if isinstance(v, float))
    return out


def _in_range(cfg: Config, key: str, lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False,
              fix: str = "") -> None:
    v = value_at(cfg, key)
    if v is None:
        return
    if (v < lo or (lo_open and v == lo)) or (v > hi or (hi_open and v == hi)):
        interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise ConfigError(f"config key '{key}' = {v} is out of range: it must be in {interval}"
                          + (f". Fix: {fix}" if fix else ""))


def _check_numbers(cfg: Config) -> None:
    """Values with which nothing can train: not finite, out of range, inconsistent shapes."""
    for key, v in _float_keys(cfg):
        if not math.isfinite(v):
            raise ConfigError(f"config key '{key}' = {v} is not a finite number. Fix: set a finite value "
                              "(or null where the key allows it)")
    for key in ("optim.lr", "warmup.lr"):
        if value_at(cfg, key) <= 0:
            raise ConfigError(f"config key '{key}' = {value_at(cfg, key)} must be > 0: nothing trains with it. Fix: "
                              f"a small positive learning rate (paper: 1e-6; tiny_cpu: 3e-4)")
    _in_range(cfg, "optim.eps", 0, math.inf, lo_open=True, fix="a small positive epsilon (1e-8)")
    for key in ("optim.weight_decay", "warmup.weight_decay"):
        _in_range(cfg, key, 0, math.inf)
    for i in range(len(cfg.optim.betas)):
        if not 0 <= cfg.optim.betas[i] < 1:
            raise ConfigError(f"config key 'optim.betas[{i}]' = {cfg.optim.betas[i]} must be in [0, 1) "
                              "(Adam's decay rates, default [0.9, 0.999])")
    for key in ("optim.grad_clip", "warmup.grad_clip", "trainer.max_time_s",
                "warmup.max_seconds", "rollout.server.connect_timeout_s", "rollout.server.request_timeout_s",
                "rollout.server.weight_timeout_s"):
        _in_range(cfg, key, 0, math.inf, lo_open=True, fix="a positive number, or null where allowed")
    for key in ("warmup.slip_prob", "warmup.format_prob", "warmup.ramble_prob", "warmup.target_low",
                "warmup.target_high"):
        _in_range(cfg, key, 0, 1)
    _in_range(cfg, "trainer.max_entropy_fraction", 0, 1, lo_open=True,
              fix="e.g. 0.9, or null to disable the entropy check")
    for key in ("eval.temperature", "warmup.temperature"):
        _in_range(cfg, key, 0, math.inf)
    for key in ("eval.temperature", "warmup.temperature", "rollout.temperature"):
        value = value_at(cfg, key)
        if 0 < value < MIN_TEMPERATURE:
            raise ConfigError(f"config key '{key}' = {value} is below {MIN_TEMPERATURE}: greedy in effect, and a "
                              "tiny one turns every log-prob into NaN. Fix: 0 for greedy decoding (not for "
                              f"rollouts), or a temperature of at least {MIN_TEMPERATURE}")
    _in_range(cfg, "eval.top_p", 0, 1, lo_open=True)
    for key in ("optim.warmup_steps", "warmup.lr_warmup_steps", "warmup.max_steps", "warmup.min_steps",
                "trainer.max_skipped_updates"):
        if value_at(cfg, key) < 0:
            raise ConfigError(f"config key '{key}' must be >= 0, got {value_at(cfg, key)}")
    for key in ("warmup.batch_size", "warmup.eval_every", "warmup.probe_size", "warmup.ramble_passes",
                "data.max_prompt_tokens", "data.tokenizer_rows", "rollout.round_tokens"):
        if value_at(cfg, key) < 1:
            raise ConfigError(f"config key '{key}' must be >= 1, got {value_at(cfg, key)}")
    if cfg.warmup.target_low > cfg.warmup.target_high:
        raise ConfigError(f"config keys 'warmup.target_low' = {cfg.warmup.target_low} and 'warmup.target_high' = "
                          f"{cfg.warmup.target_high}: need target_low <= target_high")
    if cfg.model.path is None:
        _check_model_shape(cfg)
    if cfg.data.task == "arithmetic":
        _check_task(cfg)


def _check_model_shape(cfg: Config) -> None:
    m = cfg.model
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings"):
        if getattr(m, key) < 1:
            raise ConfigError(f"config key 'model.{key}' must be >= 1, got {getattr(m, key)}")
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(f"config key 'model.num_attention_heads' = {m.num_attention_heads} does not divide "
                          f"model.hidden_size = {m.hidden_size}. Fix: a head count that divides it (e.g. "
                          f"{max(d for d in range(1, m.num_attention_heads + 1) if m.hidden_size % d == 0)})")
    if m.num_attention_heads % m.num_key_value_heads:
        raise ConfigError(f"config key 'model.num_key_value_heads' = {m.num_key_value_heads} does not divide "
                          f"model.num_attention_heads = {m.num_attention_heads} (grouped-query attention shares "
                          "each KV head among a whole number of query heads). Fix: a divisor of the head count")
    if (m.hidden_size // m.num_attention_heads) % 2:
        raise ConfigError(f"config keys 'model.hidden_size' / 'model.num_attention_heads': the head dimension "
                          f"{m.hidden_size // m.num_attention_heads} is odd, RoPE needs an even one. Fix: change "
                          "either key")
    if m.rope_theta <= 0:
        raise ConfigError(f"config key 'model.rope_theta' must be > 0, got {m.rope_theta}")
    if cfg.data.tokenizer_vocab_size < 260:
        raise ConfigError(f"config key 'data.tokenizer_vocab_size' = {cfg.data.tokenizer_vocab_size} leaves no room "
                          "for merges (256 bytes + 3 special tokens). Fix: at least 260 (default 512)")


def _check_task(cfg: Config) -> None:
    from nemo_dapo.data.task import ArithmeticTask

    d = cfg.data
    try:
        task = ArithmeticTask(min_terms=d.min_terms, max_terms=d.max_terms, max_operand=d.max_operand,
                              max_value=d.max_value, ops=d.ops, max_multiplier=d.max_multiplier)
    except ValueError as e:
        raise ConfigError(f"config keys 'data.*' of the arithmetic task: {e}") from None
    if d.max_multiplier < 0:
        raise ConfigError(f"config key 'data.max_multiplier' must be >= 0, got {d.max_multiplier}")
    for key, split in (("train_size", "train"), ("heldout_size", "heldout")):
        most = task.most_distinct(split)
        if getattr(d, key) > most:
            raise ConfigError(f"config key 'data.{key}' = {getattr(d, key)}: this arithmetic task has at most {most} "
                              f"distinct {split} problems. Fix: ask for fewer, or raise 'data.max_terms', "
                              "'data.max_operand' or 'data.max_value'")


def _model_positions(cfg: Config) -> tuple:
    """(positions, where they come from): model.max_position_embeddings, or model.path's config.json."""
    if cfg.model.path is None:
        return cfg.model.max_position_embeddings, "model.max_position_embeddings"
    path = os.path.join(cfg.model.path, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"config key 'model.path' = {cfg.model.path!r}: cannot read {path} ({e}). Fix: point it "
                          "at a save_pretrained directory") from None
    n = hf.get("max_position_embeddings") or hf.get("n_positions")
    return (int(n) if isinstance(n, int) else None), f"max_position_embeddings in {path}"


def check_trainable(cfg: Config) -> Config:
    """Checks that need the model, run before a training job starts: every generation cap leaves room for a prompt
    in the model's positions, and rollouts sample (temperature > 0: greedy groups are identical, nothing trains)."""
    positions, where = _model_positions(cfg)
    caps = {"rollout.max_new_tokens": cfg.rollout.max_new_tokens, "eval.max_new_tokens": cfg.eval.max_new_tokens,
            "warmup.max_new_tokens": cfg.warmup.max_new_tokens}
    for key, cap in caps.items():
        if positions is not None and cap is not None and cap >= positions:
            raise ConfigError(f"config key '{key}' = {cap} leaves no room for a prompt: the model has {positions} "
                              f"positions ({where}). Fix: lower {key} below {positions} (prompt + response must "
                              "fit), or use a model with more positions")
    if cfg.rollout.temperature <= 0:
        raise ConfigError(f"config key 'rollout.temperature' = {cfg.rollout.temperature}: greedy rollouts make the "
                          "G responses of a group identical, so every advantage is 0. Fix: rollout.temperature=1.0 "
                          "(paper)")
    return cfg


def validate(cfg: Config) -> Config:
    """Checks beyond types; each error names the key and what to set it to."""
    for key, allowed in choices().items():
        if value_at(cfg, key) not in allowed:
            raise ConfigError(f"config key '{key}' = {value_at(cfg, key)!r} is not one of {allowed}")
    _check_algorithm(cfg)
    positive = ("trainer.train_batch_size", "trainer.mini_batch_size", "trainer.ppo_epochs",
                "trainer.keep_last", "trainer.save_every", "trainer.val_samples", "rollout.max_new_tokens",
                "eval.n_samples", "eval.batch_size", "rollout.processes", "data.heldout_size", "data.train_size",
                "reward.num_workers", "rollout.server.bucket_mb", "rollout.server.max_batch_size",
                "rollout.server.threads")
    for key in positive:
        if value_at(cfg, key) < 1:
            raise ConfigError(f"config key '{key}' must be >= 1, got {value_at(cfg, key)}")
    batch = cfg.trainer.train_batch_size * cfg.algorithm.group_size
    if cfg.trainer.mini_batch_size > batch:
        raise ConfigError(f"config key 'trainer.mini_batch_size' = {cfg.trainer.mini_batch_size} is more than the "
                          f"{batch} responses a step trains (trainer.train_batch_size x algorithm.group_size): every "
                          f"step would be one update. Fix: at most {batch} (a divisor of it for equal updates)")
    for key in ("trainer.max_steps", "trainer.val_every"):
        if value_at(cfg, key) < 0:
            raise ConfigError(f"config key '{key}' must be >= 0, got {value_at(cfg, key)}")
    for key in ("trainer.micro_batch_size", "trainer.threads", "trainer.val_problems", "trainer.max_samples",
                "eval.max_new_tokens", "warmup.max_new_tokens"):
        if value_at(cfg, key) is not None and value_at(cfg, key) < 1:
            raise ConfigError(f"config key '{key}' must be >= 1 or null, got {value_at(cfg, key)}")
    for key in ("trainer.cpus", "rollout.server.cpus"):
        cpus = value_at(cfg, key)
        problem = None if cpus is None else cpu_set_problem(list(cpus))
        if problem is not None:
            raise ConfigError(f"config key '{key}' {problem} (or null: the CPUs it was started with)")
    r = cfg.rollout
    if not 0 < r.top_p <= 1 or r.temperature < 0:
        raise ConfigError(f"config keys 'rollout.temperature'/'rollout.top_p' need temperature >= 0 and "
                          f"0 < top_p <= 1, got {r.temperature} / {r.top_p}")
    if r.streaming and r.engine == "inprocess":
        raise ConfigError("config key 'rollout.streaming' needs an engine server: set rollout.engine=local or "
                          "rollout.engine=vllm (or rollout.streaming=false)")
    _check_partial_rollouts(cfg)
    for key in ("data.train_file", "data.heldout_file"):
        if cfg.data.task == "arithmetic" and value_at(cfg, key):
            raise ConfigError(f"config key '{key}' is set, but data.task=arithmetic generates its problems and would "
                              f"ignore it. Fix: data.task=file to train on the file (or {key}=null)")
    if not cfg.name or cfg.name in (".", "..") or "/" in cfg.name or os.sep in cfg.name:
        raise ConfigError(f"config key 'name' = {cfg.name!r} must be a plain folder name (run_dir defaults to "
                          "runs/<name>). Fix: a non-empty name without '/', or set run_dir")
    if cfg.run_dir is not None and os.path.exists(cfg.run_dir) and not os.path.isdir(cfg.run_dir):
        raise ConfigError(f"config key 'run_dir' = {cfg.run_dir!r} is a file, not a directory. Fix: another run_dir")
    if cfg.data.task == "file" and not cfg.data.train_file:
        raise ConfigError("config key 'data.train_file' must name a verl/DAPO-Math parquet or jsonl file when "
                          "data.task=file")
    if len(cfg.optim.betas) != 2:
        raise ConfigError(f"config key 'optim.betas' must hold two numbers, got {cfg.optim.betas}")
    _check_numbers(cfg)
    if cfg.run_dir is None:
        cfg.run_dir = os.path.join("runs", cfg.name)
    return cfg


def _check_partial_rollouts(cfg) -> None:
    r = cfg.rollout
    if not isinstance(r.max_staleness, int) or isinstance(r.max_staleness, bool) or r.max_staleness < 0:
        raise ConfigError(f"config key 'rollout.max_staleness' must be an int >= 0, got {r.max_staleness!r}")
    if r.overlap and (r.on_filler_full != "suspend" or r.max_staleness == 0 or r.server.sleep_level != 0):
        raise ConfigError("config key 'rollout.overlap' = true keeps the engine generating while the trainer trains "
                          "and suspends that work at the refit: it needs rollout.on_filler_full=suspend, "
                          "rollout.max_staleness >= 1 and rollout.server.sleep_level=0")
    if r.on_filler_full != "suspend" or r.max_staleness == 0:
        return
    if not r.streaming:
        raise ConfigError("config key 'rollout.on_filler_full' = suspend needs streaming generation: set "
                          "rollout.streaming=true with rollout.engine=local or vllm")
    if cfg.algorithm.tis_cap is None:
        raise ConfigError("config key 'rollout.on_filler_full' = suspend trains tokens sampled by older weights: set "
                          "algorithm.tis_cap (e.g. 2.0) for their truncated importance weights, or "
                          "rollout.max_staleness=0")
