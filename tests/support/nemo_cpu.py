"""Test-only: run NeMo 2.1 / NeMo-Aligner 0.7.0 models on a CPU torch build (gloo), never imported by the product.

Import this module FIRST in a NeMo test process (before nemo, nemo_aligner or megatron): it loads the megatron-core
CUDA shim and the TensorRT-LLM import stub, then patches the places where NeMo 2.1 assumes apex or Transformer
Engine. Each patch was found by a failure on CPU:

1. ``NLPDDPStrategy.__init__`` refuses to start without apex ("Apex was not found"): ``HAVE_APEX = True`` (apex is
   only used by the distributed fused Adam, which CPU tests do not select).
2. ``_enable_nvidia_optimizations`` runs ``re.fullmatch`` on ``$NVIDIA_PYTORCH_VERSION`` (None off-container).
3. ``NLPModel.__init__`` -> ``get_megatron_pretrained_bert_models`` imports bert_spec.py, which builds TE specs at
   import time (``NameError: ApexGuardDefaults``): return no pretrained BERT models.
4. ``megatron_gpt_model.get_specs`` eagerly builds every layer spec, TE ones included: use megatron-core's local spec.
5. ``build_model.set_defaults_if_not_set_tensor_model_parallel_attributes`` comes from apex: use megatron-core's.
6. ``listify_model`` and the apex norm classes used by ``get_params_for_weight_decay_optimization``: plain stand-ins.
7. ``ModelPT.cuda`` builds ``torch.device("cuda", ...)``: no-op.
8. ``generate`` needs a few activation-checkpoint / sequence-parallel keys in the model config (``tiny_gpt_cfg``).
9. ``clip_grad_norm_fp32`` (NeMo-Aligner's ``clip_gradients``) computes the L2 norm with apex's
   ``multi_tensor_applier(amp_C.multi_tensor_l2norm, ...)``: a torch equivalent.
10. ``NLPDDPStrategy.optimizer_sharded_state_dict`` (checkpoint save) runs ``isinstance`` checks against optimizer
    classes it imports together with apex: bind NeMo's real ``McoreDistributedOptimizer`` (it needs no apex, so
    megatron-core's distributed optimizer checkpoints as on GPU) and a stand-in for apex's distributed Adam (a class
    no optimizer here is an instance of).
11. megatron-core 0.10's async checkpoint writer calls torch's private ``_write_item`` with the pre-2.6 signature;
    torch 2.13 added ``transforms`` and ``serialization_format``: adapt the call (the container's torch is older).
12. megatron-core 0.10 loads a checkpoint's common state (PTL hyper-parameters: OmegaConf objects) with a plain
    ``torch.load``, which torch >= 2.6 runs with ``weights_only=True``: ``allow_full_checkpoint_loads()`` restores
    the container torch's default (process-wide, so only checkpoint-loading workers call it).
13. Dist-checkpointing a non-distributed optimizer works in NeMo 2.1 only for states that ``init_optimizer_states``
    pre-creates (apex FusedAdam's, on GPUs); torch AdamW's 0-dim per-parameter ``step`` breaks the sharding. CPU
    tests train with SGD + momentum, whose zero momentum buffer is pre-created here (same update as a lazily
    created one), so that a fresh optimizer has the state layout the checkpoint is loaded into.
"""
from __future__ import annotations

import builtins
import os
import tempfile

os.environ.setdefault("NVIDIA_PYTORCH_VERSION", "24.07")  # patch 2
os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests.support import megatron_cpu_shim  # noqa: E402,F401  (before megatron)
from tests.support import trtllm_stub  # noqa: E402,F401  (before nemo_aligner / nemo.export)

import torch  # noqa: E402

torch.set_num_threads(1)


