"""What the trainer relies on in Transformer Engine and in megatron-core's TE wrappers, read from the installed files
without importing TE (it needs a GPU to build a layer): at the trainer image's build (containers/Dockerfile runs
``python -m nemo_dapo.megatron.te_check``) and when the actor builds its model.

* TE is installed: the trainer builds TE's layer spec (``model.transformer_engine: True``).
* TE 1.9 is megatron-core 0.10's gate for two things, compared as megatron-core compares them
  (``is_te_min_version``). Grouped-GEMM experts (``TEColumnParallelGroupedLinear``, from "1.9.0.dev0"): below it
  ``moe_grouped_gemm: True`` builds the legacy ``GroupedMLP``, whose ``experts.weight1`` / ``weight2`` the refit
  does not map, so the actor refuses it (:func:`grouped_gemm_problem`). TE's norm for QK-norm (from "1.9.0"): below
  it megatron-core takes apex's ``FusedLayerNorm``, which refuses RMSNorm, and ``model.gpt_layer_spec`` builds its
  own (:func:`qk_norm_is_apex`). NeMo-Aligner 0.7.0's own image has TE 1.8.0.dev0 (commit 7d576ed2), so neither is
  an image error: the check prints what the installed TE rules out.
* Where TE has grouped linears, expert i's weight is ``weight{i}`` (TE's ``GroupedLinear``, and megatron-core's
  checkpoint adapter reads ``full_state_dict[f'weight{gemm_idx}']``): the names ``model.sequential_expert_name``
  reads as SequentialMLP's. A rename there fails the build.
"""
from __future__ import annotations

import importlib.util
import os
from importlib import metadata
from typing import Optional

from packaging.version import Version

GROUPED_GEMM_TE = "1.9.0.dev0"  # megatron-core 0.10 transformer_engine.py: TEGroupedLinear exists from this TE on
QK_NORM_TE = "1.9.0"  # megatron-core 0.10 gpt_layer_specs.py: TENorm as QK-norm from this TE on, else FusedLayerNorm
# file (relative to its top-level package) -> text it must contain
FILES = {
    "megatron/core/extensions/transformer_engine.py": "full_state_dict[f'weight{gemm_idx}']",
    "transformer_engine/pytorch/module/grouped_linear.py": 'f"weight{i}"',
}


def te_version() -> Optional[str]:
    """The installed Transformer Engine's version, or None."""
    for name in ("transformer_engine", "transformer-engine", "transformer_engine_torch"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _below(version: Optional[str], minimum: str) -> bool:
    """Whether TE ``version`` is installed and older than ``minimum``, as megatron-core's ``is_te_min_version``
    compares (``packaging`` versions: a ``.dev0`` comes before its release)."""
    return version is not None and Version(version) < Version(minimum)


def qk_norm_is_apex(version: Optional[str]) -> bool:
    """Whether megatron-core 0.10's TE spec builds QK-norm from apex's ``FusedLayerNorm`` with TE ``version``."""
    return _below(version, QK_NORM_TE)


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


def grouped_gemm_problem(version: Optional[str]) -> str:
    """Why ``moe_grouped_gemm: True`` cannot run with TE ``version``; "" when it can."""
    if version is None:
        return ("model.moe_grouped_gemm=True needs Transformer Engine (megatron-core's TEGroupedMLP), which is not "
                "installed; fix: model.moe_grouped_gemm=False")
    if _below(version, GROUPED_GEMM_TE):
        return (f"model.moe_grouped_gemm=True needs Transformer Engine >= 1.9 (found {version}): below it "
                "megatron-core 0.10 builds the legacy GroupedMLP, whose experts.weight1 / weight2 the engine refit "
                "does not map; fix: model.moe_grouped_gemm=False (one GEMM per local expert)")
    return ""


def check(files: dict, version: Optional[str]) -> list:
    """The problems with ``files`` (``installed_files()``) and TE ``version``; [] when they match."""
    problems = []
    if version is None:
        problems.append("transformer_engine is not installed: the trainer builds TE's layers "
                        "(model.transformer_engine=True); build on NeMo-Aligner 0.7.0's image (containers/)")
    for path, text in FILES.items():
        if path.startswith("transformer_engine/") and (version is None or _below(version, GROUPED_GEMM_TE)):
            continue  # no grouped linear below 1.9: nothing to name
        if files.get(path) is None:
            problems.append(f"{path} is not installed")
        elif text not in files[path]:
            problems.append(f"{path} no longer has {text}: a grouped linear's expert weights may be named "
                            "otherwise than weight{i}, which nemo_dapo.megatron.model.sequential_expert_name reads")
    return problems


def report(version: Optional[str]) -> str:
    """One line on what the installed TE allows (printed by the image build)."""
    grouped = "refused at launch" if grouped_gemm_problem(version) else "available"
    qk = "nemo_dapo's torch norm (apex's FusedLayerNorm refuses RMSNorm)" if qk_norm_is_apex(version) else "TE's"
    return f"transformer_engine {version}: grouped-GEMM experts {grouped}; QK-norm (Qwen3): {qk}"


if __name__ == "__main__":
    import sys

    found = check(installed_files(), te_version())
    print("\n".join(found) or f"nemo_dapo.megatron.te_check: {report(te_version())}")
    sys.exit(1 if found else 0)
