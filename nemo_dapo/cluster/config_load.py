"""Read DAPO actor configs without NeMo: conf/gpt_dapo_actor.yaml merged with an override-only recipe and command-line
overrides as ``train_gpt_dapo.py --config-name`` would (``load_config``), the resolvers NeMo-Aligner registers, the
algorithm block's keys and their former places, and strict readers of single keys (``required``, ``select``,
``nemo_model_key``). The rules that check a loaded config: ``config_validate.py``.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Iterable, Optional, Union

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from nemo_dapo.core import settings as algorithm  # torch-free: the algorithm block's fields
from nemo_dapo.core.settings import ConfigError  # the one config error of both paths
from nemo_dapo.cluster.yaml_compose import compose_file

# The shared algorithm block (nemo_dapo.core.settings.FIELDS) is one block of gpt_dapo_actor.yaml, under model.dapo
# because the actor sees only the model config (which NeMo saves with the checkpoint); the trainer reads the same
# block from cfg.model. Both read these keys strictly through this table; the validator checks them with the shared
# rules.
ALGORITHM_BLOCK = "model.dapo.algorithm"
ALGORITHM_KEYS = {name: f"{ALGORITHM_BLOCK}.{name}" for name in algorithm.FIELDS}
# The block's keys used to live under trainer.dapo.* and model.dapo.*: a key given there (override, recipe or merged
# config) is an error naming its new place, never silently left unread.
_BLOCK_TOP = frozenset(name.split(".")[0] for name in algorithm.FIELDS)
_OLD_PARENTS = ("trainer.dapo", "model.dapo")

REPO_CONF = Path(__file__).resolve().parents[2] / "conf"
PACKAGE_CONF = Path(__file__).resolve().parents[1] / "conf"
BASE_CONFIG = "gpt_dapo_actor.yaml"


def moved_key(key: str) -> Optional[str]:
    """The new path of an old algorithm key (``trainer.dapo.group_size`` -> ``model.dapo.algorithm.group_size``;
    also ``trainer.dapo.overlong`` or anything under it), else None."""
    for parent in _OLD_PARENTS:
        rest = key[len(parent) + 1:] if key.startswith(parent + ".") else None
        if rest and rest.split(".")[0] in _BLOCK_TOP:
            return f"{ALGORITHM_BLOCK}.{rest}"
    return None


def moved_message(key: str, where: str = "") -> str:
    new = moved_key(key)
    return (f"{where}{key} is not read any more: the DAPO algorithm keys are one block, {ALGORITHM_BLOCK} (the same "
            f"names as the CPU path's algorithm block); fix: set {new} instead")


def moved_keys_in(cfg) -> list:
    """The old algorithm key paths (``trainer.dapo.<k>`` / ``model.dapo.<k>``, k a key of the block) present in
    ``cfg`` (a plain dict or DictConfig, unresolved is fine)."""
    found = []
    for parent in _OLD_PARENTS:
        node: Any = cfg
        for part in parent.split("."):
            node = node.get(part) if isinstance(node, (dict, DictConfig)) else None
        if isinstance(node, (dict, DictConfig)):
            found += [f"{parent}.{k}" for k in node.keys() if k in _BLOCK_TOP]
    return found


def reject_moved_overrides(items: Iterable[str]) -> None:
    """Raise :class:`ConfigError` for command-line overrides (``[+|++]key=value``) of old algorithm key paths; the
    launcher calls it before Hydra, whose own error would not name the new key."""
    found = [moved_message(key, f"override {item!r}: ") for item in items
             for key in [item.lstrip("+~").partition("=")[0]] if moved_key(key)]
    if found:
        raise ConfigError(found)


def register_resolvers() -> None:
    """The resolvers NeMo-Aligner's launchers register (same names and semantics), needed to resolve our YAML."""
    OmegaConf.register_new_resolver("multiply", lambda x, y: x * y, replace=True)
    OmegaConf.register_new_resolver("int_div", lambda x, y: x // y, replace=True)
    OmegaConf.register_new_resolver("subtract", lambda x, y: x - y, replace=True)


@functools.lru_cache(maxsize=64)
def _parsed(path: str, mtime_ns: int) -> dict:
    return OmegaConf.to_container(OmegaConf.load(path), resolve=False)  # YAML parsing dominates load time: cache it


def read_yaml(path: Path) -> DictConfig:
    """A fresh DictConfig of the YAML file at ``path`` (parsed once per file version)."""
    return OmegaConf.create(_parsed(str(path), path.stat().st_mtime_ns))


def find_config(name: Union[str, Path]) -> Path:
    """A config file: an existing path, or a name under conf/ or conf/recipes/ (".yaml" optional)."""
    path = Path(name)
    if path.is_file():
        return path
    stem = path.name if path.suffix == ".yaml" else path.name + ".yaml"
    for root in (REPO_CONF, PACKAGE_CONF):
        for candidate in (root / path.parent / stem, root / "recipes" / stem):
            if candidate.is_file():
                return candidate
    known = sorted({p.stem for root in (REPO_CONF, PACKAGE_CONF) for p in (root / "recipes").glob("*.yaml")})
    raise FileNotFoundError(f"config {str(name)!r} not found as a file or under conf/recipes/ (known recipes: "
                            f"{', '.join(known) or 'none'})")


def recipe_base(recipe: DictConfig) -> Optional[str]:
    """The base config a recipe's Hydra ``defaults`` list names (``/gpt_dapo_actor`` -> ``gpt_dapo_actor``)."""
    for entry in recipe.get("defaults", []) or []:
        if isinstance(entry, str) and entry != "_self_":
            return entry.lstrip("/")
    return None


def load_config(recipe: Optional[Union[str, Path]] = None, overrides: Iterable[str] = (),
                resolve: bool = True) -> DictConfig:
    """The base config merged with ``recipe`` (override-only: a key absent from the base is an error) and dotlist
    ``overrides`` (``key=value``; ``+key=value`` adds a key), like ``train_gpt_dapo.py --config-name``."""
    register_resolvers()
    base_path = find_config(BASE_CONFIG)
    # the base's own defaults list mounts conf/algorithm/dapo.yaml at model.dapo.algorithm (as Hydra does)
    cfg = compose_file(str(base_path), str(base_path.parent), lambda p: read_yaml(Path(p)),
                       lambda message: ConfigError([message]))
    if recipe is not None:
        rpath = find_config(recipe)
        rcfg = read_yaml(rpath)
        base_name = recipe_base(rcfg)
        if base_name != Path(BASE_CONFIG).stem:
            raise ValueError(f"{rpath}: its Hydra 'defaults' must start with /{Path(BASE_CONFIG).stem} "
                             f"(found {base_name!r}); recipes are overrides of {BASE_CONFIG}")
        rcfg.pop("defaults", None)
        moved = moved_keys_in(rcfg)
        if moved:
            raise ConfigError([moved_message(key, f"{rpath}: ") for key in moved])
        OmegaConf.set_struct(cfg, True)
        try:
            cfg = OmegaConf.merge(cfg, rcfg)
        except OmegaConfBaseException as e:  # ConfigKeyError for a key the base lacks
            raise ValueError(f"{rpath} sets a key that {base_path.name} does not have ({e}); recipes may only "
                             "override existing keys: fix the spelling or add the key, documented, to the base") from e
        OmegaConf.set_struct(cfg, False)
    overrides = list(overrides)
    reject_moved_overrides(overrides)
    for item in overrides:
        key, sep, value = item.lstrip("+").partition("=")
        if not sep:
            raise ValueError(f"override {item!r} must look like key=value")
        if not item.startswith("+") and OmegaConf.select(cfg, key, default=_MISSING) is _MISSING:
            raise ValueError(f"override {item!r}: no key {key!r} in the config (use +{item} to add one)")
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([item.lstrip("+")]))  # YAML-typed like Hydra
    if resolve:
        OmegaConf.resolve(cfg)
    return cfg


