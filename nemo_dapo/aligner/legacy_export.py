"""Fixes around NeMo 2.1's TensorRT-LLM exporter (``nemo/export/tensorrt_llm.py``) for NeMo-Aligner's legacy engine.

Each piece hooks where the exporter reads its input, so that ``GPTGenerateTRTLLM`` itself runs unchanged:
* :class:`TPPaddedVocab`: the vocabulary size it sees is rounded up to the TP size (``divide(vocab, tp)``);
  :func:`banned_ids_list` keeps the engine from sampling the padding ids.
* :func:`attention_bias_overrides` + :func:`engine_config_overrides`: the engine config keeps the model's
  attention bias (``attn_bias``); :func:`with_zero_dense_bias` gives the engine the output-projection bias it then
  has and Qwen2 does not.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from nemo_dapo.cluster.config_load import nemo_model_key


class TPPaddedVocab:
    """The tokenizer as NeMo's exporter sees it: ``vocab_size`` V rounded up to a multiple of the engine's TP.

    NeMo 2.1's ``TensorRTLLM.build`` / ``refit`` hand ``self.tokenizer.vocab_size`` to megatron-core's on-device
    converter, which cuts the (Megatron-padded, TP-divisible) embedding and output layer to that many rows and splits
    them with ``divide(vocab, tp)``: Qwen2.5's V = 151,665 = ``len(tokenizer)`` asserts at TP 2 and 8. Every other
    attribute is the real tokenizer's; the wrapper is not a ``TokenizerSpec``, so NeMo's ``build_tokenizer`` returns
    it unchanged."""

    def __init__(self, tokenizer, tp: int):
        self._tokenizer = tokenizer
        v = int(tokenizer.vocab_size)
        self.vocab_size = -(-v // tp) * tp

    def __getattr__(self, name):
        if name == "_tokenizer":  # not set yet (copy / unpickle): no recursion
            raise AttributeError(name)
        return getattr(self._tokenizer, name)


def banned_ids_list(first: int, end: int, batch: int):
    """TensorRT-LLM's word-list layout [batch, 2, n] (int32 ids row, cumulative-offsets row) banning each single
    token id in [first, end), or None when the range is empty."""
    import numpy as np

    n = end - first
    if n <= 0:
        return None
    one = np.stack([np.arange(first, end), np.arange(1, n + 1)]).astype(np.int32)
    return np.repeat(one[None], batch, axis=0)


def with_zero_dense_bias(gather, hidden_size: int):
    """The exporter's weight gather plus a zero ``linear_proj.bias`` per layer that has a ``linear_qkv.bias``.

    A llama-type TensorRT-LLM engine with ``attn_bias`` has a bias on the attention output projection too (its
    ``Attention(dense_bias=None)`` reuses ``bias``); Qwen2 has none, so the engine gets zeros there."""

    def gathered(model_config, model, storage_dtype) -> dict:
        state = gather(model_config, model, storage_dtype)
        for key, qkv_bias in list(state.items()):
            if key.endswith("self_attention.linear_qkv.bias"):
                dense = key[: -len("linear_qkv.bias")] + "linear_proj.bias"
                if dense not in state:
                    state[dense] = torch.zeros(hidden_size, dtype=qkv_bias.dtype, device=qkv_bias.device)
        return state

    return gathered


@contextmanager
def engine_config_overrides(overrides: dict):
    """While NeMo's exporter builds the engine, set ``overrides`` (e.g. ``attn_bias``) on the TensorRT-LLM model
    config(s) that megatron-core's ``TRTLLMHelper.get_trtllm_pretrained_config_and_model_weights`` returns.

    NeMo 2.1's ``build`` imports ``TRTLLMHelper`` from its module at call time, so a subclass swapped in for the
    duration of the build is the one it uses; the helper's own config dict has no such key (it maps only
    ``add_bias_linear`` to ``bias``, which ``LLaMAConfig`` ignores)."""
    if not overrides:
        yield
        return
    import importlib

    module = importlib.import_module("megatron.core.export.trtllm.trtllm_helper")  # what NeMo's build imports
    base = module.TRTLLMHelper

    class Helper(base):
        def get_trtllm_pretrained_config_and_model_weights(self, *args, **kwargs):
            weights, configs = super().get_trtllm_pretrained_config_and_model_weights(*args, **kwargs)
            for c in configs:
                for k, v in overrides.items():
                    setattr(c, k, v)
            return weights, configs

    module.TRTLLMHelper = Helper
    try:
        yield
    finally:
        module.TRTLLMHelper = base


def attention_bias_overrides(cfg, model_type: str) -> dict:
    """Engine-config overrides so that the engine keeps the model's attention biases (``model.qkv_bias``: Qwen2's
    QKV bias; ``model.bias``: every linear layer's; absent, NeMo's defaults: no QKV bias, linear biases)."""
    qkv, linear = bool(nemo_model_key(cfg, "qkv_bias")), bool(nemo_model_key(cfg, "bias"))
    if not (qkv or linear):
        return {}
    if model_type != "llama":
        raise ValueError(f"model.qkv_bias/model.bias with model.dapo.trt_llm.model_type={model_type!r}: only the "
                         "llama engine type is wired to keep attention biases; set model.dapo.trt_llm.model_type: "
                         "llama")
    return {"attn_bias": True, **({"mlp_bias": True} if linear else {})}
