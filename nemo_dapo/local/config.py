"""Run configuration: a typed schema (stdlib dataclasses), YAML loading with Hydra-style defaults lists, and
command-line overrides as NeMo users write them.

* ``conf/dapo_base.yaml`` documents every key once; recipes in ``conf/recipes/`` only override
  (``defaults: [/dapo_base, _self_]``, merged in list order as Hydra does).
* Overrides: ``key=value`` (the key must exist), ``+key=value`` (adds a key that must not exist yet),
  ``++key=value`` (add or override), ``~key`` (delete, i.e. fall back to the schema default). Values are parsed as
  YAML (``1e-6``, ``null``, ``[1,2]``, ``true``).
* The merged tree is validated against :class:`Config`: an unknown key or a value of the wrong type raises
  :class:`ConfigError` naming the full key and the fix. Open dicts (``model.extra``) accept new keys.

The schema is plain dataclasses so that the local backend can take a ``Config`` without importing omegaconf;
omegaconf is imported only inside the loading functions.
"""
from __future__ import annotations

import difflib
import json
import math
import os
from dataclasses import dataclass, field, fields, is_dataclass, make_dataclass
from typing import Any, Dict, List, Optional

from nemo_dapo.core import engine_registry
from nemo_dapo.core.affinity import cpu_set_problem
from nemo_dapo.core import settings as algorithm_settings  # torch-free: the algorithm block's fields
from nemo_dapo.core.settings import MIN_TEMPERATURE, ConfigError  # the one config error of both paths

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")  # nemo_dapo/conf
DEFAULT_CONFIG = "tiny_cpu"


class ArgumentError(ConfigError):
    """A command-line argument is invalid; the message names the argument and the fix (exit code 2)."""


# ---- schema: types only. Every default lives in conf/dapo_base.yaml, where each key is documented once. ------------
MISSING: Any = "???"  # omegaconf's mandatory-value marker (spelled out: importing this module needs no omegaconf)


@dataclass
class DataConfig:
    task: str = MISSING
    train_file: Optional[str] = MISSING
    train_format: str = MISSING
    heldout_file: Optional[str] = MISSING
    heldout_format: str = MISSING
    train_size: int = MISSING
    heldout_size: int = MISSING
    min_terms: int = MISSING
    max_terms: int = MISSING
    max_operand: int = MISSING
    max_value: int = MISSING
    ops: str = MISSING
    max_multiplier: int = MISSING
    tokenizer_vocab_size: int = MISSING
    tokenizer_rows: int = MISSING
    max_prompt_tokens: int = MISSING


@dataclass
class ModelConfig:
    path: Optional[str] = MISSING
    arch: str = MISSING
    hidden_size: int = MISSING
    intermediate_size: int = MISSING
    num_hidden_layers: int = MISSING
    num_attention_heads: int = MISSING
    num_key_value_heads: int = MISSING
    max_position_embeddings: int = MISSING
    rope_theta: float = MISSING
    tie_word_embeddings: bool = MISSING
    extra: Dict[str, Any] = MISSING


@dataclass
class WarmupConfig:
    enabled: bool = MISSING
    batch_size: int = MISSING
    lr: float = MISSING
    lr_warmup_steps: int = MISSING
    weight_decay: float = MISSING
    grad_clip: float = MISSING
    max_steps: int = MISSING
    min_steps: int = MISSING
    eval_every: int = MISSING
    probe_size: int = MISSING
    temperature: float = MISSING
    max_new_tokens: Optional[int] = MISSING
    target_low: float = MISSING
    target_high: float = MISSING
    max_seconds: Optional[float] = MISSING
    slip_prob: float = MISSING
    format_prob: float = MISSING
    ramble_prob: float = MISSING
    ramble_passes: int = MISSING


def _schema(name: str, types: dict) -> type:
    """A config dataclass with one MISSING field per ``{dotted key: type}`` of ``types``; a dotted key makes a
    nested block (its own dataclass), in first-seen order."""
    leaves, blocks = [], {}
    for key, typ in types.items():
        head, _, rest = key.partition(".")
        if rest:
            blocks.setdefault(head, {})[rest] = typ
        else:
            leaves.append((head, typ, field(default=MISSING)))
    nested = []
    for head, sub in blocks.items():
        cls = _schema(name + "".join(p.title() for p in head.split("_")), sub)
        nested.append((head, cls, field(default_factory=cls)))
    return make_dataclass(name, leaves + nested)