_MISSING = object()


def required(node, key: str, where: str) -> Any:
    """The value at dotted ``key`` of ``node`` (DictConfig or dict; null is a value), or :class:`ConfigError`
    naming ``where.key`` (``where`` "": ``node`` is the whole config): the runtime reads every key the YAML defines
    strictly, so no code default can drift from the documented one."""
    full = f"{where}.{key}" if where else key
    for part in key.split("."):
        node = node.get(part, _MISSING) if isinstance(node, (dict, DictConfig)) else _MISSING
        if node is _MISSING:
            raise ConfigError([f"config key {full} is missing; set it (every key is documented in "
                               f"conf/{BASE_CONFIG}, which recipes and tests start from)"])
    return node


# NeMo's own model keys that the runtime reads with a default: NeMo builds the model from them with these defaults
# when the (checkpoint's) model config lacks them (nemo/.../megatron_base_model.py, ``cfg.get(key, default)``), so
# reading them strictly would refuse configs NeMo runs, and any other default would misdescribe the model NeMo
# built. tests/aligner/test_algorithm_block.py checks these values against the installed NeMo source.
NEMO_MODEL_DEFAULTS = {"tensor_model_parallel_size": 1, "sequence_parallel": False, "context_parallel_size": 1,
                       "expert_model_parallel_size": 1, "qkv_bias": False, "bias": True, "num_moe_experts": None}


def nemo_model_key(model_cfg, key: str) -> Any:
    """``model.<key>`` of a NeMo model config, with NeMo's default (:data:`NEMO_MODEL_DEFAULTS`) when absent."""
    return model_cfg.get(key, NEMO_MODEL_DEFAULTS[key])


def to_plain(cfg) -> dict:
    """``cfg`` as a plain dict, resolved (a DictConfig is converted; a dict is returned as it is)."""
    if isinstance(cfg, DictConfig):
        register_resolvers()
        return OmegaConf.to_container(cfg, resolve=True)
    return cfg


def select(cfg: dict, key: str, default: Any = None) -> Any:
    """The value at dotted ``key`` of a plain dict; ``default`` when absent or null."""
    node: Any = cfg
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return default if node is None else node
