"""Device checks of nemo_dapo.megatron on one CUDA device with NCCL (world size 1, initialised in this process).

Run on a GPU machine with megatron-core installed (skipped elsewhere by tests/conftest.py):

    python -m pytest tests/gpu/test_megatron_cuda.py -q -s

One GPU only: tensor parallelism over two ranks cannot run here (NCCL refuses two ranks on one device), so TP=2 is
left to the multi-process CPU tests (gloo) and to a machine with two GPUs. What is checked:
  * ``vocab_parallel`` at TP=1, fp32 and bf16: values and gradients against the core full-logits reference (and an
    fp64 truth for bf16), and log-probs against megatron's own ``vocab_parallel_cross_entropy``;
  * ``convert*``: a tiny random Llama (GQA, tied embeddings, head_dim != hidden/heads, rope_theta 5e4) and Qwen2
    (QKV bias) converted to a megatron GPTModel give the logits of the transformers model. Tolerances: fp32,
    max |diff| < 2e-4 (logits of order 3-30); bf16, megatron's error against the fp32 HF logits at most 4x the
    bf16 HF model's own error plus 2% of the logit scale;
  * ``reduction``: parameter gradients of one global batch through ``get_forward_backward_func`` with 1 and with 4
    micro-batches (plain, and under megatron's DDP) equal a single plain forward/backward; without the scale they
    are a quarter of it (proves the check can fail);
  * ``MegatronPolicy`` on CUDA: log-probs and one SGD update against a row-by-row full-logits reference.
"""
import os
import socket
from dataclasses import fields, replace
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core", reason="needs megatron-core")
pytest.importorskip("transformers", reason="the conversion parity compares against transformers' models")

import transformers  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,  # noqa: E402
                                       finalize_model_grads)
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config  # noqa: E402

from nemo_dapo.core.logprobs import reference_logprobs_entropy  # noqa: E402
from nemo_dapo.core.loss import dapo_policy_loss, make_loss_fn  # noqa: E402
from nemo_dapo.megatron.convert import gpt_model_kwargs_from_hf  # noqa: E402
from tests.support.megatron_convert import hf_to_megatron  # noqa: E402
from nemo_dapo.megatron.convert_build import (gpt_model_from_hf, layer_spec_from_hf,  # noqa: E402
                                              transformer_config_from_hf)
from tests.support.megatron_model import (GPTSpec, build_gpt_model, destroy_parallel, initialize_parallel,  # noqa: E402
                                          load_full_state_dict, single_rank_state_dict)
from tests.support.megatron_policy import MegatronPolicy  # noqa: E402
from nemo_dapo.megatron.reduction import scale_for_schedule, schedule_loss_scale  # noqa: E402
from nemo_dapo.megatron.vocab_parallel import (tp_vocab_shard, vocab_parallel_logits_logprobs_entropy,  # noqa: E402
                                               vocab_parallel_logprobs_entropy)
from tests.megatron.workers.convert_models import PADDED_VOCAB, SMALL, VOCAB, randomize_, tokens  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")


