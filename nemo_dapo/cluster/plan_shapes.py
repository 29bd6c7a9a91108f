"""The shapes `nemo-dapo plan` reasons about: GPUs (vendor figures), model architectures (with presets from each
model's Hugging Face config.json) and training layouts. Plain frozen dataclasses with their closed-form parameter
and KV sizes; every other plan module imports them from here (one place, no import circle). Imports nothing of
NeMo, Megatron or torch.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gb: float  # usable HBM as the vendor lists it
    hbm_tb_s: float
    bf16_tflops: float  # dense (the vendor's "with sparsity" figure halved)
    source: str = ""


# Vendor figures. H100: NVIDIA H100 datasheet (SXM: 80 GB, 3.35 TB/s, BF16 1,979 TFLOPS with sparsity). H20: no
# NVIDIA datasheet is public; 96 GB HBM3, 4.0 TB/s, 148 TFLOPS FP16/BF16 dense from third-party spec pages
# (SCALE.md section 3.1). H200: NVIDIA H200 datasheet (SXM: 141 GB HBM3e, 4.8 TB/s, BF16 1,979 TFLOPS with
# sparsity). B200: NVIDIA HGX B200 datasheet (8 GPUs: 1.44 TB HBM3e, 64 TB/s, FP16/BF16 36 PFLOPS with sparsity,
# i.e. per GPU 180 GB, 8 TB/s, 2,250 dense). GB200: NVIDIA GB200 NVL72 datasheet (72 GPUs: 13.4 TB HBM3e,
# 576 TB/s, FP16/BF16 360 PFLOPS with sparsity, i.e. per GPU 186 GB, 8 TB/s, 2,500 dense; 4 GPUs per tray).
GPUS = {
    "h100": Gpu("H100 SXM 80GB", 80.0, 3.35, 989.0, "NVIDIA H100 datasheet"),
    "h20": Gpu("H20 96GB", 96.0, 4.0, 148.0, "third-party spec pages (no public NVIDIA datasheet)"),
    "h200": Gpu("H200 SXM 141GB", 141.0, 4.8, 989.0, "NVIDIA H200 datasheet"),
    "b200": Gpu("B200 (HGX) 180GB", 180.0, 8.0, 2250.0, "NVIDIA HGX B200 datasheet"),
    "gb200": Gpu("GB200 NVL72 GPU 186GB", 186.0, 8.0, 2500.0, "NVIDIA GB200 NVL72 datasheet"),
}


@dataclass(frozen=True)
class Arch:
    """Model shape. SwiGLU MLPs (3 matrices); in an MoE model every layer is sparse (a router, ``num_moe_experts``
    experts of width ``moe_ffn_hidden_size``, top-k routed) plus an optional always-active shared expert of width
    ``moe_shared_expert_size`` (0: none, as Mixtral and Qwen3-MoE). ``kv_channels`` is the head dimension, which
    need not be hidden / heads (Qwen3: 128)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int
    tied_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    num_moe_experts: Optional[int] = None
    moe_ffn_hidden_size: Optional[int] = None
    moe_router_topk: Optional[int] = None
    moe_shared_expert_size: int = 0
    name: str = ""

    @property
    def is_moe(self) -> bool:
        return bool(self.num_moe_experts)

    @property
    def head_dim(self) -> int:
        return self.kv_channels

    def attention_params(self) -> int:
        h, d = self.hidden_size, self.kv_channels
        q_and_o = 2 * h * self.num_attention_heads * d
        kv = 2 * h * self.num_query_groups * d
        bias = (self.num_attention_heads + 2 * self.num_query_groups) * d if self.qkv_bias else 0
        return q_and_o + kv + bias + (2 * d if self.qk_norm else 0)

    def dense_layer_params(self) -> int:
        """Params of one layer that are not routed experts: attention, norms, and the MLP or router + shared expert."""
        h = self.hidden_size
        mlp = (h * self.num_moe_experts + 3 * h * self.moe_shared_expert_size) if self.is_moe \
            else 3 * h * self.ffn_hidden_size
        return self.attention_params() + 2 * h + mlp

    def expert_params(self) -> int:
        """Params of one routed expert (SwiGLU)."""
        return 3 * self.hidden_size * self.moe_ffn_hidden_size if self.is_moe else 0

    def expert_layer_params(self) -> int:
        return self.num_moe_experts * self.expert_params() if self.is_moe else 0

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def num_embedding_matrices(self) -> int:
        return 1 if self.tied_embeddings else 2

    def total_params(self) -> int:
        per_layer = self.dense_layer_params() + self.expert_layer_params()
        return self.num_layers * per_layer + self.num_embedding_matrices() * self.embedding_params() + self.hidden_size

    def active_params(self) -> int:
        """Params touched per token (all non-expert params + top-k experts per layer)."""
        if not self.is_moe:
            return self.total_params()
        inactive = self.num_layers * (self.num_moe_experts - self.moe_router_topk) * self.expert_params()
        return self.total_params() - inactive

    def kv_bytes_per_token(self, layers: Optional[int] = None, kv_heads: Optional[int] = None) -> int:
        """bf16 K and V of one token over ``layers`` layers with ``kv_heads`` heads (defaults: the whole model)."""
        layers = self.num_layers if layers is None else layers
        kv_heads = self.num_query_groups if kv_heads is None else kv_heads
        return 2 * layers * kv_heads * self.kv_channels * 2

    def attention_flops_per_token(self, seq_len: float) -> float:
        """Forward FLOPs of causal attention scores and values for one token, averaged over a ``seq_len`` sequence."""
        return 4.0 * self.num_layers * self.num_attention_heads * self.kv_channels * seq_len / 2


