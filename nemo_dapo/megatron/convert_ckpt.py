"""Checkpoint files of a conversion, shard by shard: Hugging Face safetensors <-> the NeMo checkpoint that the
NeMo-Aligner launcher restores (``model_config.yaml`` + ``model_weights/``, a megatron-core distributed checkpoint).

No process holds the whole model. ``hf_to_nemo`` runs on the ``tp x pp x ep`` ranks of a layout (torchrun, gloo on
CPU or NCCL): each rank reads only its own HF tensors (:class:`SafetensorsReader` is lazy; ``convert_shard.
hf_to_megatron_shard`` picks them), builds its part of the megatron-core model (``convert_build``, local spec, no
weight initialisation) and writes its shards with ``dist_checkpointing.save`` (its files written in-process:
``dist_save``). A distributed checkpoint is layout-free (global tensors, cut at load time), so the conversion layout
need not be the training layout (its pipeline size must still divide the layers, as NeMo's does); at 235B bf16 (470
GB, 94 layers) a TP2 x PP2 x EP16 conversion holds ~11 GB of weights per rank (est.). ``nemo_to_hf`` is the inverse:
each rank loads its shards from the checkpoint, gathers TP slices one tensor at a time within its TP group, and
writes the HF tensors it owns into a file of its own; rank 0 writes ``model.safetensors.index.json``.

Checkpoint keys: those of NeMo 2.1's ``MegatronGPTModel.sharded_state_dict`` (``model.`` + megatron-core
``GPTModel.sharded_state_dict``), under ``state_dict`` as NeMo's restore (``NLPSaveRestoreConnector.restore_from``,
NeMo v2.1.0) asks for them. The local spec saves its norms under TE's names (megatron-core's
``sharded_state_dict_keys_map``; for MoE layers ``model.gpt_layer_spec`` keeps ``pre_mlp_layernorm`` as TE does), so
the checkpoint loads into NeMo's TE spec on GPUs as well as into the local spec on CPU, and its SequentialMLP experts
into TE's grouped-GEMM ones (``moe_grouped_gemm``): megatron-core 0.10's ``TEGroupedMLP.sharded_state_dict`` writes
the same keys and expert offsets ("interchangeable with SequentialMLP's"). Outputs are written under
``<out>.partial`` and renamed when complete.
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state as ps

from nemo_dapo.megatron.convert import hf_arch, megatron_to_hf_items, padded_vocab_size
from nemo_dapo.megatron.convert_build import gpt_model_from_hf
from nemo_dapo.megatron.convert_shard import Parallel, _global_name, hf_to_megatron_shard, tp_split_rule, tp_unshard
from nemo_dapo.megatron.dist_save import save_sharded
from nemo_dapo.megatron.extra_state import without_extra_state

HF_CONFIG_NAME = "hf_config.json"  # the source config.json, kept in the NeMo checkpoint for the way back
PREFIX = "model."  # NeMo's module prefix of the mcore GPTModel's sharded keys
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NEMO_PRECISION = {"bf16": "bf16", "fp16": 16, "fp32": 32}  # NeMo's spelling of each, in model_config.yaml


def dtype_of_precision(precision) -> str:
    """Our dtype name of a NeMo ``precision`` value (bf16, bf16-mixed, 16, 16-mixed, 32, ...)."""
    text = str(precision).replace("-mixed", "").replace("-true", "")
    name = {"bf16": "bf16", "16": "fp16", "32": "fp32"}.get(text, text)
    if name not in DTYPES:
        raise ValueError(f"precision {precision!r}: use one of bf16, 16, 32 (or {sorted(DTYPES)})")
    return name


class SafetensorsReader(Mapping):
    """{HF name: tensor} over a HF checkpoint directory, read tensor by tensor on access (nothing is loaded up
    front). Uses ``model.safetensors.index.json`` when present, else every ``*.safetensors`` file."""

    def __init__(self, directory: str):
        from safetensors import safe_open

        self._open, self._handles = safe_open, {}
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                self._where = {k: os.path.join(directory, v) for k, v in json.load(f)["weight_map"].items()}
        else:
            files = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"{directory}: no *.safetensors files (a Hugging Face checkpoint directory "
                                        "saved with safe_serialization is needed)")
            self._where = {}
            for name in files:
                path = os.path.join(directory, name)
                with safe_open(path, "pt") as f:
                    self._where.update(dict.fromkeys(f.keys(), path))

    def __getitem__(self, name: str) -> torch.Tensor:
        path = self._where[name]
        if path not in self._handles:
            self._handles[path] = self._open(path, "pt")
        return self._handles[path].get_tensor(name)

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def nemo_model_config(hf_config, parallel: Parallel, *, precision: str, padded_vocab: int,
                      tokenizer_dir: Optional[str] = None) -> dict:
    """The NeMo ``model`` keys describing ``hf_config`` (NeMo 2.1 ``MegatronGPTModel``; every TransformerConfig field
    of the same name is passed through by NeMo's ``build_transformer_config``, e.g. ``qk_layernorm`` and the
    ``moe_*`` keys). ``override_vocab_size``: the checkpoint's embedding rows (the HF vocabulary padded), which NeMo
    would otherwise derive from the tokenizer (Qwen3's tokenizer has fewer tokens than its 151,936 rows)."""
    from nemo_dapo.megatron.convert import gpt_model_kwargs_from_hf, megatron_config_from_hf

    kw, model_kw, arch = megatron_config_from_hf(hf_config), gpt_model_kwargs_from_hf(hf_config), hf_arch(hf_config)
    cfg = dict(mcore_gpt=True, num_layers=kw["num_layers"], hidden_size=kw["hidden_size"],
               ffn_hidden_size=kw["ffn_hidden_size"], num_attention_heads=kw["num_attention_heads"],
               num_query_groups=kw["num_query_groups"], kv_channels=kw["kv_channels"],
               encoder_seq_length=model_kw["max_sequence_length"],
               max_position_embeddings=model_kw["max_sequence_length"], position_embedding_type="rope",
               rotary_base=model_kw["rotary_base"], rotary_percentage=model_kw["rotary_percent"],
               normalization="rmsnorm", layernorm_epsilon=kw["layernorm_epsilon"], activation="fast-swiglu",
               bias=kw["add_bias_linear"], qkv_bias=kw["add_qkv_bias"], qk_layernorm=kw["qk_layernorm"],
               share_embeddings_and_output_weights=model_kw["share_embeddings_and_output_weights"],
               override_vocab_size=padded_vocab, make_vocab_size_divisible_by=128,
               init_method_std=kw["init_method_std"], hidden_dropout=0.0, attention_dropout=0.0, ffn_dropout=0.0,
               apply_query_key_layer_scaling=False, precision=NEMO_PRECISION[precision],
               tensor_model_parallel_size=parallel.tp, pipeline_model_parallel_size=parallel.pp,
               expert_model_parallel_size=parallel.ep)
    for key in ("seq_len_interpolation_factor",):
        if key in model_kw:
            cfg[key] = model_kw[key]
    if "rope_scaling" in model_kw:
        raise ValueError("nemo_model_config: llama3 rope scaling has no NeMo 2.1 model key; not supported here")
    if arch.num_experts:
        cfg.update(num_moe_experts=kw["num_moe_experts"], moe_router_topk=kw["moe_router_topk"],
                   moe_router_pre_softmax=kw["moe_router_pre_softmax"], moe_ffn_hidden_size=kw["moe_ffn_hidden_size"],
                   moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_grouped_gemm=False,
                   moe_token_dispatcher_type="alltoall")
    if arch.shared_expert:
        raise ValueError("nemo_model_config: a shared expert (Qwen2-MoE) cannot be built by NeMo 2.1 / megatron-core "
                         "0.10's MoE spec (its gate is hard-coded off); not supported")
    if tokenizer_dir:
        cfg["tokenizer"] = dict(library="huggingface", type=tokenizer_dir, use_fast=True)
    return cfg


def _coords() -> tuple:
    return ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank()


def _parallel() -> Parallel:
    return Parallel(tp=ps.get_tensor_model_parallel_world_size(), pp=ps.get_pipeline_model_parallel_world_size(),
                    ep=ps.get_expert_model_parallel_world_size())


def _check_world(parallel: Parallel) -> None:
    want = parallel.tp * parallel.pp * parallel.ep
    if dist.get_world_size() != want:
        raise ValueError(f"the conversion layout tp={parallel.tp} x pp={parallel.pp} x ep={parallel.ep} needs "
                         f"{want} processes, got {dist.get_world_size()}: launch with torchrun --nproc-per-node "
                         f"{want} (or several nodes)")


def _finish(partial: str, out: str) -> None:
    """All ranks done writing into ``partial``: rank 0 renames it to ``out``."""
    dist.barrier()
    if dist.get_rank() == 0:
        os.replace(partial, out)
    dist.barrier()


def _start(out: str) -> str:
    if os.path.exists(out):
        raise FileExistsError(f"{out} exists; choose a new output directory (nothing was written)")
    partial = out.rstrip("/") + ".partial"
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)  # a former interrupted run
        os.makedirs(partial)
    dist.barrier()
    return partial


