"""Run configuration: a typed schema (stdlib dataclasses), YAML loading with Hydra-style defaults lists, and
command-line overrides as NeMo users write them.

* ``conf/dapo_base.yaml`` documents every key once; recipes in ``conf/recipes/`` only override
  (``defaults: [/dapo_base, _self_]``, merged in list order as Hydra does).
* Overrides: ``key=value`` (the key must exist), ``+key=value`` (adds a key that must not exist yet),
  ``++key=value`` (add or override), ``~key`` (delete, i.e. fall back to the schema default). Values are parsed as
  YAML (``1e-6``, ``null``, ``[1,2]``, ``true``).
* The merged tree is validated against :class:`Config`: an unknown key or a value of the wrong type raises
  :class:`ConfigError` naming the full key and the fix. Open dicts (``model.extra``) accept new keys.

The schema (``config_schema.py``) is plain dataclasses so that the local backend can take a ``Config`` without
importing omegaconf; omegaconf is imported only inside the loading functions. The checks beyond types:
``config_checks.py``.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import fields, is_dataclass
from typing import List, Optional

from nemo_dapo.core.settings import ConfigError  # the one config error of both paths
from nemo_dapo.local.config_checks import check_trainable, validate
from nemo_dapo.local.config_schema import (ALGORITHM_KEYS, CHOICES, MISSING, AlgorithmConfig, Config, algorithm_values,
                                           choices)

# The config API: this module, its schema and its checks (tests and the CLI import these names from here).
__all__ = ["ALGORITHM_KEYS", "CHOICES", "CONF_DIR", "DEFAULT_CONFIG", "AlgorithmConfig", "ArgumentError", "Config",
           "ConfigError", "algorithm_values", "check_trainable", "choices", "config_to_yaml", "find_config",
           "load_config", "validate"]

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")  # nemo_dapo/conf
DEFAULT_CONFIG = "tiny_cpu"


class ArgumentError(ConfigError):
    """A command-line argument is invalid; the message names the argument and the fix (exit code 2)."""


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
