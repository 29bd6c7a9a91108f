"""Hydra's defaults list, for the two config loaders (the CPU path's local/config.py and cluster/config_load.py).

A config file may start with ``defaults:``, merged in list order as Hydra composes it (``_self_`` is the file's own
keys; without it they come last):

  * ``- /name`` or ``- name``: another config file, ``<root>/name.yaml``, merged at the top level;
  * ``- group: option`` / ``- group@package: option``: ``<root>/group/option.yaml`` mounted at ``package``
    (default: the group's name), e.g. ``- algorithm@model.dapo.algorithm: dapo`` puts conf/algorithm/dapo.yaml
    under ``model.dapo.algorithm``.

tests/cluster/test_config_validate.py compares the result with Hydra's own ``compose`` for every recipe.
"""
from __future__ import annotations

import os
from typing import Callable


def _entry(entry, where: str, error: Callable[[str], Exception]) -> tuple:
    """(file relative to the config root, package or "") of one defaults entry, or ("_self_", "")."""
    if entry == "_self_":
        return "_self_", ""
    if isinstance(entry, str):
        name = entry.lstrip("/")
        return (name if name.endswith(".yaml") else name + ".yaml"), ""
    if hasattr(entry, "items") and len(entry) == 1:
        (key, option), = entry.items()
        group, _, package = str(key).lstrip("/").partition("@")
        return os.path.join(group, f"{option}.yaml"), package or group.replace("/", ".")
    raise error(f"config {where!r}: defaults entry {entry!r} is not a name, '_self_' or 'group[@package]: option'")


def compose_file(path: str, root: str, load: Callable, error: Callable[[str], Exception], seen: tuple = ()):
    """The OmegaConf tree of the config file at ``path`` with its defaults list applied (recursively).

    ``load(path)`` reads one YAML file (a DictConfig); ``error(message)`` makes the exception to raise."""
    from omegaconf import OmegaConf

    if path in seen:
        raise error(f"config {path!r} includes itself through its defaults list: {list(seen)}")
    node = load(path)
    defaults = node.pop("defaults", None) if "defaults" in node else None
    if defaults is None:
        return node
    merged, self_done = OmegaConf.create(), False
    for entry in defaults:
        rel, package = _entry(entry, path, error)
        if rel == "_self_":
            merged, self_done = OmegaConf.merge(merged, node), True
            continue
        absolute = isinstance(entry, str) and os.path.isabs(entry) and os.path.isfile(entry)
        base = entry if absolute else os.path.join(root, rel)
        if not os.path.isfile(base):
            raise error(f"config {path!r}: defaults entry {entry!r} not found (looked for {base!r})")
        sub = compose_file(base, root, load, error, seen + (path,))
        for part in reversed(package.split(".") if package else []):
            sub = OmegaConf.create({part: sub})
        merged = OmegaConf.merge(merged, sub)
    return merged if self_done else OmegaConf.merge(merged, node)