def build_model(hf_config, *, padded_vocab: int, dtype: torch.dtype, parallel_output: bool = True):
    """This rank's GPTModel for ``hf_config`` (current parallel state), parameters allocated, not initialised."""
    return gpt_model_from_hf(hf_config, padded_vocab=padded_vocab, parallel_output=parallel_output,
                             use_cpu_initialization=True,
                             perform_initialization=False, params_dtype=dtype,
                             moe_token_dispatcher_type="alltoall").eval()


def sharded_for_nemo(model) -> dict:
    return {"state_dict": model.sharded_state_dict(prefix=PREFIX)}


def hf_to_nemo(hf_dir: str, out: str, *, dtype: str = "bf16", padded_vocab: Optional[int] = None,
               tokenizer_dir: Optional[str] = None) -> str:
    """Convert HF checkpoint ``hf_dir`` into the NeMo checkpoint directory ``out`` on the current layout (call after
    ``model.initialize_parallel``). Each rank reads and writes only its own shards. Returns ``out``."""
    from nemo_dapo.megatron.convert import load_hf_config

    parallel = _parallel()
    _check_world(parallel)
    if os.path.exists(out):
        raise FileExistsError(f"{out} exists; choose a new output directory (nothing was written)")
    hf_config = load_hf_config(hf_dir)
    arch = hf_arch(hf_config)
    padded_vocab = padded_vocab or padded_vocab_size(arch.vocab_size)
    model = build_model(hf_config, padded_vocab=padded_vocab, dtype=DTYPES[dtype])
    t, p, e = _coords()
    local = hf_to_megatron_shard(SafetensorsReader(hf_dir), hf_config, parallel, tp_rank=t, pp_rank=p, ep_rank=e,
                                 padded_vocab=padded_vocab)
    model.load_state_dict({k: v.to(DTYPES[dtype]) for k, v in local.items()}, strict=False)
    missing = [k for k in model.state_dict() if k not in local and not k.endswith("_extra_state")]
    if missing:
        raise KeyError(f"hf_to_nemo: the conversion gave no tensor for {missing[:4]}")
    del local
    cfg = nemo_model_config(hf_config, parallel, precision=dtype, padded_vocab=padded_vocab,
                            tokenizer_dir=tokenizer_dir or hf_dir)
    return save_nemo_checkpoint(model, out, nemo_cfg=cfg, hf_config_file=os.path.join(hf_dir, "config.json"))


