"""The base model of a CPU run: a local checkpoint (``model.path``) or the supervised warm-up, cached in the run
directory and reused when its inputs (model, warm-up, data and tokenizer settings, seed) are unchanged."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import asdict, fields

from nemo_dapo.config import Config, ConfigError
from nemo_dapo.data.tokenizer import build_task_tokenizer, load_tokenizer
from nemo_dapo.local.model import build_model, load_model, num_parameters
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


def fingerprint(cfg: Config) -> str:
    """Hash of everything the warm-up result depends on."""
    d = asdict(cfg.data)
    inputs = {"model": asdict(cfg.model), "warmup": asdict(cfg.warmup), "seed": cfg.seed,
              "task": {k: d[k] for k in ("min_terms", "max_terms", "max_operand", "max_value", "ops",
                                          "max_multiplier", "tokenizer_vocab_size", "tokenizer_rows")},
              "max_new_tokens": cfg.rollout.max_new_tokens}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def _cached(directory: str, key: str) -> bool:
    path = os.path.join(directory, FINGERPRINT)
    if not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8") as f:
        return json.load(f).get("fingerprint") == key


def prepare_base_model(cfg: Config) -> tuple:
    """(model in train mode, tokenizer, info dict for the summary)."""
    if cfg.model.path:
        model, tokenizer = load_model(cfg.model.path), load_tokenizer(cfg.model.path)
        return model.train(), tokenizer, {"source": cfg.model.path, "parameters": num_parameters(model)}
    if cfg.data.task != "arithmetic":
        raise ConfigError("config key 'model.path' must name a local model directory when data.task=file (the "
                          "supervised warm-up only knows the built-in arithmetic task)")
    directory, key = os.path.join(cfg.run_dir, BASE_DIR), fingerprint(cfg)
    if _cached(directory, key):
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
    # Written next to the final location and renamed, so a killed warm-up never leaves a half-saved cache.
    tmp = directory + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_warmup(tmp, model, tokenizer, stats, wcfg)
    with open(os.path.join(tmp, FINGERPRINT), "w", encoding="utf-8") as f:
        json.dump({"fingerprint": key}, f)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)
    return model.train(), tokenizer, info
