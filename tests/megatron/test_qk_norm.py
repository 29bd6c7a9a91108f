"""nemo_dapo.megatron.qk_norm: the torch QK-norm that replaces apex's FusedLayerNorm in megatron-core 0.10's TE spec
below TE 1.9 (NeMo-Aligner 0.7.0's image has TE 1.8.0.dev0, and FusedLayerNorm refuses Qwen3's RMSNorm). Checked
against megatron-core's own torch norm (what the CPU Qwen3 tests build, and what matches transformers there) inside a
real GPTModel; the TE spec itself cannot be built without TE, so gpt_layer_spec's choice is checked on the spec
megatron-core 0.10 returns below TE 1.9 (FusedLayerNorm as QK-norm: gpt_layer_specs.py, ``qk_norm``)."""
import dataclasses

import pytest
import torch

from tests.support import megatron_cpu_shim  # noqa: F401  (before megatron)
from megatron.core.fusions.fused_layer_norm import FusedLayerNorm  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.transformer.identity_op import IdentityOp  # noqa: E402
from megatron.core.transformer.torch_norm import WrappedTorchNorm  # noqa: E402

from nemo_dapo.megatron import model as model_mod  # noqa: E402
from nemo_dapo.megatron.qk_norm import QKNorm, with_torch_qk_norm  # noqa: E402
from nemo_dapo.megatron.te_check import qk_norm_is_apex  # noqa: E402
from tests.support.megatron_model import GPTSpec, destroy_parallel, initialize_parallel, transformer_config  # noqa


def _config(normalization="RMSNorm", sp=False, dtype=torch.float32):
    return type("Cfg", (), dict(normalization=normalization, layernorm_zero_centered_gamma=False,
                                params_dtype=dtype, sequence_parallel=sp))()


def _attn(layer):
    return layer.submodules.self_attention.submodules


def test_qk_norm_is_rmsnorm_or_layernorm_in_fp32():
    torch.manual_seed(0)
    x = torch.randn(5, 2, 4, 16)
    rms = QKNorm(_config(), 16, eps=1e-6)
    rms.weight.data.uniform_(0.5, 1.5)
    ref = torch.nn.RMSNorm(16, eps=1e-6)
    ref.weight.data.copy_(rms.weight.data)
    assert torch.allclose(rms(x), ref(x), atol=1e-6)
    ln = QKNorm(_config("LayerNorm"), 16, eps=1e-5)
    ln.bias.data.fill_(0.3)
    assert torch.allclose(ln(x), torch.nn.functional.layer_norm(x, (16,), ln.weight, ln.bias, 1e-5), atol=1e-6)
    xb = x.bfloat16()  # bf16 in, bf16 out, the statistics in fp32
    out = QKNorm(_config(dtype=torch.bfloat16), 16, eps=1e-6)(xb)
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), torch.nn.RMSNorm(16, eps=1e-6)(xb.float()), atol=1e-2)
    assert [p.sequence_parallel for p in QKNorm(_config(sp=True), 16).parameters()] == [True]
    assert QKNorm(_config(), 16).bias is None
    with pytest.raises(ValueError, match="normalization"):
        QKNorm(_config("Foo"), 16)


def test_qk_norm_eps_keeps_small_and_zero_heads_finite():
    """eps sits inside the root, as in torch's RMSNorm and HF's Qwen3RMSNorm: it decides the output for heads whose
    mean square is near or below it (a zero head must give 0, not NaN)."""
    norm = QKNorm(_config(), 16, eps=1e-6)
    x = 1e-4 * torch.randn(3, 16, generator=torch.Generator().manual_seed(1))  # mean square ~1e-8 << eps
    assert torch.allclose(norm(x), torch.nn.RMSNorm(16, eps=1e-6)(x), rtol=1e-5, atol=0)
    assert torch.equal(norm(torch.zeros(2, 16)), torch.zeros(2, 16))


def test_only_query_and_key_norms_are_replaced():
    layer = model_mod.gpt_layer_spec(qk_layernorm=True)
    below = dataclasses.replace(_attn(layer), q_layernorm=FusedLayerNorm, k_layernorm=FusedLayerNorm)
    layer = dataclasses.replace(layer, submodules=dataclasses.replace(
        layer.submodules, self_attention=dataclasses.replace(layer.submodules.self_attention, submodules=below)))
    out = with_torch_qk_norm(layer)
    assert _attn(out).q_layernorm is QKNorm and _attn(out).k_layernorm is QKNorm
    assert _attn(layer).q_layernorm is FusedLayerNorm  # a new spec; the input is unchanged
    assert out.submodules.input_layernorm is layer.submodules.input_layernorm
    assert _attn(out).linear_qkv is _attn(layer).linear_qkv
    plain = model_mod.gpt_layer_spec(qk_layernorm=False)
    assert with_torch_qk_norm(plain) is plain and _attn(plain).q_layernorm is IdentityOp


