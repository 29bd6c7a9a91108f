"""The assumptions of `nemo-dapo plan`: each one's default and the reason for it (printed beside every plan), and
the range a ``plan.assume.*`` override must lie in. The one place these defaults live (conf/gpt_dapo_actor.yaml's
``plan.assume`` keys are null = these). Imports nothing.
"""
from __future__ import annotations

# the published range of eager_layer_ms (its reason below); a plan of an engine without CUDA graphs also prints its
# step at the top of it
EAGER_LAYER_MS_RANGE = (0.25, 0.8)

# (default, reason). One set for every recipe and for every calibration row; the calibrated ones were chosen on
# benchmarks/calibration/ (the published runs there) and are checked there by tests/cluster/test_plan_calibration.py.
ASSUMPTIONS = {
    "mean_prompt_tokens": (250, "GUESS: DAPO-Math-17k prompts with the template"),
    "mean_response_tokens": (6000, "GUESS: mid-run mean response of DAPO at 20k tokens (paper Fig. 7a: ~1-4k early)"),
    "truncated_fraction": (0.05, "GUESS: share of responses that hit the generation cap"),
    "oversample": (3.0, "the reference's 3x generation batch (verl / NeMo-RL DAPO recipes)"),
    "pass_rate": (None, "null: model.dapo.algorithm.dynamic_sampling.prior_pass_rate (share of groups kept)"),
    "hfu": (None, "null: 0.40 dense (calibrated: the NeMo-RL H100 rows and the verl H20 row), 0.25 MoE (GUESS: "
                  "no MoE row)"),
    "logprob_hfu": (None, "null: half the update's (calibrated: verl 7B H20, old log-prob 54 s = 2N vs update "
                          "114 s = 8N; forward-only passes use the GPU about half as well)"),
    "decode_efficiency": (0.75, "achieved fraction of HBM bandwidth while decoding (SCALE.md 3.3)"),
    "decode_step_overhead_ms": (3.0, "calibrated: fixed cost of a decode step (scheduling, sampling, launches); "
                                     "the verl row's generation is mostly the 28.7k steps of its longest response"),
    "allreduce_us": (15.0, "GUESS: latency of one small NVLink all-reduce (2 per layer per decode step at TP > 1)"),
    "decode_step_floor_ms": (None, "null: no floor (the step follows bytes / bandwidth + overhead)"),
    "eager_layer_ms": (EAGER_LAYER_MS_RANGE[0], "GUESS: host time to launch one layer's kernels in a decode step "
                       "of an engine without CUDA graphs (plan.cuda_graphs); the GPU runs meanwhile, so a stage takes "
                       "the longer of the two. The low end of what published eager / graph decode pairs give: "
                       f"{EAGER_LAYER_MS_RANGE[0]} (sglang PR 1401: Llama-3-8B at batch 1, 9.3 against 7.1 ms a step) "
                       f"to {EAGER_LAYER_MS_RANGE[1]} ms (verl's eager vLLM Qwen3-30B-A3B row at its guessed mean "
                       "length)"),
    "refit_gb_per_s": (5.0, "GUESS: legacy engine weight refit per GPU (convert + trt.Refitter)"),
    "handover_gb_per_s": (5.0, "GUESS: engine servers: HF-named gather over TP/PP/EP + shared-memory handover"),
    "sleep_wake_s": (5.0, "GUESS: engine servers: one sleep + wake of a colocated engine"),
    "network_gb_per_s": (8.0, "published: verl's checkpoint-engine ablation on H20 (docs/advance/fully_async.md) "
                              "synced Qwen3-235B-A22B's 470 GB from 64 trainer to 64 rollout ranks in 58.6 s = "
                              "8.0 GB/s (Qwen3-30B-A3B: 61 GB in 15.8 s = 3.9 GB/s); disaggregated layouts send the "
                              "whole bf16 model once per refit, the engines receiving in parallel"),
    "alltoall_gb_per_s": (40.0, "GUESS: what the MoE token all-to-all gets across nodes per GPU, 80% of one "
                                "400 Gb/s InfiniBand port (DGX H100 datasheet: eight ConnectX-7 ports, one a GPU); "
                                "the traffic within a node is left to the MoE utilisation"),
    "pcie_gb_per_s": (25.0, "GUESS: host <-> device copies for offload and reload, per GPU with the node's eight "
                            "at once (one H200 alone: 55 GB/s each way, benchmarks/state_offload.py)"),
    "engine_workspace_gb": (3.0, "GUESS: TRT-LLM activations and workspace"),
    "cuda_reserved_gb": (3.0, "GUESS: CUDA context, NCCL buffers"),
    "usable_fraction": (0.95, "GUESS: allocator fragmentation margin"),
}
DEFAULT_ASSUMPTIONS = {k: v for k, (v, _) in ASSUMPTIONS.items()}
# The range of each assumption as (low, low allowed, high or None): rates, lengths and utilisations must be > 0
# (they divide), fractions lie in [0, 1] or (0, 1], overheads may be 0, and a null takes the default above.
ASSUMPTION_RANGES = {
    "mean_prompt_tokens": (0, False, None), "mean_response_tokens": (0, False, None),
    "truncated_fraction": (0, True, 1), "oversample": (1, True, None), "pass_rate": (0, False, 1),
    "hfu": (0, False, 1), "logprob_hfu": (0, False, 1), "decode_efficiency": (0, False, 1),
    "decode_step_overhead_ms": (0, True, None), "allreduce_us": (0, True, None),
    "decode_step_floor_ms": (0, True, None), "eager_layer_ms": (0, True, None), "refit_gb_per_s": (0, False, None),
    "handover_gb_per_s": (0, False, None), "network_gb_per_s": (0, False, None), "sleep_wake_s": (0, True, None),
    "alltoall_gb_per_s": (0, False, None),
    "pcie_gb_per_s": (0, False, None),
    "engine_workspace_gb": (0, True, None), "cuda_reserved_gb": (0, True, None), "usable_fraction": (0, False, 1),
}
LOGPROB_HFU_RATIO = 0.5  # logprob_hfu when null: this share of the update's HFU (ASSUMPTIONS["logprob_hfu"])