@pytest.fixture(scope="module", autouse=True)
def megatron_world():
    """torch.distributed with one rank (NCCL; gloo if NCCL cannot start) + megatron's TP = PP = EP = 1 groups."""
    torch.cuda.set_device(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    try:
        dist.init_process_group("nccl", world_size=1, rank=0, timeout=timedelta(seconds=120))
        dist.barrier()
    except Exception as e:  # noqa: BLE001 - reported, then the checks still run over gloo
        print(f"RESULT nccl_init=failed error={type(e).__name__}: {str(e)[:300]!r}")
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("gloo", world_size=1, rank=0)
    import megatron.core
    print(f"RESULT megatron_world backend={dist.get_backend()} megatron_core={megatron.core.__version__} "
          f"transformers={transformers.__version__} torch={torch.__version__} "
          f"tf32={torch.backends.cuda.matmul.allow_tf32} tp2=not_run(one GPU: NCCL refuses two ranks on one device)")
    initialize_parallel(1, 1, 1)
    yield dist.get_backend()
    destroy_parallel()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------
# vocab-parallel log-prob / entropy at TP = 1
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_vocab_parallel_tp1_matches_core_reference(dtype):
    s, b, h, v = 96, 4, 256, 32000
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(s, b, h, generator=g) * 2).to(DEVICE, dtype)
    weight = (torch.randn(v, h, generator=g) / h ** 0.5).to(DEVICE, dtype)
    targets = torch.randint(0, v, (s, b), generator=g).to(DEVICE)
    mask = (torch.rand(s, b, generator=g) < 0.8).to(DEVICE)
    coef_a, coef_b = (torch.randn(s, b, generator=g, dtype=torch.float64).to(DEVICE) for _ in range(2))
    shard = tp_vocab_shard(v)
    assert (shard.start, shard.vocab_size, parallel_state.get_tensor_model_parallel_world_size()) == (0, v, 1)

    def run(fused, hid, w):
        hid, w = hid.clone().requires_grad_(), w.clone().requires_grad_()
        if fused:
            logp, ent = vocab_parallel_logprobs_entropy(hid, w, targets, mask=mask, chunk_size=100, temperature=0.9)
        else:
            logp, ent = reference_logprobs_entropy(hid, w, targets, temperature=0.9)
            logp, ent = logp * mask, ent * mask
        loss = (logp.double() * coef_a).sum() + (ent.double() * coef_b).sum()
        return [logp.detach(), ent.detach(), *torch.autograd.grad(loss, (hid, w))]

    got, ref = run(True, hidden, weight), run(False, hidden, weight)
    truth = run(False, hidden.double(), weight.double())
    for name, x, r, t in zip(("logp", "entropy", "grad_hidden", "grad_weight"), got, ref, truth):
        scale = t.abs().max().item()
        err, ref_err = (x.double() - t).abs().max().item(), (r.double() - t).abs().max().item()
        print(f"RESULT vocab_parallel_tp1 dtype={str(dtype)[6:]} out={name} err={err:.3g} ref_err={ref_err:.3g}")
        assert x.shape == r.shape and x.dtype == r.dtype
        if dtype == torch.float32:
            torch.testing.assert_close(x, r, atol=1e-5 * scale, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        else:
            assert err <= 2 * ref_err + 1e-6 * scale, f"{name}: error {err:.3g} vs the reference's {ref_err:.3g}"
    # megatron's own cross entropy (temperature 1) on the logits that the fused path computes chunk by chunk
    with torch.no_grad():
        logits = (hidden @ weight.t()).float()
        mc_nll = vocab_parallel_cross_entropy(logits.clone(), targets)
        ours, _ = vocab_parallel_logprobs_entropy(hidden, weight, targets, chunk_size=100)
        from_logits, _ = vocab_parallel_logits_logprobs_entropy(logits, targets, chunk_size=100)
    tight = 2e-5 * mc_nll.abs().max().item()
    # from the same logits: fp32 rounding only. From the hidden states: in bf16 the chunked GEMM may round a logit
    # one bf16 step (2^-8 relative) differently from the full one
    torch.testing.assert_close(from_logits, -mc_nll, atol=tight, rtol=1e-5)
    atol = tight if dtype == torch.float32 else 2 ** -7 * logits.abs().max().item()
    print(f"RESULT vocab_parallel_vs_megatron_ce dtype={str(dtype)[6:]} max_diff={(ours + mc_nll).abs().max():.3g} "
          f"max_diff_from_logits={(from_logits + mc_nll).abs().max():.3g}")
    torch.testing.assert_close(ours, -mc_nll, atol=atol, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# HF <-> megatron conversion: logit parity on CUDA
# ---------------------------------------------------------------------------------------------------------------

def hf_configs():
    """The Llama and Qwen2 configs of tests/megatron/workers/convert_models.configs() (built here so that a change
    in transformers' MoE configs cannot stop the dense checks)."""
    return {"llama": LlamaConfig(**SMALL, num_hidden_layers=4, head_dim=16, rms_norm_eps=1e-6, rope_theta=5e4,
                                 tie_word_embeddings=True),
            "qwen2": Qwen2Config(**SMALL, num_hidden_layers=2, rms_norm_eps=1e-5, rope_theta=1e4,
                                 tie_word_embeddings=False)}


def hf_rope_theta(cfg) -> float:
    """The RoPE base transformers uses: ``rope_theta`` (4.x) or ``rope_parameters['rope_theta']`` (5.x)."""
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(cfg.rope_theta)


def hf_model(cfg):
    """Randomised fp32 HF model with eager attention, on the CPU (transformers 4.x and 5.x)."""
    try:
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    except (TypeError, ValueError):
        cfg._attn_implementation = "eager"
        model = AutoModelForCausalLM.from_config(cfg)
    return randomize_(model.float(), seed=0).eval()


def megatron_model(cfg, dtype, rotary_base=None):
    overrides = dict(use_cpu_initialization=True, params_dtype=dtype, pipeline_dtype=dtype,
                     bf16=dtype == torch.bfloat16)
    if rotary_base is None:  # exactly what the library builds
        model = gpt_model_from_hf(cfg, padded_vocab=PADDED_VOCAB, parallel_output=False, **overrides)
    else:  # the same with the RoPE base forced (diagnoses a base lost between transformers versions)
        kw = {**gpt_model_kwargs_from_hf(cfg, padded_vocab=PADDED_VOCAB), "rotary_base": rotary_base}
        model = GPTModel(config=transformer_config_from_hf(cfg, **overrides),
                         transformer_layer_spec=layer_spec_from_hf(cfg), pre_process=True, post_process=True,
                         parallel_output=False, **kw)
    return model.to(DEVICE).eval()


@torch.no_grad()
def megatron_logits(model, full, dtype, ids):
    model.load_state_dict({k: t.to(DEVICE, dtype) for k, t in full.items()}, strict=True)
    b, s = ids.shape
    pos = torch.arange(s, device=DEVICE)[None].expand(b, s)
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=DEVICE), 1)[None, None]
    return model(ids, pos, causal)[..., :VOCAB].float()