@pytest.mark.parametrize("te, replaced", [("1.8.0.dev0", True), ("1.9.0.dev0", True), ("1.9.0", False),
                                          ("1.13.0+7d576ed", False)])
def test_te_spec_gets_the_torch_qk_norm_below_te_1_9(monkeypatch, te, replaced):
    """Our side of gpt_layer_spec(use_te=True): megatron-core 0.10's TE spec below 1.9 (apex's FusedLayerNorm as
    QK-norm), stood in by the local spec with that substitution, since TE's layers do not exist without TE."""
    def te_spec(num_experts, moe_grouped_gemm, qk_layernorm=False, fp8=None):
        layer = model_mod.get_gpt_layer_local_spec(qk_layernorm=qk_layernorm)
        qk = FusedLayerNorm if qk_norm_is_apex(te) else WrappedTorchNorm  # TENorm from 1.9.0 on
        sub = dataclasses.replace(_attn(layer), q_layernorm=qk, k_layernorm=qk)
        return dataclasses.replace(layer, submodules=dataclasses.replace(
            layer.submodules, self_attention=dataclasses.replace(layer.submodules.self_attention, submodules=sub)))

    monkeypatch.setattr(model_mod, "get_gpt_layer_with_transformer_engine_spec", te_spec)
    monkeypatch.setattr(model_mod, "te_version", lambda: te)
    got = _attn(model_mod.gpt_layer_spec(qk_layernorm=True, use_te=True)).q_layernorm
    assert (got is QKNorm) == replaced and got is not FusedLayerNorm


def test_a_gpt_model_with_the_torch_qk_norm_computes_what_megatrons_torch_norm_does(gloo_world_of_one):
    """The same weights through a tiny Qwen3-like GPTModel: megatron-core's WrappedTorchNorm as QK-norm (the local
    spec the CPU tests and conversions use) vs QKNorm; same parameter names, same logits."""
    initialize_parallel()
    try:
        spec = GPTSpec(vocab_size=64, hidden_size=32, num_attention_heads=4, num_query_groups=2)
        config = dataclasses.replace(transformer_config(spec), qk_layernorm=True, layernorm_epsilon=1e-6)
        layer = model_mod.gpt_layer_spec(qk_layernorm=True)

        def build(layer_spec):
            return GPTModel(config=config, transformer_layer_spec=layer_spec, vocab_size=64, max_sequence_length=32,
                            position_embedding_type="rope")

        torch.manual_seed(1)
        ref, ours = build(layer), build(with_torch_qk_norm(layer))
        assert isinstance(ours.decoder.layers[0].self_attention.q_layernorm, QKNorm)
        state = ref.state_dict()
        for k in state:
            if "q_layernorm" in k or "k_layernorm" in k:
                state[k].uniform_(0.5, 1.5)  # not the ones-init, so a norm that ignored its weight would show
        ref.load_state_dict(state)
        ours.load_state_dict(state, strict=True)  # the same keys: a checkpoint loads into either
        tokens = torch.randint(0, 64, (2, 12))
        pos = torch.arange(12).expand(2, 12)
        mask = torch.ones(1, 1, 12, 12, dtype=torch.bool).tril().logical_not()
        a, b = ref(tokens, pos, mask), ours(tokens, pos, mask)
        print(f"QKNorm vs megatron's torch norm: max |logit difference| {(a - b).abs().max().item():.3g} "
              f"(logits up to {a.abs().max().item():.2f})")  # pytest -s shows it
        assert a.shape == (2, 12, 64) and torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
        broken = with_torch_qk_norm(layer)
        torch.manual_seed(1)
        other = build(broken)
        for m in other.modules():  # a QK-norm that skips its weight must be caught by this comparison
            if isinstance(m, QKNorm):
                m.forward = lambda x, m=m: x.float().mul(torch.rsqrt(x.float().pow(2).mean(-1, True) + m.eps))
        other.load_state_dict(state)
        assert not torch.allclose(a, other(tokens, pos, mask), atol=1e-3)
    finally:
        destroy_parallel()