def save_nemo_checkpoint(model, out: str, *, nemo_cfg: dict, hf_config_file: str) -> str:
    """Write ``model`` (every rank its shards) as NeMo checkpoint directory ``out``: ``model_weights/``,
    ``model_config.yaml`` (``nemo_cfg``) and the HF config it came from (``hf_config.json``)."""
    import yaml

    partial = _start(out)
    weights = os.path.join(partial, "model_weights")
    if dist.get_rank() == 0:
        os.makedirs(weights)  # megatron-core saves into an existing empty directory
    dist.barrier()
    save_sharded(sharded_for_nemo(model), weights)  # no forked writer processes: dist_save.py says why
    if dist.get_rank() == 0:
        with open(os.path.join(partial, "model_config.yaml"), "w") as f:
            yaml.safe_dump(nemo_cfg, f, sort_keys=False)
        shutil.copy(hf_config_file, os.path.join(partial, HF_CONFIG_NAME))
    _finish(partial, out)
    return out


def weights_dir(nemo_dir: str) -> str:
    """The distributed checkpoint inside ``nemo_dir``: its ``model_weights/`` or (a training checkpoint) itself."""
    inner = os.path.join(nemo_dir, "model_weights")
    if os.path.isdir(inner):
        return inner
    if os.path.exists(os.path.join(nemo_dir, "metadata.json")):
        return nemo_dir
    raise FileNotFoundError(f"{nemo_dir}: neither a NeMo checkpoint directory (model_weights/) nor a distributed "
                            "checkpoint (metadata.json); untar a .nemo file first (tar -xf model.nemo -C DIR)")


