"""The cluster path's NeMo-free tooling: the recipe loader and validator (``config_load``, ``config_validate``), the
planner behind ``nemo-dapo plan`` (``plan*``), the engine servers' options (``engine_options``), the
``nemo_aligner.algorithms`` registry and the NeMo-Aligner actor's batch layout (``layout``). Importable on a login
node: omegaconf and torch, never NeMo, NeMo-Aligner, megatron-core or TensorRT-LLM (tests/test_layering.py holds the
rule)."""