# The algorithm block: derived from nemo_dapo.core.settings (the one list of its fields and types), not copied.
AlgorithmConfig = _schema("AlgorithmConfig", algorithm_settings.field_types())


@dataclass
class RewardConfig:
    verifier: str = MISSING
    num_workers: int = MISSING


@dataclass
class EngineServerConfig:
    python: Optional[str] = MISSING
    address: Optional[str] = MISSING
    connect_timeout_s: float = MISSING
    request_timeout_s: float = MISSING
    weight_timeout_s: float = MISSING
    bucket_mb: int = MISSING
    weight_transport: str = MISSING
    max_batch_size: int = MISSING
    sleep_level: int = MISSING
    threads: int = MISSING
    cpus: Optional[List[int]] = MISSING


@dataclass
class RolloutConfig:
    max_new_tokens: int = MISSING
    processes: int = MISSING
    temperature: float = MISSING
    top_p: float = MISSING
    engine: str = MISSING
    streaming: bool = MISSING
    on_filler_full: str = MISSING
    fill_order: str = MISSING
    max_staleness: int = MISSING
    overlap: bool = MISSING
    round_tokens: int = MISSING
    server: EngineServerConfig = field(default_factory=EngineServerConfig)


@dataclass
class OptimConfig:
    lr: float = MISSING
    weight_decay: float = MISSING
    betas: List[float] = MISSING
    eps: float = MISSING
    grad_clip: Optional[float] = MISSING
    warmup_steps: int = MISSING


@dataclass
class TrainerConfig:
    train_batch_size: int = MISSING
    mini_batch_size: int = MISSING
    ppo_epochs: int = MISSING
    micro_batch_size: Optional[int] = MISSING
    max_steps: int = MISSING
    max_samples: Optional[int] = MISSING
    max_time_s: Optional[float] = MISSING
    shuffle_minibatches: bool = MISSING
    val_every: int = MISSING
    val_samples: int = MISSING
    val_problems: Optional[int] = MISSING
    save_every: int = MISSING
    keep_last: int = MISSING
    threads: Optional[int] = MISSING
    cpus: Optional[List[int]] = MISSING
    tensorboard: bool = MISSING
    plots: bool = MISSING
    max_skipped_updates: int = MISSING
    max_entropy_fraction: Optional[float] = MISSING


@dataclass
class EvalConfig:
    n_samples: int = MISSING
    temperature: float = MISSING
    top_p: float = MISSING
    max_new_tokens: Optional[int] = MISSING
    batch_size: int = MISSING


@dataclass
class Config:
    name: str = MISSING
    seed: int = MISSING
    run_dir: Optional[str] = MISSING
    resume: str = MISSING
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


CHOICES = {
    "resume": ("auto", "never"),
    "reward.verifier": ("dapo", "tolerant", "math_verify"),
    "data.task": ("arithmetic", "file"),
    "model.arch": ("llama", "qwen2"),
    "rollout.on_filler_full": ("abort", "finish", "suspend"),
    "rollout.fill_order": ("finish", "prompt"),
    "rollout.server.sleep_level": (0, 1, 2),
    "rollout.server.weight_transport": engine_registry.CPU_WEIGHT_TRANSPORTS,
}


def choices() -> dict:
    """``CHOICES`` and ``rollout.engine``'s, read from the engine registry at each call (a row registered after this
    module was imported counts); ``inprocess`` runs no engine server."""
    return {**CHOICES, "rollout.engine": ("inprocess", *sorted(engine_registry.cpu_engines()))}


# Where each field of the shared algorithm block (nemo_dapo.core.settings.FIELDS) lives in this config.
ALGORITHM_KEYS = {name: "algorithm." + name for name in algorithm_settings.FIELDS}


def algorithm_values(cfg: Config) -> dict:
    """The shared algorithm block of ``cfg`` as ``{field: value}`` (see nemo_dapo.core.settings)."""
    return {name: _get(cfg, key) for name, key in ALGORITHM_KEYS.items()}


