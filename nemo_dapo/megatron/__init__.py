"""megatron-core layer (no NeMo): everything the DAPO step needs on a Megatron-parallel model.

Modules (import them directly; this package imports nothing so that ``import nemo_dapo.megatron`` stays cheap):

* ``vocab_parallel``  taken-token log-prob and entropy from the TP-sharded output layer, no vocabulary gather
* ``reduction``       exact token-level loss scaling under megatron's schedules and DDP; global token counts;
                      ``DPReducer`` (the loop's Reducer over the data-parallel group)
* ``step``            one training step: micro-batches of the packed layout, the schedule, the loss share, the
                      skip decision (the NeMo actor and the tests' bare-GPTModel policy both run it)
* ``layout``          the actor's packed rows <-> the core RolloutBatch; filler rows
* ``refit_gather``    expert-aware, bucketed weight gather for a rollout engine with its own TP size
* ``refit_hf``        the whole model as bounded buckets of (HF name, tensor) for an engine's weight update
* ``model``           the GPT layer spec (QK-norm); the sharded <-> full parameter map
* ``convert``         Hugging Face Llama / Qwen2 / Mixtral / Qwen2-MoE / Qwen3 / Qwen3-MoE <-> megatron-core state
                      dicts (torch only)
* ``convert_shard``   TP / PP / EP sharding and merging of converted state dicts (torch only)
* ``convert_build``   a GPTModel and TransformerConfig matching a Hugging Face config
* ``convert_ckpt``    HF safetensors <-> the NeMo checkpoint the launcher restores, shard by shard
* ``convert_command`` the ``nemo-dapo convert`` subcommand (imports torch only when run)

CI tests megatron-core 0.10.0 (the NeMo-Aligner 0.7.0 pin) on CPU over gloo; 0.16.1 passed the same tests by hand;
the CPU runs need the test-only patches in tests/support/megatron_cpu_shim.py, never imported here.
"""