def _patch_nemo() -> None:
    from nemo.collections.nlp.modules.common.megatron.utils import ApexGuardDefaults

    builtins.ApexGuardDefaults = ApexGuardDefaults  # bert_spec.py uses it un-imported when TE is missing
    import nemo.collections.nlp.models.nlp_model as nlp_model

    nlp_model.get_megatron_pretrained_bert_models = lambda: []  # patch 3

    import nemo.collections.nlp.models.language_modeling.megatron_gpt_model as mgm
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    def get_specs(spec_name, transformer_config=None, use_te=True, hyena_cfg=None, fp8=False):  # patch 4
        if use_te or spec_name != "":
            raise RuntimeError(f"CPU tests support only the local layer spec, got {spec_name=} {use_te=}")
        return get_gpt_layer_local_spec(transformer_config.num_moe_experts, transformer_config.moe_grouped_gemm)

    mgm.get_specs = get_specs

    import nemo.collections.nlp.modules.common.megatron.build_model as build_model
    from megatron.core.tensor_parallel.layers import set_defaults_if_not_set_tensor_model_parallel_attributes

    build_model.set_defaults_if_not_set_tensor_model_parallel_attributes = (  # patch 5
        set_defaults_if_not_set_tensor_model_parallel_attributes)

    import nemo.collections.nlp.modules.common.megatron.utils as nmu

    if not hasattr(nmu, "listify_model"):  # patch 6
        nmu.listify_model = lambda m: m if isinstance(m, list) else [m]
        nmu.FusedLayerNorm = nmu.FastLayerNorm = torch.nn.LayerNorm
        nmu.MixedFusedRMSNorm = torch.nn.RMSNorm

    from nemo.core.classes.modelPT import ModelPT

    ModelPT.cuda = lambda self, device=None: self  # patch 7

    import nemo.collections.nlp.parts.nlp_overrides as nlp_overrides

    nlp_overrides.HAVE_APEX = True  # patch 1
    if not hasattr(nlp_overrides, "McoreDistributedOptimizer"):  # patch 10
        from nemo.core.optim.mcore_optim import McoreDistributedOptimizer

        nlp_overrides.McoreDistributedOptimizer = McoreDistributedOptimizer
    if not hasattr(nlp_overrides, "MegatronDistributedFusedAdam"):
        nlp_overrides.MegatronDistributedFusedAdam = type("MegatronDistributedFusedAdam", (), {})

    import nemo.collections.nlp.modules.common.megatron.clip_grads as clip_grads

    if not hasattr(clip_grads, "multi_tensor_applier"):  # patch 9
        class _AmpC:
            @staticmethod
            def multi_tensor_l2norm(overflow_buf, tensor_lists, per_tensor):
                norms = torch.stack([torch.linalg.vector_norm(t.float()) for t in tensor_lists[0]])
                return torch.linalg.vector_norm(norms), None

        clip_grads.amp_C = _AmpC
        clip_grads.multi_tensor_applier = lambda op, noop_flag, tensor_lists, *args: op(noop_flag, tensor_lists,
                                                                                          *args)
    megatron_cpu_shim.adapt_checkpoint_writer()  # patch 11

    import nemo.core.optim.optimizers as nemo_optimizers

    if not getattr(nlp_overrides.init_optimizer_states, "_cpu_patched", False):  # patch 13
        _orig_init = nemo_optimizers.init_optimizer_states

        def init_optimizer_states(optimizer):
            _orig_init(optimizer)
            if isinstance(optimizer, torch.optim.SGD):
                for group in optimizer.param_groups:
                    if group.get("momentum", 0) > 0:
                        for p in group["params"]:
                            optimizer.state[p].setdefault("momentum_buffer", torch.zeros_like(p.data))

        init_optimizer_states._cpu_patched = True
        nlp_overrides.init_optimizer_states = init_optimizer_states


_patch_nemo()


def tiny_tokenizer_dir(directory: str | None = None) -> str:
    """A byte-level BPE tokenizer (HF format, ~300 tokens) saved to ``directory`` (a temp dir by default).

    NeMo's generate needs a HuggingFace-style tokenizer (NeMo's own byte-level tokenizer lacks ``.tokenizer``).
    """
    from nemo_dapo.data.tokenizer import save_tokenizer, train_tokenizer

    directory = directory or tempfile.mkdtemp(prefix="nemo_dapo_tok_")
    if not os.path.exists(os.path.join(directory, "tokenizer.json")):
        texts = [f"Question: what is {a} + {b}? Answer: {a + b}\n" for a in range(30) for b in range(0, 30, 7)]
        save_tokenizer(train_tokenizer(texts, vocab_size=300), directory)
    return directory


def tiny_gpt_cfg(tokenizer_dir: str, *, tp: int = 1, pp: int = 1, mbs: int = 2, gbs: int = 4, seq_len: int = 64,
                 num_layers: int = 2, hidden: int = 32, seed: int = 1234, **extra):
    """An OmegaConf model config for a ~0.1M-parameter mcore GPT that NeMo builds on CPU (fp32, no TE/apex)."""
    from omegaconf import OmegaConf

    cfg = {
        "precision": 32, "micro_batch_size": mbs, "global_batch_size": gbs,
        "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
        "encoder_seq_length": seq_len, "max_position_embeddings": seq_len, "num_layers": num_layers,
        "hidden_size": hidden, "ffn_hidden_size": 2 * hidden, "num_attention_heads": 4, "init_method_std": 0.02,
        "hidden_dropout": 0.0, "attention_dropout": 0.0, "ffn_dropout": 0.0, "kv_channels": None,
        "apply_query_key_layer_scaling": False, "layernorm_epsilon": 1e-5, "make_vocab_size_divisible_by": 32,
        "pre_process": True, "post_process": True, "persist_layer_norm": False, "gradient_as_bucket_view": False,
        "bias": False, "normalization": "rmsnorm", "activation": "fast-swiglu", "position_embedding_type": "rope",
        "share_embeddings_and_output_weights": False,
        "tokenizer": {"library": "huggingface", "type": tokenizer_dir, "use_fast": True},
        "native_amp_init_scale": 4294967296, "native_amp_growth_interval": 1000, "hysteresis": 2,
        "fp32_residual_connection": False, "fp16_lm_cross_entropy": False, "megatron_amp_O2": False, "seed": seed,
        "use_cpu_initialization": True, "onnx_safe": False, "apex_transformer_log_level": 30,
        # patch 8: keys NeMo's generate reads
        "activations_checkpoint_method": None, "activations_checkpoint_num_layers": None,
        "activations_checkpoint_granularity": None, "activations_checkpoint_layers_per_pipeline": None,
        "sequence_parallel": False,
        "mcore_gpt": True, "transformer_engine": False, "bias_activation_fusion": False,
        "bias_dropout_add_fusion": False, "masked_softmax_fusion": False, "gradient_accumulation_fusion": False,
        "apply_rope_fusion": False, "cross_entropy_loss_fusion": False,
        "data": {"data_prefix": None, "index_mapping_dir": None, "data_impl": "mmap", "splits_string": "900,50,50",
                 "seq_length": seq_len, "skip_warmup": True, "num_workers": 0, "dataloader_type": "single",
                 "reset_position_ids": False, "reset_attention_mask": False, "eod_mask_loss": False},
        "optim": {"name": "adamw", "lr": 1e-3, "weight_decay": 0.0, "betas": [0.9, 0.98]},
    }
    if "optim" in extra:  # replaced, not merged (an SGD config must not inherit Adam's betas)
        cfg["optim"] = extra.pop("optim")
    out = OmegaConf.create(cfg)
    OmegaConf.set_struct(out, False)
    return OmegaConf.merge(out, OmegaConf.create(extra))


