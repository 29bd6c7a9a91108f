"""The base model of a CPU run: a local checkpoint (``model.path``) or the supervised warm-up, cached in the run
directory and reused when its inputs are unchanged.

The cache key (:func:`fingerprint`) covers everything the warm-up result depends on: the seed, the task and
tokenizer keys, the model config, the warm-up keys, the generation cap, and the code (a hash of the source files
that make the tokenizer, the model and the warm-up, plus the torch / transformers / tokenizers versions).
``run_dir/base_model/`` holds the result for the current inputs; a result for other inputs is never overwritten but
moved to ``run_dir/base_model.<key>/`` and moved back when a later run has those inputs again.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import asdict, fields

from nemo_dapo.core.checkpoint import atomic_directory
from nemo_dapo.local.config import Config, ConfigError
from nemo_dapo.data.tokenizer import build_task_tokenizer, load_tokenizer
from nemo_dapo.models.decoder import build_model, load_model, num_parameters
from nemo_dapo.local.run_data import make_task
from nemo_dapo.local.warmup import WarmupConfig, save_warmup, supervised_warmup

log = logging.getLogger("nemo_dapo")

BASE_DIR = "base_model"
FINGERPRINT = "fingerprint.json"


def model_kwargs(cfg: Config) -> dict:
    """The HF config keys of ``cfg.model`` (plus ``arch``) for ``build_model``."""
    m = asdict(cfg.model)
    extra = m.pop("extra")
    m.pop("path")
    m.update(extra)
    return m


def warmup_config(cfg: Config) -> WarmupConfig:
    w = asdict(cfg.warmup)
    w.pop("enabled")
    known = {f.name for f in fields(WarmupConfig)}
    unknown = sorted(set(w) - known)
    if unknown:
        raise ConfigError(f"config keys {['warmup.' + k for k in unknown]} are not understood by the local warm-up "
                          f"(it takes {sorted(known)})")
    if w.get("max_new_tokens") is None:
        w["max_new_tokens"] = cfg.rollout.max_new_tokens
    return WarmupConfig(**w, seed=cfg.seed)


# Source files (relative to the package) whose code decides the tokenizer, the model or the warm-up's result.
CODE_FILES = ("data/task.py", "data/template.py", "data/tokenizer.py", "models/decoder.py", "local/policy.py",
              "local/sampler.py", "models/kv_cache.py", "local/warmup.py", "local/run_model.py", "core/sampling.py",
              "core/logprobs.py", "core/reward.py", "core/answer_normalize.py")


def code_version() -> dict:
    """Versions of the code that builds the base model: a hash of ``CODE_FILES`` and the library versions."""
    import tokenizers
    import torch
    import transformers

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for rel in CODE_FILES:
        h.update(rel.encode())
        with open(os.path.join(root, rel), "rb") as f:
            h.update(f.read())
    return {"sources": h.hexdigest()[:16], "torch": torch.__version__, "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__}


def fingerprint_inputs(cfg: Config) -> dict:
    d = asdict(cfg.data)
    return {"model": asdict(cfg.model), "warmup": asdict(cfg.warmup), "seed": cfg.seed,
            "task": {k: d[k] for k in ("min_terms", "max_terms", "max_operand", "max_value", "ops",
                                        "max_multiplier", "tokenizer_vocab_size", "tokenizer_rows")},
            "max_new_tokens": cfg.rollout.max_new_tokens, "code": code_version()}


def fingerprint(cfg: Config) -> str:
    """Hash of everything the warm-up result depends on (:func:`fingerprint_inputs`)."""
    return hashlib.sha256(json.dumps(fingerprint_inputs(cfg), sort_keys=True).encode()).hexdigest()[:16]


def _key_of(directory: str):
    """The fingerprint a cached base model was saved under (None: not a complete cache entry)."""
    path = os.path.join(directory, FINGERPRINT)
    try:
        with open(path, encoding="utf-8") as f:
            key = json.load(f).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return None
    return key if isinstance(key, str) else None


def _select_cached(run_dir: str, key: str) -> bool:
    """Make ``run_dir/base_model`` the entry of ``key`` if one is cached; set a foreign one aside. True if found."""
    current = os.path.join(run_dir, BASE_DIR)
    held = _key_of(current) if os.path.isdir(current) else None
    if held == key:
        return True
    if os.path.isdir(current):  # another run's inputs: kept under its own key, never overwritten
        aside = os.path.join(run_dir, f"{BASE_DIR}.{held or 'unkeyed-%d' % time.time()}")
        if os.path.isdir(aside):
            shutil.rmtree(current)  # the same key is already kept there
        else:
            os.replace(current, aside)
            log.info("base model: the cached warm-up of other inputs is kept in %s", aside)
    entry = os.path.join(run_dir, f"{BASE_DIR}.{key}")
    if os.path.isdir(entry) and _key_of(entry) == key:
        os.replace(entry, current)
        return True
    return False


def prepare_base_model(cfg: Config) -> tuple:
    """(model in train mode, tokenizer, info dict for the summary)."""
    if cfg.model.path:
        model, tokenizer = load_model(cfg.model.path), load_tokenizer(cfg.model.path)
        return model.train(), tokenizer, {"source": cfg.model.path, "parameters": num_parameters(model)}
    if cfg.data.task != "arithmetic":
        raise ConfigError("config key 'model.path' must name a local model directory when data.task=file (the "
                          "supervised warm-up only knows the built-in arithmetic task)")
    directory, key = os.path.join(cfg.run_dir, BASE_DIR), fingerprint(cfg)
    if _select_cached(cfg.run_dir, key):
        model, tokenizer = load_model(directory), load_tokenizer(directory)
        info = {"source": "cache", "parameters": num_parameters(model)}
        warm = os.path.join(directory, "warmup.json")
        if os.path.isfile(warm):
            with open(warm, encoding="utf-8") as f:
                info["stats"] = json.load(f).get("stats")
        log.info("base model: reusing the warm-up result in %s", directory)
        return model.train(), tokenizer, info
    return _build_base(cfg, directory, key)


def _build_base(cfg: Config, directory: str, key: str) -> tuple:
    task = make_task(cfg)
    tokenizer = build_task_tokenizer(task, n_rows=cfg.data.tokenizer_rows, seed=cfg.seed,
                                     vocab_size=cfg.data.tokenizer_vocab_size)
    model = build_model(model_kwargs(cfg), vocab_size=len(tokenizer), pad_id=tokenizer.pad_token_id,
                        bos_id=tokenizer.bos_token_id, eos_id=tokenizer.eos_token_id, seed=cfg.seed)
    info = {"source": "warmup", "parameters": num_parameters(model)}
    wcfg = warmup_config(cfg)
    if cfg.warmup.enabled:
        log.info("base model: supervised warm-up of a %d-parameter %s (stops when the dev probe reaches %.2f-%.2f)",
                 info["parameters"], cfg.model.arch, wcfg.target_low, wcfg.target_high)
        model, stats = supervised_warmup(model, tokenizer, task, wcfg, log=log.info)
        info["stats"] = asdict(stats)
    else:
        from nemo_dapo.local.warmup import WarmupStats

        stats = WarmupStats(stop_reason="disabled")
    # Written next to the final location and swapped in, so a killed warm-up never leaves a half-saved cache (only
    # an unkeyed leftover can be at `directory`: _select_cached moved the others aside).
    with atomic_directory(directory) as tmp:
        save_warmup(tmp, model, tokenizer, stats, wcfg)
        with open(os.path.join(tmp, FINGERPRINT), "w", encoding="utf-8") as f:
            json.dump({"fingerprint": key, "inputs": fingerprint_inputs(cfg)}, f, indent=1)
    return model.train(), tokenizer, info
