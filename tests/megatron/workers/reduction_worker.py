"""Token-level reduction under megatron's schedules (2 ranks, gloo): gradients of one global batch's DAPO loss.

Phase 1 (every rank, no communication): a single-rank reference - the full batch in one forward/backward of a
TP=PP=1 model, loss = dapo_policy_loss(num_tokens = global valid-token count).
Phase 2: the same weights and batch under megatron's schedule in several layouts; each rank compares its gradients
(its TP shards / its pipeline stage) with the reference and writes the relative max error to $OUT_DIR/rank{r}.json.

Cases (8 rows, micro-batches of 2 rows, rows 4..7 entirely masked):
  dp1_4mb       one rank's view, 4 micro-batches, no DDP (every rank runs it alone)
  dp2_2mb       megatron DDP over 2 ranks, 2 micro-batches each; rank 1's micro-batches are all masked
  pp2_4mb       1F1B pipeline schedule over 2 stages, 4 micro-batches
  tp2_4mb       tensor parallel over 2 ranks, 4 micro-batches (gradients compared shard by shard)
  dp2_per_token megatron's own per-token path (3-tuple + calculate_per_token_loss) with megatron DDP, DP=2
  dp2_naive     like dp2_2mb but WITHOUT the scale (plain 2-tuple): must differ (proves the test can fail)
"""
import json
import os
from types import SimpleNamespace

import tests.support.megatron_cpu_shim  # noqa: F401  (before megatron)

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func

from nemo_dapo.core.loss import dapo_policy_loss
from nemo_dapo.megatron.convert_shard import tp_shard
from nemo_dapo.megatron.model import param_layouts, tp_group_of
from tests.support.megatron_model import (GPTSpec, build_gpt_model, destroy_parallel, initialize_parallel,
                                          load_full_state_dict, single_rank_state_dict)
from nemo_dapo.megatron.reduction import scale_for_schedule, schedule_loss_scale
from tests.support.megatron_reduction import global_token_count, per_token_output

SPEC = GPTSpec(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
               ffn_hidden_size=48, add_bias_linear=True, add_qkv_bias=True, max_sequence_length=64)
B, S, MBS = 8, 12, 2
EPS_LOW, EPS_HIGH = 0.2, 0.28


def make_batch():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, SPEC.vocab_size, (B, S), generator=g)
    lengths = torch.randint(3, S, (B,), generator=g)
    start = torch.randint(1, 4, (B,), generator=g)
    col = torch.arange(S)
    mask = ((col >= start[:, None]) & (col < lengths[:, None] + start[:, None])).float()
    mask[4:] = 0.0  # rows 4..7: every token masked (a DP rank / micro-batches with nothing to learn from)
    adv = torch.randn(B, generator=g)
    return SimpleNamespace(tokens=tokens, targets=torch.roll(tokens, -1, 1), mask=mask, adv=adv,
                           noise=0.3 * torch.randn(B, S, generator=g))


def rows(batch, lo, hi):
    return SimpleNamespace(**{k: getattr(batch, k)[lo:hi] for k in ("tokens", "targets", "mask", "adv", "old")})


def causal(s):
    return torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s)


def token_ce(model, mb):
    """megatron's (vocab-parallel) per-token cross entropy [b, S] on the last stage (= -log pi of each target);
    hidden states elsewhere."""
    pos = torch.arange(S).expand(mb.tokens.shape[0], S)
    return model(mb.tokens, pos, causal(S), labels=mb.targets)


def loss_of(logp, mb, num_tokens):
    return dapo_policy_loss(logp, mb.old, mb.adv, mb.mask, eps_low=EPS_LOW, eps_high=EPS_HIGH,
                            num_tokens=num_tokens)


def reference(batch):
    initialize_parallel(1, 1, 1)
    torch.manual_seed(0)
    model = build_gpt_model(SPEC)
    full = single_rank_state_dict(model)
    with torch.no_grad():
        batch.old = -token_ce(model, batch) + batch.noise  # ratios != 1 so that some tokens are clipped
    n = int(batch.mask.sum())
    loss, metrics = loss_of(-token_ce(model, batch), batch, n)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    destroy_parallel()
    return full, grads, float(loss), n, metrics