ARCH_KEYS = tuple(f.name for f in fields(Arch) if f.name != "name")
_QWEN3 = dict(vocab_size=151936, kv_channels=128, qk_norm=True)
# Presets from each model's Hugging Face config.json (``plan.arch.preset``); a recipe's own plan.arch values must
# agree with the preset they name.
ARCH_PRESETS = {
    "qwen2.5-32b": Arch(64, 5120, 27648, 40, 8, 128, 152064, qkv_bias=True, name="Qwen2.5-32B"),
    "qwen2.5-math-7b": Arch(28, 3584, 18944, 28, 4, 128, 152064, qkv_bias=True, name="Qwen2.5-Math-7B"),
    "llama3.1-8b": Arch(32, 4096, 14336, 32, 8, 128, 128256, name="Llama-3.1-8B"),
    "qwen3-32b": Arch(64, 5120, 25600, 64, 8, name="Qwen3-32B", **_QWEN3),
    "qwen3-30b-a3b": Arch(48, 2048, 6144, 32, 4, num_moe_experts=128, moe_ffn_hidden_size=768, moe_router_topk=8,
                          name="Qwen3-30B-A3B", **_QWEN3),
    "qwen3-235b-a22b": Arch(94, 4096, 12288, 64, 4, num_moe_experts=128, moe_ffn_hidden_size=1536,
                            moe_router_topk=8, name="Qwen3-235B-A22B", **_QWEN3),
    "mixtral-8x22b": Arch(56, 6144, 16384, 48, 8, 128, 32768, num_moe_experts=8, moe_ffn_hidden_size=16384,
                          moe_router_topk=2, name="Mixtral-8x22B"),
}


@dataclass(frozen=True)
class Layout:
    """Training layout. ``etp``: expert tensor parallelism (None = TP, the only value NeMo 2.1 can set)."""

    world: int
    tp: int
    pp: int
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    etp: Optional[int] = None

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Expert data-parallel size, Megatron: world / (ETP x EP x PP)."""
        return self.world // (self.expert_tp * self.ep * self.pp)