def test_rope_base_follows_the_hf_config():
    """convert.gpt_model_kwargs_from_hf must read the RoPE base where the installed transformers keeps it."""
    for family, cfg in hf_configs().items():
        got, want = gpt_model_kwargs_from_hf(cfg)["rotary_base"], hf_rope_theta(cfg)
        print(f"RESULT rope_base family={family} transformers={transformers.__version__} converted={got} hf={want}")
        assert got == want, f"{family}: megatron rotary_base {got} but transformers uses {want}"


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_megatron_logits_equal_hf_logits(family):
    cfg = hf_configs()[family]
    model = hf_model(cfg)
    full = hf_to_megatron({n: t.detach().clone() for n, t in model.state_dict().items()}, cfg,
                          padded_vocab=PADDED_VOCAB)
    ids = tokens(batch=2, seq=12).to(DEVICE)
    with torch.no_grad():
        want = model.to(DEVICE)(ids).logits.float()
        hf_bf16_err = (model.to(torch.bfloat16)(ids).logits.float() - want).abs().max().item()
    scale = want.abs().max().item()
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype)[6:]
        results[name] = (megatron_logits(megatron_model(cfg, dtype), full, dtype, ids) - want).abs().max().item()
        forced = (megatron_logits(megatron_model(cfg, dtype, hf_rope_theta(cfg)), full, dtype, ids) - want)
        print(f"RESULT convert_parity family={family} dtype={name} max_diff={results[name]:.3g} "
              f"max_diff_with_hf_rope_base={forced.abs().max().item():.3g} hf_bf16_err={hf_bf16_err:.3g} "
              f"logit_scale={scale:.3g} transformers={transformers.__version__}")
    assert scale > 2.0  # logits large enough for a wrong layout to show
    assert results["float32"] < 2e-4, f"fp32: max |megatron - HF| = {results['float32']:.3g}"
    assert results["bfloat16"] <= 4 * hf_bf16_err + 0.02 * scale, (
        f"bf16: megatron error {results['bfloat16']:.3g} vs the bf16 HF model's {hf_bf16_err:.3g}")


# ---------------------------------------------------------------------------------------------------------------
# token-level reduction through megatron's schedule
# ---------------------------------------------------------------------------------------------------------------

SPEC = GPTSpec(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
               ffn_hidden_size=48, add_bias_linear=True, add_qkv_bias=True, max_sequence_length=64)
B, S = 8, 12
GRAD_TOL = 1e-5  # relative to the largest reference gradient; fp32 on CUDA, different GEMM shapes


def reduction_batch():
    """8 rows; rows 4..7 entirely masked (whole micro-batches with nothing to learn from)."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, SPEC.vocab_size, (B, S), generator=g)
    lengths, start = torch.randint(3, S, (B,), generator=g), torch.randint(1, 4, (B,), generator=g)
    col = torch.arange(S)
    mask = ((col >= start[:, None]) & (col < lengths[:, None] + start[:, None])).float()
    mask[4:] = 0.0
    fields_ = dict(tokens=ids, targets=torch.roll(ids, -1, 1), mask=mask, adv=torch.randn(B, generator=g),
                   noise=0.3 * torch.randn(B, S, generator=g))
    return SimpleNamespace(**{k: t.to(DEVICE) for k, t in fields_.items()})


def token_ce(model, mb):
    """megatron's per-token cross entropy [b, S] (= -log pi of each target)."""
    pos = torch.arange(S, device=DEVICE).expand(mb.tokens.shape[0], S)
    causal = torch.triu(torch.ones(S, S, dtype=torch.bool, device=DEVICE), 1).view(1, 1, S, S)
    return model(mb.tokens, pos, causal, labels=mb.targets)


