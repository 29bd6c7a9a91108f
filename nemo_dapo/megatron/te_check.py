"""What the trainer relies on in Transformer Engine and in megatron-core's TE wrappers, checked where both are
installed: the trainer image's build (containers/Dockerfile runs ``python -m nemo_dapo.megatron.te_check``).

TE needs a GPU to build a layer, so the facts are read from the installed files, without importing TE:

* TE >= 1.9, megatron-core 0.10's gate for ``TEColumnParallelGroupedLinear``: below it ``moe_grouped_gemm: True``
  (the Qwen3-MoE recipes) builds the legacy ``GroupedMLP``, whose ``experts.weight1`` / ``weight2`` the refit does
  not map, instead of ``TEGroupedMLP``;
* a grouped linear names expert i's weight ``weight{i}`` (TE's ``GroupedLinear``, and megatron-core's checkpoint
  adapter reads ``full_state_dict[f'weight{gemm_idx}']``): the names ``model.sequential_expert_name`` reads as
  SequentialMLP's.
"""
from __future__ import annotations

import importlib.util
import os
from importlib import metadata
from typing import Optional

MIN_TE = (1, 9)
# file (relative to its top-level package) -> text it must contain
FILES = {
    "megatron/core/extensions/transformer_engine.py": "full_state_dict[f'weight{gemm_idx}']",
    "transformer_engine/pytorch/module/grouped_linear.py": 'f"weight{i}"',
}


def _te_version() -> Optional[str]:
    for name in ("transformer_engine", "transformer-engine", "transformer_engine_torch"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def installed_files() -> dict:
    """{path in FILES: its installed text, or None}, found without importing the packages."""
    out = {}
    for path in FILES:
        spec = importlib.util.find_spec(path.split("/")[0])
        roots = list(spec.submodule_search_locations or []) if spec else []
        found = [os.path.join(root, *path.split("/")[1:]) for root in roots]
        found = [f for f in found if os.path.isfile(f)]
        out[path] = open(found[0], encoding="utf-8").read() if found else None
    return out


def check(files: dict, te_version: Optional[str]) -> list:
    """The problems with ``files`` (``installed_files()``) and ``te_version``; [] when they match."""
    problems = []
    if te_version is None:
        problems.append("transformer_engine is not installed: the trainer builds TE's layers "
                        "(model.transformer_engine=True); use the NeMo container")
    else:
        major_minor = tuple(int(p) for p in te_version.split(".")[:2] if p.isdigit())
        if major_minor < MIN_TE:
            problems.append(f"transformer_engine {te_version} < 1.9: megatron-core has no TE grouped linear, so "
                            "moe_grouped_gemm=True builds the legacy GroupedMLP, whose weights the refit does not "
                            "map; set model.moe_grouped_gemm=False in the Qwen3-MoE recipes or use a newer TE")
    for path, text in FILES.items():
        if files.get(path) is None:
            problems.append(f"{path} is not installed")
        elif text not in files[path]:
            problems.append(f"{path} no longer has {text}: a grouped linear's expert weights may be named "
                            "otherwise than weight{i}, which nemo_dapo.megatron.model.sequential_expert_name reads")
    return problems


if __name__ == "__main__":
    import sys

    found = check(installed_files(), _te_version())
    print("\n".join(found) or "nemo_dapo.megatron.te_check: the installed TE and megatron-core match")
    sys.exit(1 if found else 0)
