"""A tiny algorithm registry for NeMo-Aligner-style launchers.

NeMo-Aligner 0.7.0 has no registry of its own: an algorithm is a trainer class, an actor (model) class, a Hydra
config and a launcher script that live side by side. This module names those four pieces in one record and lets
launchers find plugins through the ``nemo_aligner.algorithms`` entry-point group, e.g. in setup.py::

    entry_points={"nemo_aligner.algorithms": ["dapo=nemo_dapo.cluster.registry:DAPO_ALGORITHM"]}

Everything here is metadata: class paths are strings, resolved only by ``Algorithm.load_trainer`` /
``load_actor``, so listing algorithms imports neither NeMo nor Megatron.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Optional

ENTRY_POINT_GROUP = "nemo_aligner.algorithms"
_REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Algorithm:
    """What a launcher needs to run one algorithm. Class paths are ``"package.module:Class"`` strings."""

    name: str
    trainer: str  # trainer class path, e.g. "nemo_dapo.aligner.trainer:DAPOTrainer"
    actor: str  # actor (Megatron GPT model) class path
    config: str  # default Hydra config, a path relative to the distribution root (or absolute)
    example: str  # launcher script with @hydra_runner, same convention as ``config``
    description: str = ""

    def __post_init__(self):
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"Algorithm.name must be a non-empty identifier (letters, digits, '-', '_'), "
                             f"got {self.name!r}")
        for key in ("trainer", "actor"):
            value = getattr(self, key)
            if value.count(":") != 1 or not all(value.split(":")):
                raise ValueError(f"Algorithm {self.name!r}: {key}={value!r} must look like 'package.module:Class'")

    def load_trainer(self):
        """Import and return the trainer class (imports NeMo)."""
        return _import_object(self.trainer)

    def load_actor(self):
        """Import and return the actor class (imports NeMo)."""
        return _import_object(self.actor)

    def config_path(self, root: Optional[Path] = None) -> Path:
        return _resolve(self.config, root)

    def example_path(self, root: Optional[Path] = None) -> Path:
        return _resolve(self.example, root)


def _resolve(path: str, root: Optional[Path]) -> Path:
    p = Path(path)
    return p if p.is_absolute() else (root or _REPO_ROOT) / p


def _import_object(path: str):
    module_name, _, attr = path.partition(":")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError as e:
        raise ImportError(f"{module_name} has no attribute {attr!r} (from class path {path!r})") from e


DAPO_ALGORITHM = Algorithm(
    name="dapo",
    trainer="nemo_dapo.aligner.trainer:DAPOTrainer",
    actor="nemo_dapo.aligner.actor:MegatronGPTDAPOActorModel",
    config="conf/gpt_dapo_actor.yaml",
    example="examples/train_gpt_dapo.py",
    description="Decoupled Clip and Dynamic sAmpling Policy Optimization (Yu et al. 2025)",
)

_REGISTRY: dict[str, Algorithm] = {}


def register(algorithm: Algorithm, *, replace: bool = False) -> Algorithm:
    """Add ``algorithm`` under its name; a different record under a taken name needs ``replace=True``."""
    if not isinstance(algorithm, Algorithm):
        raise TypeError(f"register() takes an Algorithm, got {type(algorithm).__name__}")
    old = _REGISTRY.get(algorithm.name)
    if old is not None and old != algorithm and not replace:
        raise ValueError(f"algorithm {algorithm.name!r} is already registered ({old.trainer}); "
                         "pass replace=True to override it")
    _REGISTRY[algorithm.name] = algorithm
    return algorithm


def _discover() -> None:
    """Register the ``nemo_aligner.algorithms`` entry points not registered yet; a broken one warns, not fails."""
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _REGISTRY:
            continue
        try:
            algorithm = ep.load()
        except Exception as e:  # a broken third-party plugin must not hide the others
            print(f"warning: entry point {ep.name}={ep.value} failed to load: {e}", file=sys.stderr)
            continue
        if not isinstance(algorithm, Algorithm) or algorithm.name != ep.name:
            print(f"warning: entry point {ep.name}={ep.value} is not an Algorithm named {ep.name!r}; skipped",
                  file=sys.stderr)
            continue
        register(algorithm)


def list_algorithms() -> list[Algorithm]:
    """All registered algorithms, entry points included, sorted by name."""
    _discover()
    return sorted(_REGISTRY.values(), key=lambda a: a.name)


def get(name: str) -> Algorithm:
    _discover()
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise KeyError(f"unknown algorithm {name!r} (registered: {known}); a plugin registers one through the "
                       f"{ENTRY_POINT_GROUP!r} entry-point group") from None


register(DAPO_ALGORITHM)


# ---- command line: `nemo-dapo algorithms` ---------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    """``algorithms`` takes no arguments."""


def run_cli(args: argparse.Namespace) -> int:
    for a in list_algorithms():
        print(f"{a.name}: {a.description}")
        print(f"  trainer  {a.trainer}\n  actor    {a.actor}\n  config   {a.config}\n  example  {a.example}")
    return 0


# (name, help, add_arguments(parser), run(args) -> exit code): the shape of nemo_dapo.cli.SUBCOMMANDS entries.
CLI = ("algorithms", "list the algorithms registered for NeMo-Aligner launchers (nemo_aligner.algorithms)",
       add_arguments, run_cli)


def add_cli(subparsers) -> argparse.ArgumentParser:
    """Add the ``algorithms`` subcommand to an argparse ``subparsers`` (handler in ``func`` and ``run``)."""
    p = subparsers.add_parser(CLI[0], help=CLI[1], description=CLI[1])
    add_arguments(p)
    p.set_defaults(func=run_cli, run=run_cli)
    return p