def dapo_loss(logp, mb, num_tokens):
    return dapo_policy_loss(logp, mb.old, mb.adv, mb.mask, eps_low=0.2, eps_high=0.28, num_tokens=num_tokens)


@pytest.fixture(scope="module")
def reduction_reference():
    """Full batch, one plain forward/backward of a fresh model: the gradients every split must reproduce."""
    batch = reduction_batch()
    torch.manual_seed(0)
    model = build_gpt_model(SPEC).to(DEVICE)
    full = single_rank_state_dict(model)
    with torch.no_grad():
        batch.old = -token_ce(model, batch) + batch.noise  # ratios != 1, so some tokens are clipped
    n = int(batch.mask.sum())
    loss, _ = dapo_loss(-token_ce(model, batch), batch, n)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return batch, full, grads, float(loss), n


def schedule_grads(batch, full, n, num_micro, *, ddp, scale=True):
    model = build_gpt_model(SPEC).to(DEVICE)
    load_full_state_dict(model, full)
    wrapped = model
    if ddp:
        wrapped = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
        model.config.finalize_model_grads_func = finalize_model_grads
        model.config.no_sync_func = wrapped.no_sync
    rows = B // num_micro
    mbs = [SimpleNamespace(**{k: getattr(batch, k)[lo:lo + rows] for k in ("tokens", "targets", "mask", "adv", "old")})
           for lo in range(0, B, rows)]
    factor = schedule_loss_scale(num_micro, parallel_state.get_data_parallel_world_size()) if scale else 1.0

    def forward_step(data_iterator, m):
        mb = next(data_iterator)
        return token_ce(m, mb), lambda ce: scale_for_schedule(*dapo_loss(-ce, mb, n), factor)

    stored = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(mbs), model=[wrapped],
                                         num_microbatches=num_micro, seq_length=S, micro_batch_size=rows,
                                         forward_only=False)
    grads = {}
    for name, p in model.named_parameters():
        g = getattr(p, "main_grad", None)
        grads[name] = (p.grad if g is None else g).detach().clone()
    return grads, sum(float(m["loss"]) for m in stored)


@pytest.mark.parametrize("num_micro,ddp", [(1, False), (4, False), (4, True)], ids=["1mb", "4mb", "4mb_ddp"])
def test_schedule_gradients_equal_single_pass(reduction_reference, num_micro, ddp):
    batch, full, ref_grads, ref_loss, n = reduction_reference
    grads, loss = schedule_grads(batch, full, n, num_micro, ddp=ddp)
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    err = max(float((grads[k] - ref_grads[k]).abs().max()) for k in ref_grads) / scale
    print(f"RESULT reduction micro_batches={num_micro} ddp={ddp} grad_rel_err={err:.3g} loss={loss:.6g} "
          f"ref_loss={ref_loss:.6g} params={len(grads)}")
    assert sorted(grads) == sorted(ref_grads) and scale > 0
    assert err < GRAD_TOL
    assert loss == pytest.approx(ref_loss, rel=1e-4, abs=1e-6)


def test_unscaled_schedule_is_detectably_wrong(reduction_reference):
    batch, full, ref_grads, _, n = reduction_reference
    grads, _ = schedule_grads(batch, full, n, 4, ddp=False, scale=False)
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    err = max(float((grads[k] - ref_grads[k]).abs().max()) for k in ref_grads) / scale
    assert err == pytest.approx(0.75, abs=1e-3)  # the schedule's 1/num_microbatches was not undone


# ---------------------------------------------------------------------------------------------------------------
# MegatronPolicy on CUDA
# ---------------------------------------------------------------------------------------------------------------

POLICY_SPEC = GPTSpec(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=48, add_qkv_bias=True, max_sequence_length=64)
P, R, T, LR = 6, 7, 0.8, 0.5
LOSS_FN = make_loss_fn(eps_low=0.2, eps_high=0.28)


