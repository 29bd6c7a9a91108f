"""QK-norm (Qwen3) in torch for the Transformer Engine layer spec when TE is older than 1.9.0.

megatron-core 0.10's TE spec takes apex's ``FusedLayerNorm`` for the query / key norms below TE 1.9.0 ("TENorm
significantly harms convergence" there, ``gpt_layer_specs.py``), and ``FusedLayerNorm`` asserts
``normalization == "LayerNorm"``, so a Qwen3 model (RMSNorm) fails to build on NeMo-Aligner 0.7.0's own image
(TE 1.8.0.dev0). :func:`with_torch_qk_norm` puts :class:`QKNorm` there instead: the same parameter names and
checkpoint keys (``self_attention.q_layernorm.weight``), the math of megatron-core's ``WrappedTorchNorm`` (what the
CPU tests build), and, unlike that class, allowed under sequence parallelism (a per-head norm does not care how the
sequence is split).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F


class QKNorm(torch.nn.Module):
    """A norm over the last dim of ``[..., hidden_size]`` (queries / keys: ``[s, b, heads, head_dim]``), RMSNorm or
    LayerNorm as ``config.normalization`` says, computed in fp32 and returned in the input's dtype.

    Built by megatron-core's ``build_module(spec, config=, hidden_size=, eps=)``. Its weights are marked
    ``sequence_parallel`` like megatron-core's and TE's norms, so NeMo sums their gradients over TP under sequence
    parallelism and the actor does without (``aligner/actor.py``, ``finish_training_step``)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        if config.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(f"QKNorm: normalization {config.normalization!r} is not RMSNorm or LayerNorm")
        if getattr(config, "layernorm_zero_centered_gamma", False):
            raise ValueError("QKNorm: layernorm_zero_centered_gamma=True is not supported")
        self.rms = config.normalization == "RMSNorm"
        self.eps = eps
        dtype = config.params_dtype
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.bias = None if self.rms else torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        for p in self.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.rms:
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        else:
            y = F.layer_norm(xf, xf.shape[-1:], self.weight.float(), self.bias.float(), self.eps)
        return y.to(x.dtype)


def with_torch_qk_norm(layer_spec):
    """``layer_spec`` (a ``ModuleSpec`` of a ``TransformerLayer``) with :class:`QKNorm` as its query / key norms,
    where it has any (not ``IdentityOp``); every other submodule unchanged. Returns a new spec."""
    from megatron.core.transformer.identity_op import IdentityOp

    attn = layer_spec.submodules.self_attention
    sub = attn.submodules
    names = [n for n in ("q_layernorm", "k_layernorm") if getattr(sub, n, IdentityOp) is not IdentityOp]
    if not names:
        return layer_spec
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(sub, **{n: QKNorm for n in names}))
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer_spec.submodules, self_attention=attn))