def cpu_trainer(**kwargs):
    """A Lightning Trainer with NeMo's DDP strategy over gloo on CPU (what NeMo-Aligner scripts build on GPU)."""
    from lightning.pytorch import Trainer
    from nemo.collections.nlp.parts.nlp_overrides import NLPDDPStrategy

    world = int(os.environ.get("WORLD_SIZE", "1"))
    defaults = dict(strategy=NLPDDPStrategy(process_group_backend="gloo", find_unused_parameters=False),
                    accelerator="cpu", devices=world, num_nodes=1, precision=32, logger=False,
                    enable_checkpointing=False, use_distributed_sampler=False, max_steps=-1)
    defaults.update(kwargs)
    return Trainer(**defaults)


def init_parallel(tp: int = 1, pp: int = 1, seed: int = 1234) -> None:
    """torch.distributed (gloo) from the torchrun env (or a 1-process group) + megatron model parallel groups."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        from tests.support.dist import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp, pp)
    model_parallel_cuda_manual_seed(seed)


def allow_full_checkpoint_loads() -> None:
    """Patch 12: plain ``torch.load`` unpickles objects again, as with the container's torch (< 2.6)."""
    os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"


def quiet_nemo() -> None:
    """NeMo logs hundreds of config warnings per model build; keep test output readable."""
    import logging

    from nemo.utils import logging as nemo_logging

    nemo_logging.setLevel(logging.ERROR)



# model.dapo.algorithm of conf/gpt_dapo_actor.yaml at test sizes (G = 4, a short generation cap)
ALGORITHM_DEFAULTS = {
    "group_size": 4, "eps_low": 0.2, "eps_high": 0.28, "clip_c": 10.0, "agg": "token-mean", "overlong_filter": False,
    "tis_cap": None, "tis_level": "token", "reject_logp_diff": None, "adv_eps": 1e-6, "scale_by_std": True,
    "dynamic_sampling": {"enabled": True, "max_gen_batches": 8, "on_budget_exhausted": "train_partial", "max_age": 1,
                         "adaptive": False, "gen_batch_size": 3, "max_gen_batch_size": None, "prior_pass_rate": 0.5,
                         "prior_weight": 8.0, "pass_rate_memory": 0.7, "safety": 1.1,
                         "skip_history": {"enabled": False, "skip_prob": 0.5, "max_skips": 3}},
    "overlong": {"enabled": True, "l_max": None, "l_cache": 2, "penalty_factor": 1.0}}

DAPO_DEFAULTS = {"algorithm": ALGORITHM_DEFAULTS, "forward_micro_batch_size": 2, "logprob_chunk_size": 7,
                 "offload_adam_states": False, "offload_training_state": False,
                 "sampling_params": {"use_greedy": False, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
                                     "repetition_penalty": 1.0, "end_strings": []},
                 "length_params": {"max_length": 8}}


def build_actor(tp: int = 1, pp: int = 1, *, mbs: int = 2, gbs: int = 4, tokenizer_dir: str | None = None,
                dapo: dict | None = None, trainer=None, **model_kw):
    """(ptl_trainer, actor): parallel groups initialised and a tiny MegatronGPTDAPOActorModel built on CPU."""
    init_parallel(tp, pp)
    quiet_nemo()
    from nemo_dapo.aligner.actor import MegatronGPTDAPOActorModel

    dapo_cfg = dict(DAPO_DEFAULTS, **(dapo or {}))
    cfg = tiny_gpt_cfg(tokenizer_dir or tiny_tokenizer_dir(), tp=tp, pp=pp, mbs=mbs, gbs=gbs, dapo=dapo_cfg,
                       **model_kw)
    trainer = trainer or cpu_trainer()
    return trainer, MegatronGPTDAPOActorModel(cfg=cfg, trainer=trainer)