def policy_batch():
    from nemo_dapo.core.types import RolloutBatch
    g = torch.Generator().manual_seed(11)
    plen, rlen = torch.tensor([2, 6, 3, 5, 1, 4, 6, 2]), torch.tensor([7, 3, 0, 5, 6, 1, 4, 7])
    prompt_mask = (torch.arange(P)[None] >= (P - plen)[:, None]).long()
    resp_mask = (torch.arange(R)[None] < rlen[:, None]).float()
    batch = RolloutBatch(prompt_ids=torch.randint(3, 64, (B, P), generator=g) * prompt_mask, prompt_mask=prompt_mask,
                         response_ids=torch.randint(3, 64, (B, R), generator=g) * resp_mask.long(),
                         response_mask=resp_mask, group_ids=torch.arange(B) // 4, truncated=torch.zeros(B).bool(),
                         advantages=torch.randn(B, generator=g))
    return batch, torch.randn(B, R, generator=g) * 0.3


def on_device(batch):
    return replace(batch, **{f.name: getattr(batch, f.name).to(DEVICE) for f in fields(batch)
                             if isinstance(getattr(batch, f.name), torch.Tensor)})


def row_by_row_logprobs(model, batch):
    """Each row unpadded through the model, log-probs from the full logits / T: what the packing must reproduce."""
    out_lp, out_ent = [], []
    for b in range(B):
        prompt = batch.prompt_ids[b][batch.prompt_mask[b].bool()]
        n = int(batch.response_mask[b].sum())
        seq = torch.cat([prompt, batch.response_ids[b, :n]])[None].to(DEVICE)
        s = seq.shape[1]
        logits = model(seq, torch.arange(s, device=DEVICE)[None],
                       torch.triu(torch.ones(s, s, dtype=torch.bool, device=DEVICE), 1)[None, None])
        lp_all = torch.log_softmax(logits[0].float() / T, -1)[len(prompt) - 1:len(prompt) - 1 + n]
        pad = torch.zeros(R - n, device=DEVICE)
        out_lp.append(torch.cat([lp_all.gather(1, seq[0, len(prompt):, None]).squeeze(1), pad]))
        out_ent.append(torch.cat([-(lp_all.exp() * lp_all).sum(-1), pad]))
    return torch.stack(out_lp), torch.stack(out_ent)


def test_megatron_policy_logprobs_and_update_on_cuda():
    batch, noise = policy_batch()
    torch.manual_seed(0)
    ref_model = build_gpt_model(POLICY_SPEC).to(DEVICE)
    full = single_rank_state_dict(ref_model)
    with torch.no_grad():
        want_lp, want_ent = row_by_row_logprobs(ref_model, batch)
    batch.old_logp = (want_lp.cpu() + noise) * batch.response_mask
    n = float(LOSS_FN.normalizer(batch))
    ref_loss, _ = LOSS_FN(*row_by_row_logprobs(ref_model, batch), on_device(batch), n)
    ref_loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(ref_model.parameters(), float("inf")))
    torch.nn.utils.clip_grad_norm_(ref_model.parameters(), norm / 2)  # an active clip
    torch.optim.SGD(ref_model.parameters(), lr=LR).step()
    want_delta = {k: p.detach() - full[k] for k, p in ref_model.named_parameters()}

    model = build_gpt_model(POLICY_SPEC).to(DEVICE)
    load_full_state_dict(model, full)
    policy = MegatronPolicy(model, torch.optim.SGD(model.parameters(), lr=LR), micro_batch_size=2,
                            max_grad_norm=norm / 2, temperature=T)
    got_lp, got_ent = policy.logprobs(batch)
    assert got_lp.device.type == "cpu"  # returned where the batch lives
    lp_err = max((got_lp - want_lp.cpu()).abs().max().item(), (got_ent - want_ent.cpu()).abs().max().item())
    metrics = policy.train_step(batch, norm=n, loss_fn=LOSS_FN)
    delta_scale = max(float(d.abs().max()) for d in want_delta.values())
    update_err = max(float((p.detach() - full[k] - want_delta[k]).abs().max())
                     for k, p in model.named_parameters()) / delta_scale
    print(f"RESULT megatron_policy_cuda logp_max_err={lp_err:.3g} update_rel_err={update_err:.3g} "
          f"loss={metrics['loss']:.6g} ref_loss={float(ref_loss):.6g} grad_norm={metrics['grad_norm']:.6g} "
          f"ref_grad_norm={norm:.6g}")
    assert lp_err < 2e-5
    assert metrics["skipped"] == 0.0 and metrics["grad_norm"] == pytest.approx(norm, rel=1e-4)
    assert metrics["loss"] == pytest.approx(float(ref_loss), rel=1e-4, abs=1e-7)
    assert update_err < 1e-4