def _check_algorithm(cfg: Config) -> None:
    """The rules of nemo_dapo.core.settings (shared with the NeMo-side validator), first problem raised."""
    from nemo_dapo.core.settings import problems

    values = algorithm_values(cfg)
    for name, message in problems(values, cfg.rollout.max_new_tokens):
        key = ALGORITHM_KEYS[name]
        raise ConfigError(f"config key '{key}' = {values[name]!r} {message}"
                          + (" (l_max is algorithm.overlong.l_max, or rollout.max_new_tokens when null)"
                             if name == "overlong.l_cache" else ""))


def _get(cfg: Config, key: str):
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


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
    v = _get(cfg, key)
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
        if _get(cfg, key) <= 0:
            raise ConfigError(f"config key '{key}' = {_get(cfg, key)} must be > 0: nothing trains with it. Fix: "
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
        if 0 < _get(cfg, key) < MIN_TEMPERATURE:
            raise ConfigError(f"config key '{key}' = {_get(cfg, key)} is below {MIN_TEMPERATURE}: greedy in effect, "
                              "and a tiny one turns every log-prob into NaN. Fix: 0 for greedy decoding (not for "
                              f"rollouts), or a temperature of at least {MIN_TEMPERATURE}")
    _in_range(cfg, "eval.top_p", 0, 1, lo_open=True)
    for key in ("optim.warmup_steps", "warmup.lr_warmup_steps", "warmup.max_steps", "warmup.min_steps",
                "trainer.max_skipped_updates"):
        if _get(cfg, key) < 0:
            raise ConfigError(f"config key '{key}' must be >= 0, got {_get(cfg, key)}")
    for key in ("warmup.batch_size", "warmup.eval_every", "warmup.probe_size", "warmup.ramble_passes",
                "data.max_prompt_tokens", "data.tokenizer_rows", "rollout.round_tokens"):
        if _get(cfg, key) < 1:
            raise ConfigError(f"config key '{key}' must be >= 1, got {_get(cfg, key)}")
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
        if _get(cfg, key) not in allowed:
            raise ConfigError(f"config key '{key}' = {_get(cfg, key)!r} is not one of {allowed}")
    _check_algorithm(cfg)
    positive = ("trainer.train_batch_size", "trainer.mini_batch_size", "trainer.ppo_epochs",
                "trainer.keep_last", "trainer.save_every", "trainer.val_samples", "rollout.max_new_tokens",
                "eval.n_samples", "eval.batch_size", "rollout.processes", "data.heldout_size", "data.train_size",
                "reward.num_workers", "rollout.server.bucket_mb", "rollout.server.max_batch_size",
                "rollout.server.threads")
    for key in positive:
        if _get(cfg, key) < 1:
            raise ConfigError(f"config key '{key}' must be >= 1, got {_get(cfg, key)}")
    batch = cfg.trainer.train_batch_size * cfg.algorithm.group_size
    if cfg.trainer.mini_batch_size > batch:
        raise ConfigError(f"config key 'trainer.mini_batch_size' = {cfg.trainer.mini_batch_size} is more than the "
                          f"{batch} responses a step trains (trainer.train_batch_size x algorithm.group_size): every "
                          f"step would be one update. Fix: at most {batch} (a divisor of it for equal updates)")
    for key in ("trainer.max_steps", "trainer.val_every"):
        if _get(cfg, key) < 0:
            raise ConfigError(f"config key '{key}' must be >= 0, got {_get(cfg, key)}")
    for key in ("trainer.micro_batch_size", "trainer.threads", "trainer.val_problems", "trainer.max_samples",
                "eval.max_new_tokens", "warmup.max_new_tokens"):
        if _get(cfg, key) is not None and _get(cfg, key) < 1:
            raise ConfigError(f"config key '{key}' must be >= 1 or null, got {_get(cfg, key)}")
    for key in ("trainer.cpus", "rollout.server.cpus"):
        cpus = _get(cfg, key)
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
        if cfg.data.task == "arithmetic" and _get(cfg, key):
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


# ---- loading -------------------------------------------------------------------------------------------------------
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


def find_config(name: str, config_dir: Optional[str] = None) -> str:
    """Path of a config given a file path or a name looked up in ``<conf>/recipes`` then ``<conf>``."""
    if os.path.isfile(name):
        return name
    root = config_dir or CONF_DIR
    stem = name[:-5] if name.endswith(".yaml") else name
    for cand in (os.path.join(root, "recipes", stem + ".yaml"), os.path.join(root, stem + ".yaml")):
        if os.path.isfile(cand):
            return cand
    known = sorted(f[:-5] for d in (root, os.path.join(root, "recipes")) if os.path.isdir(d)
                   for f in os.listdir(d) if f.endswith(".yaml"))
    raise ConfigError(f"config {name!r} not found in {root!r} (recipes/ or top level); known configs: {known}")


def _load_tree(path: str, root: str):
    """The file's tree with its Hydra defaults list applied (cluster/yaml_compose.py, the cluster loader's too)."""
    from nemo_dapo.cluster.yaml_compose import compose_file

    return compose_file(path, root, _load_yaml, ConfigError)


def _yaml_error(where: str, e: Exception) -> ConfigError:
    """One line for a YAML syntax error: file, 1-based line and column, the parser's complaint."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    at = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    return ConfigError(f"{where}{at}: YAML syntax error: {problem}. Fix: correct the YAML there (indentation, a "
                       "missing ':' or closing bracket, a quote around values with ':' or '#')")


def _load_yaml(path: str):
    import yaml
    from omegaconf import DictConfig, OmegaConf

    try:
        node = OmegaConf.load(path)
    except yaml.YAMLError as e:
        raise _yaml_error(f"config file {path!r}", e) from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path!r}: not UTF-8 text (byte offset {e.start}). Fix: save it as "
                          "UTF-8") from None
    except OSError as e:
        raise ConfigError(f"config file {path!r} cannot be read: {e.strerror or e}") from None
    if not isinstance(node, DictConfig):
        raise ConfigError(f"config file {path!r}: the top level must be a mapping of keys (key: value), got "
                          f"{type(node).__name__}")
    return node


def _key_exists(tree, key: str) -> bool:
    from omegaconf import OmegaConf

    return OmegaConf.select(tree, key, default="__missing__") != "__missing__"


# Blocks that moved (old prefix -> new prefix): a key under the old one is an error naming its new place.
MOVED = {"reward.overlong": "algorithm.overlong"}


def _suggest(key: str) -> str:
    for old, new in MOVED.items():
        if key == old or key.startswith(old + "."):
            return f" (it moved: use '{new}{key[len(old):]}')"
    names = _all_keys(Config)
    close = difflib.get_close_matches(key, names, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _all_keys(cls, prefix: str = "") -> list:
    out = []
    for f in fields(cls):
        name = prefix + f.name
        out.append(name)
        default = f.default_factory() if callable(f.default_factory) else None  # type: ignore[misc]
        if is_dataclass(default):
            out.extend(_all_keys(type(default), name + "."))
    return out


def apply_overrides(tree, overrides: List[str]):
    """Apply ``key=value`` / ``+key=value`` / ``++key=value`` / ``~key`` overrides to an OmegaConf tree."""
    from omegaconf import OmegaConf

    for raw in overrides:
        if raw.startswith("~"):
            key = raw[1:].split("=", 1)[0]
            parent, _, leaf = key.rpartition(".")
            node = OmegaConf.select(tree, parent) if parent else tree
            if node is None or leaf not in node:
                raise ConfigError(f"override {raw!r}: no key '{key}' to delete{_suggest(key)}")
            node.pop(leaf)
            continue
        if "=" not in raw:
            raise ConfigError(f"override {raw!r} is not of the form key=value (or +key=value, ++key=value, ~key)")
        key, value = raw.split("=", 1)
        mode = "force" if key.startswith("++") else "add" if key.startswith("+") else "set"
        key = key.lstrip("+")
        exists = _key_exists(tree, key)
        if mode == "set" and not exists:
            raise ConfigError(f"override {raw!r}: unknown config key '{key}'{_suggest(key)}; "
                              f"use ++{key}=... to add a key the config does not have")
        if mode == "add" and exists:
            raise ConfigError(f"override {raw!r}: key '{key}' already exists; use {key}=... to change it")
        try:
            parsed = OmegaConf.from_dotlist([f"{key}={value}"])
        except Exception as e:  # noqa: BLE001 - a YAML error in the value, or a key omegaconf cannot take
            import yaml

            if isinstance(e, yaml.YAMLError):
                raise _yaml_error(f"override {raw!r}: value {value!r}", e) from None
            raise ConfigError(f"override {raw!r}: {str(e).splitlines()[0]}") from None
        tree = OmegaConf.merge(tree, parsed) if mode != "set" else _set(tree, key, _unresolved(parsed, key))
    return tree


def _unresolved(parsed, key: str):
    """The value of ``key`` in a one-override tree as written: an interpolation (``${name}``) stays one, to be
    resolved in the whole config (selecting it here would resolve it in the one-key tree, where it fails)."""
    from omegaconf import OmegaConf

    node = OmegaConf.to_container(parsed, resolve=False)
    for part in key.split("."):
        node = node[part]
    return node


def _set(tree, key: str, value):
    from omegaconf import OmegaConf

    OmegaConf.update(tree, key, value, merge=False)
    return tree


def to_config(tree) -> Config:
    """Validate an OmegaConf tree against the schema; errors name the key."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    _check_blocks(tree, Config)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), tree)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        first = str(e).splitlines()[0]
        if "issing mandatory value" in first:
            raise ConfigError(f"config key '{key}' has no value; set it in the recipe, in conf/dapo_base.yaml or "
                              f"on the command line ({key}=...)") from None
        if "not in" in first:
            raise ConfigError(f"unknown config key '{key}'{_suggest(key)}: {first}. Every key is documented in "
                              f"conf/dapo_base.yaml") from None
        raise ConfigError(f"config key '{key}': {first}") from None
    return validate(cfg)


def _check_blocks(tree, cls, prefix: str = "") -> None:
    """A block of keys (a section, or an open dict such as ``model.extra``) given a single value is an error naming
    the block and its keys (omegaconf's own merge error names no key). ``tree``: a plain dict or an OmegaConf one."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(tree, DictConfig):
        tree = OmegaConf.to_container(tree, resolve=False)
    for f in fields(cls):
        default = f.default_factory() if callable(f.default_factory) else None  # type: ignore[misc]
        if f.name not in tree or not (is_dataclass(default) or str(f.type).startswith("Dict")):
            continue
        key, value = prefix + f.name, tree[f.name]
        if isinstance(value, dict):
            if is_dataclass(default):
                _check_blocks(value, type(default), key + ".")
            continue
        if value is None or value == MISSING:
            continue  # omegaconf names the key of these itself
        inner = [g.name for g in fields(default)] if is_dataclass(default) else []
        keys = f" (its keys: {', '.join(inner)})" if inner else " (a mapping of extra keys)"
        example = f"{key}.{inner[0]}=..." if inner else f"++{key}.NAME=..."
        raise ConfigError(f"config key '{key}' is a block of keys{keys}, not a single value: got {value!r}. Fix: set "
                          f"one of its keys, e.g. {example}")


def load_config(name: str = DEFAULT_CONFIG, overrides: Optional[List[str]] = None,
                config_dir: Optional[str] = None) -> Config:
    """Load a named recipe (or a YAML path), apply command-line overrides, validate, return a :class:`Config`."""
    from omegaconf import OmegaConf

    root = config_dir or CONF_DIR
    path = find_config(name, root)
    tree = _load_tree(path, root)
    tree = apply_overrides(tree, list(overrides or []))
    try:
        OmegaConf.resolve(tree)  # ${...} interpolations, e.g. run_dir: runs/${name}
    except Exception as e:  # noqa: BLE001 - omegaconf raises several types here; all mean a bad interpolation
        raise ConfigError(f"config key '{_unresolvable(tree)}' (in {path!r} or an override): cannot resolve its "
                          f"interpolation: {str(e).splitlines()[0]}") from None
    return to_config(tree)


def _unresolvable(tree, prefix: str = "") -> str:
    """The first key of ``tree`` whose ``${...}`` interpolation does not resolve (omegaconf's resolve names none)."""
    from omegaconf import DictConfig, OmegaConf

    for key in tree.keys():
        full = f"{prefix}{key}"
        try:
            value = OmegaConf.select(tree, str(key))
        except Exception:  # noqa: BLE001 - any resolution error names this key
            return full
        if isinstance(value, DictConfig):
            inner = _unresolvable(value, full + ".")
            if inner != "?":
                return inner
    return "?"


def config_to_yaml(cfg: Config) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
