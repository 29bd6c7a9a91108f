"""The CPU job's config schema: typed blocks (stdlib dataclasses, no omegaconf), the keys with a fixed set of
choices, and where the shared algorithm block (nemo_dapo.core.settings) lives in it. Loading: ``config.py``; the
checks beyond types: ``config_checks.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass
from typing import Any, Dict, List, Optional

from nemo_dapo.core import engine_registry
from nemo_dapo.core import settings as algorithm_settings  # torch-free: the algorithm block's fields


# Types only: every default lives in conf/dapo_base.yaml, where each key is documented once.
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
    return {name: value_at(cfg, key) for name, key in ALGORITHM_KEYS.items()}


def value_at(cfg: Config, key: str):
    """The value at a dotted key of ``cfg`` (``"rollout.server.cpus"``)."""
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj
