"""MegatronPolicy under torchrun (2 ranks, gloo) against an obvious single-rank reference.

Reference (every rank alone, TP = PP = EP = 1): each row is run UNPADDED through the model ([prompt, response]),
log-probs and entropies come from the full logits (log_softmax(logits / T)); one update = the loss over the whole
batch, backward, torch.nn.utils.clip_grad_norm_ (clip active: max norm = half the norm), SGD.
Cases: tp2 (dense), pp2 (dense), pp2_tied (tied embeddings: the last stage holds a copy of the embedding), ep2
(MoE, alltoall dispatcher; DP = 2 with 5 and 3 rows, so rank 1 adds a blank micro-batch), tp2_megatron_opt
(megatron's optimizer instead of torch's: needs SHIM_LEVEL=4 on CPU for its 'torch.cuda.FloatTensor' type checks),
tp2_skip (a NaN loss skips the update), tp2_state (state_dict round trip), tp2_valid_vocab (the rows of the
output layer from VALID on are vocabulary padding: the reference's softmax runs over the first VALID logits).
Each rank writes the measured differences to $OUT_DIR/rank{r}.json.
"""
import json
import os
from dataclasses import replace

import tests.support.megatron_cpu_shim  # noqa: F401  (before megatron)

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from nemo_dapo.core.loss import make_loss_fn
from nemo_dapo.core.types import RolloutBatch
from nemo_dapo.megatron.convert_shard import tp_shard
from nemo_dapo.megatron.model import param_layouts, tp_group_of, unwrap
from tests.support.megatron_model import (GPTSpec, build_gpt_model, destroy_parallel, initialize_parallel,
                                          load_full_state_dict, single_rank_state_dict)
from tests.support.megatron_policy import MegatronPolicy

DENSE = GPTSpec(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=48, add_qkv_bias=True, max_sequence_length=64)
MOE = GPTSpec(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, ffn_hidden_size=48,
              num_experts=4, moe_router_topk=2, moe_token_dispatcher="alltoall", max_sequence_length=64)
TIED = replace(DENSE, tie_embeddings=True)
B, P, R, MBS, T, LR = 8, 6, 7, 2, 0.8, 0.5
VALID = 50  # of DENSE's 64 rows
LOSS_FN = make_loss_fn(eps_low=0.2, eps_high=0.28)


def make_batch():
    g = torch.Generator().manual_seed(11)
    plen = torch.tensor([2, 6, 3, 5, 1, 4, 6, 2])
    rlen = torch.tensor([7, 3, 0, 5, 6, 1, 4, 7])  # row 2: empty response (fully masked)
    prompt_mask = (torch.arange(P)[None] >= (P - plen)[:, None]).long()
    resp_mask = (torch.arange(R)[None] < rlen[:, None]).float()
    prompt_ids = torch.randint(3, 64, (B, P), generator=g) * prompt_mask
    response_ids = torch.randint(3, 64, (B, R), generator=g) * resp_mask.long()
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                        response_mask=resp_mask, group_ids=torch.arange(B) // 4, truncated=torch.zeros(B).bool(),
                        advantages=torch.randn(B, generator=g)), torch.randn(B, R, generator=g) * 0.3


def reference_logprobs(model, batch, valid=None):
    """Row by row without padding: the obvious computation the policy's packing must reproduce."""
    rows_lp, rows_ent = [], []
    for b in range(B):
        prompt = batch.prompt_ids[b][batch.prompt_mask[b].bool()]
        n = int(batch.response_mask[b].sum())
        resp = batch.response_ids[b, :n]
        seq = torch.cat([prompt, resp])[None]
        s = seq.shape[1]
        logits = model(seq, torch.arange(s)[None], torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None])
        lp_all = torch.log_softmax(logits[0, :, :valid].float() / T, -1)[len(prompt) - 1:len(prompt) - 1 + n]
        lp = lp_all.gather(1, resp[:, None]).squeeze(1)
        ent = -(lp_all.exp() * lp_all).sum(-1)
        pad = torch.zeros(R - n)
        rows_lp.append(torch.cat([lp, pad]))
        rows_ent.append(torch.cat([ent, pad]))
    return torch.stack(rows_lp), torch.stack(rows_ent)


def reference(spec, batch, noise, valid=None):
    torch.manual_seed(0)
    model = build_gpt_model(spec)
    full = single_rank_state_dict(model)
    with torch.no_grad():
        logp, ent = reference_logprobs(model, batch, valid)
    batch.old_logp = (logp + noise) * batch.response_mask
    n = float(LOSS_FN.normalizer(batch))
    lp, en = reference_logprobs(model, batch, valid)
    loss, _ = LOSS_FN(lp, en, batch, n)
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
    max_norm = norm / 2
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    torch.optim.SGD(model.parameters(), lr=LR).step()
    delta = {k: p.detach() - full[k] for k, p in model.named_parameters()}
    return dict(full=full, logp=logp, ent=ent, loss=float(loss), norm=norm, max_norm=max_norm, delta=delta,
                num_tokens=n)


def shard_of(model, name, full_tensor):
    lay = param_layouts(model)[name]
    if lay.tp_dim is None:
        return full_tensor
    _, size, rank = tp_group_of(lay)
    return tp_shard(full_tensor, lay.tp_dim, lay.stride, size, rank)


def make_policy(spec, ref, layout, megatron_optimizer=False, valid=None):
    initialize_parallel(*layout)
    model = build_gpt_model(spec)
    load_full_state_dict(model, ref["full"])
    if not megatron_optimizer:
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    else:  # megatron's own optimizer over megatron's DDP (what a GPU run uses); it clips with its config
        model = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=LR, sgd_momentum=0.0, weight_decay=0.0,
                                                           clip_grad=ref["max_norm"], bf16=False, fp16=False), [model])
    policy = MegatronPolicy(model, optimizer, micro_batch_size=MBS, max_grad_norm=ref["max_norm"], temperature=T,
                            valid_vocab=valid)
    return unwrap(model), policy


def local_rows(layout):
    """DP share of the batch: all rows when DP = 1; else 5 rows on DP rank 0, 3 on rank 1."""
    dp = parallel_state.get_data_parallel_world_size()
    if dp == 1:
        return list(range(B))
    return list(range(5)) if parallel_state.get_data_parallel_rank() == 0 else list(range(5, B))


def update_case(spec, ref, batch, layout, megatron_optimizer=False, valid=None):
    model, policy = make_policy(spec, ref, layout, megatron_optimizer, valid)
    idx = local_rows(layout)
    mine = batch.select(idx)
    logp, ent = policy.logprobs(mine)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    metrics = policy.train_step(mine, norm=ref["num_tokens"], loss_fn=LOSS_FN)
    scale = max(float(d.abs().max()) for d in ref["delta"].values())
    worst = 0.0
    layouts = param_layouts(model)
    for name, p in model.named_parameters():
        want = shard_of(model, name, ref["delta"][layouts[name].full_name])
        worst = max(worst, float((p.detach() - before[name] - want).abs().max()) / scale)
    out = dict(logp_err=float((logp - ref["logp"][idx]).abs().max()),
               ent_err=float((ent - ref["ent"][idx]).abs().max()),
               logp_shape=list(logp.shape), rows=len(idx),
               grad_norm=metrics["grad_norm"], ref_norm=ref["norm"], loss=metrics["loss"], ref_loss=ref["loss"],
               delta_rel_err=worst, skipped=metrics["skipped"], num_tokens_metric=metrics.get("num_tokens"),
               params=len(before))
    destroy_parallel()
    return out


def skip_case(ref, batch):
    model, policy = make_policy(DENSE, ref, (2, 1, 1))
    before = [p.detach().clone() for p in model.parameters()]

    def nan_loss(logp, ent, mb, n):
        loss, m = LOSS_FN(logp, ent, mb, n)
        return loss * float("nan"), m

    metrics = policy.train_step(batch, norm=ref["num_tokens"], loss_fn=nan_loss)
    unchanged = all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
    # the next (finite) update still works after a skip
    ok = policy.train_step(batch, norm=ref["num_tokens"], loss_fn=LOSS_FN)
    destroy_parallel()
    return dict(skipped=metrics["skipped"], unchanged=unchanged, next_skipped=ok["skipped"])


def state_case(ref, batch):
    model, policy = make_policy(DENSE, ref, (2, 1, 1))
    policy.train_step(batch, norm=ref["num_tokens"], loss_fn=LOSS_FN)
    saved = policy.state_dict()
    snapshot = [p.detach().clone() for p in model.parameters()]
    policy.train_step(batch, norm=ref["num_tokens"], loss_fn=LOSS_FN)
    moved = not all(torch.equal(a, p.detach()) for a, p in zip(snapshot, model.parameters()))
    policy.load_state_dict(saved)
    restored = all(torch.equal(a, p.detach()) for a, p in zip(snapshot, model.parameters()))
    destroy_parallel()
    initialize_parallel(1, 2, 1)  # another layout must refuse the shards
    other = build_gpt_model(DENSE)
    try:
        MegatronPolicy(other, torch.optim.SGD(other.parameters(), lr=LR), micro_batch_size=MBS).load_state_dict(
            saved)
        refused = False
    except ValueError:
        refused = True
    destroy_parallel()
    return dict(moved=moved, restored=restored, refused_other_layout=refused)


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    batch, noise = make_batch()
    initialize_parallel(1, 1, 1)
    ref_dense = reference(DENSE, batch, noise)
    moe_batch = batch.select(list(range(B)))
    ref_moe = reference(MOE, moe_batch, noise)
    tied_batch = batch.select(list(range(B)))
    ref_tied = reference(TIED, tied_batch, noise)
    real_batch = batch.select(list(range(B)))  # tokens below VALID only
    real_batch.prompt_ids, real_batch.response_ids = real_batch.prompt_ids % VALID, real_batch.response_ids % VALID
    ref_valid = reference(DENSE, real_batch, noise, VALID)
    destroy_parallel()
    res = {"tp2": update_case(DENSE, ref_dense, batch, (2, 1, 1)),
           "pp2": update_case(DENSE, ref_dense, batch, (1, 2, 1)),
           "ep2": update_case(MOE, ref_moe, moe_batch, (1, 1, 2)),
           "pp2_tied": update_case(TIED, ref_tied, tied_batch, (1, 2, 1)),
           "tp2_megatron_opt": update_case(DENSE, ref_dense, batch, (2, 1, 1), megatron_optimizer=True),
           "tp2_valid_vocab": update_case(DENSE, ref_valid, real_batch, (2, 1, 1), valid=VALID),
           "tp2_skip": skip_case(ref_dense, batch),
           "tp2_state": state_case(ref_dense, batch)}
    with open(os.path.join(os.environ["OUT_DIR"], f"rank{rank}.json"), "w") as f:
        json.dump(res, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