def wrap_ddp(model):
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.no_sync_func = ddp.no_sync
    return ddp


def run_schedule(model, mbs, loss_func_of):
    """megatron's forward/backward schedule over the micro-batches ``mbs``; returns the loss metrics stored."""
    def forward_step(data_iterator, m):
        mb = next(data_iterator)
        return token_ce(m, mb), lambda ce: loss_func_of(-ce, mb)

    return get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(mbs), model=[model],
                                       num_microbatches=len(mbs), seq_length=S, micro_batch_size=MBS,
                                       forward_only=False)


def compare(inner, ref_grads):
    """Max |g - g_ref| over this rank's parameters, relative to the largest reference gradient."""
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    worst, count, layouts = 0.0, 0, param_layouts(inner)
    for name, p in inner.named_parameters():
        lay = layouts[name]
        want = ref_grads[lay.full_name]
        if lay.tp_dim is not None:
            _, size, rank = tp_group_of(lay)
            want = tp_shard(want, lay.tp_dim, lay.stride, size, rank)
        got = getattr(p, "main_grad", None)
        got = p.grad if got is None else got
        worst = max(worst, float((got - want).abs().max()) / scale)
        count += 1
    return worst, count


def case(name, layout, batch, full, ref_grads, n_global, *, ddp=True, dp_size=None, per_token=False, scale=True):
    tp, pp = layout
    initialize_parallel(tp, pp, 1)
    model = build_gpt_model(SPEC)
    load_full_state_dict(model, full)
    dp = parallel_state.get_data_parallel_world_size() if dp_size is None else dp_size
    rank = parallel_state.get_data_parallel_rank() if dp > 1 else 0
    per_rank = B // dp
    mbs = [rows(batch, lo, lo + MBS) for lo in range(rank * per_rank, (rank + 1) * per_rank, MBS)]
    # every rank can count N itself from its own masks: the all-reduce must give the reference's count
    n = global_token_count([mb.mask for mb in mbs]) if ddp else int(sum(mb.mask.sum() for mb in mbs))
    assert n == n_global, (name, n, n_global)
    if per_token:
        model.config.calculate_per_token_loss = True
    wrapped = wrap_ddp(model) if ddp else model
    factor = schedule_loss_scale(len(mbs), dp) if scale else 1.0

    def loss_func(logp, mb):
        if per_token:
            loss, metrics = loss_of(logp, mb, 1.0)  # token-mean over a count of 1 = the plain token sum
            return per_token_output(loss, mb.mask.sum(), metrics)
        return scale_for_schedule(*loss_of(logp, mb, n), factor)

    stored = run_schedule(wrapped, mbs, loss_func)
    local_loss = sum(float(m["loss"]) for m in stored) if stored and not per_token else 0.0
    err, count = compare(model, ref_grads)
    out = dict(grad_rel_err=err, params_compared=count, local_params=len(list(model.parameters())),
               local_loss=local_loss, dp=dp, num_microbatches=len(mbs),
               local_tokens=float(sum(mb.mask.sum() for mb in mbs)))
    destroy_parallel()
    return out


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    batch = make_batch()
    full, ref_grads, ref_loss, n, _ = reference(batch)
    results = {"reference": dict(loss=ref_loss, num_tokens=n)}
    common = (batch, full, ref_grads, n)
    results["dp1_4mb"] = case("dp1_4mb", (1, 1), *common, ddp=False, dp_size=1)
    results["dp2_2mb"] = case("dp2_2mb", (1, 1), *common)
    results["pp2_4mb"] = case("pp2_4mb", (1, 2), *common)
    results["tp2_4mb"] = case("tp2_4mb", (2, 1), *common)
    results["dp2_per_token"] = case("dp2_per_token", (1, 1), *common, per_token=True)
    results["dp2_naive"] = case("dp2_naive", (1, 1), *common, scale=False)
    with open(os.path.join(os.environ["OUT_DIR"], f"rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