@torch.no_grad()
def load_nemo_weights(model, nemo_dir: str) -> None:
    """Load this rank's shards of NeMo checkpoint ``nemo_dir`` into ``model`` (strict for the weights; the
    ``_extra_state`` entries, which a training checkpoint does not hold, are not read: ``extra_state``)."""
    loaded = dist_checkpointing.load(without_extra_state(sharded_for_nemo(model)), weights_dir(nemo_dir))["state_dict"]
    model.load_state_dict({k[len(PREFIX):]: v for k, v in loaded.items()}, strict=True)


def _gather_tp(name: str, tensor: torch.Tensor, expert: bool) -> Optional[torch.Tensor]:
    """The full tensor of TP-split ``name`` on TP rank 0 of its group (None on the others); replicated as is."""
    dim, stride = tp_split_rule(name)
    if expert:
        group, size = ps.get_expert_tensor_parallel_group(), ps.get_expert_tensor_parallel_world_size()
        rank = ps.get_expert_tensor_parallel_rank()
    else:
        group, size = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
        rank = ps.get_tensor_model_parallel_rank()
    if dim is None or size == 1:
        return tensor if rank == 0 else None
    pieces = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    return tp_unshard(pieces, dim, stride) if rank == 0 else None


def export_rank_hf(model, hf_config, partial: str) -> list:
    """Write the HF tensors this rank owns (its layers and experts; replicated tensors from one rank only) to
    ``partial/model-rank{r}.safetensors``; every rank of a TP group must call it. Returns the names written."""
    from safetensors.torch import save_file

    parallel, (_, p, e) = _parallel(), _coords()
    arch = hf_arch(hf_config)
    per_stage, per_ep = arch.num_layers // parallel.pp, max(arch.num_experts // parallel.ep, 1)
    out = {}
    for local, tensor in model.state_dict().items():
        if local.endswith("_extra_state"):
            continue
        name, expert = _global_name(local, p, per_stage, e, per_ep)
        full = _gather_tp(name, tensor, expert)
        if full is None or (not expert and e != 0):
            continue
        for hf_name, hf_tensor in megatron_to_hf_items([(name, full)], hf_config):
            out[hf_name] = hf_tensor.contiguous().clone()
    file = f"model-rank{dist.get_rank():05d}.safetensors"
    if out:
        save_file(out, os.path.join(partial, file), metadata={"format": "pt"})
    return [(n, file) for n in out]


def nemo_to_hf(nemo_dir: str, out: str, *, hf_config_dir: Optional[str] = None, dtype: Optional[str] = None,
               padded_vocab: Optional[int] = None) -> str:
    """Convert NeMo checkpoint ``nemo_dir`` to a HF checkpoint directory ``out`` on the current layout. The HF
    config is the one kept at conversion (``hf_config.json``) or ``hf_config_dir``'s ``config.json``."""
    from nemo_dapo.megatron.convert import load_hf_config

    parallel = _parallel()
    _check_world(parallel)
    config_file = os.path.join(hf_config_dir, "config.json") if hf_config_dir else os.path.join(nemo_dir,
                                                                                                HF_CONFIG_NAME)
    if not os.path.exists(config_file):
        raise FileNotFoundError(f"{config_file}: no HF config; pass --hf-config DIR (the HF checkpoint the model "
                                "came from)")
    hf_config = load_hf_config(config_file)
    arch = hf_arch(hf_config)
    saved = _checkpoint_keys(nemo_dir)
    padded_vocab = padded_vocab or saved.get("override_vocab_size") or padded_vocab_size(arch.vocab_size)
    dtype = dtype_of_precision(dtype or saved.get("precision", 32))
    partial = _start(out)
    model = build_model(hf_config, padded_vocab=padded_vocab, dtype=DTYPES[dtype])
    load_nemo_weights(model, nemo_dir)
    names = export_rank_hf(model, hf_config, partial)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, names)
    if dist.get_rank() == 0:
        weight_map = dict(pair for part in every for pair in part)
        with open(os.path.join(partial, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=1)
        shutil.copy(config_file, os.path.join(partial, "config.json"))
    _finish(partial, out)
    return out


def _checkpoint_keys(nemo_dir: str) -> dict:
    """The checkpoint's model_config.yaml ({} if it has none: a training checkpoint directory)."""
    path = os.path.join(nemo_dir, "model_config.yaml")
    if not os.path.exists(path):
        return {}
    import yaml

    with open(path) as f:
        return yaml.safe_load(f) or {}
