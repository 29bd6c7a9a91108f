"""Expert-aware refit gather under torchrun (2 ranks, gloo): every layout's stream must rebuild the single-rank
weights bit for bit, cut for the inference TP size, in buckets that respect the byte bound.

Layouts: tp2 (dense, GLU + QKV bias), pp2 (dense), pp2_tied (tied embeddings: the last stage's copy is not sent
twice), ep2 (MoE, 4 experts, EP=2 => DP=2), tp2_moe (MoE with the experts TP-sharded, ETP=2), tp2_moe_te_labels
(the same, its expert weights' split dims labelled as Transformer Engine labels them). For each: inference TP 1
and 2, a small bucket (many buckets, some tensors larger than a bucket) and a large one (a single bucket), and once
a bf16 cast. Results: $OUT_DIR/rank{r}.json.
"""
import json
import os

import tests.support.megatron_cpu_shim  # noqa: F401  (before megatron)

import torch
import torch.distributed as dist

from nemo_dapo.megatron.convert_shard import tp_shard
from nemo_dapo.megatron.model import param_layouts
from tests.support.megatron_model import (GPTSpec, build_gpt_model, destroy_parallel, initialize_parallel,
                                          load_full_state_dict, single_rank_state_dict)
from nemo_dapo.megatron.refit_gather import RefitStats, iter_refit_buckets
from tests.support.megatron_reduction import full_state_dict

DENSE = GPTSpec(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=48, add_bias_linear=True, add_qkv_bias=True, max_sequence_length=64)
MOE = GPTSpec(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, ffn_hidden_size=48,
              num_experts=4, moe_token_dispatcher="allgather", max_sequence_length=64)
TIED = GPTSpec(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, ffn_hidden_size=48,
               tie_embeddings=True, max_sequence_length=64)
SMALL, LARGE = 4096, 1 << 30


def reference(spec):
    torch.manual_seed(1)
    model = build_gpt_model(spec)
    return single_rank_state_dict(model), param_layouts(model)


def expected(full, layouts, infer_tp, infer_rank, dtype=None):
    out = {}
    for name, t in full.items():
        lay = layouts[name]
        if lay.tp_dim is not None and infer_tp > 1:
            t = tp_shard(t, lay.tp_dim, lay.stride, infer_tp, infer_rank)
        out[name] = t.to(dtype) if dtype is not None else t
    return out


def check_stream(model, want, infer_tp, bucket, dtype=None):
    stats = RefitStats()
    got, bucket_ok, duplicates = {}, True, 0
    for b in iter_refit_buckets(model, bucket_bytes=bucket, infer_tp_size=infer_tp, dtype=dtype, stats=stats):
        size = sum(t.numel() * t.element_size() for _, t in b)
        bucket_ok &= size <= bucket or len(b) == 1
        for name, t in b:
            duplicates += name in got
            got[name] = t
    return dict(names_match=sorted(got) == sorted(want), duplicates=duplicates,
                exact=all(n in got and got[n].dtype == w.dtype and torch.equal(got[n], w) for n, w in want.items()),
                bucket_ok=bool(bucket_ok), buckets=stats.buckets, peak=stats.peak_buffered_bytes,
                max_tensor=stats.max_tensor_bytes, bound=bucket + stats.max_tensor_bytes,
                total_bytes=stats.bytes, want_bytes=sum(w.numel() * w.element_size() for w in want.values()))


def label_experts_as_te(model):
    """Label the expert weights as TE does on GPUs (contract: megatron-core 0.10's TELinear / TEGroupedLinear build
    TE's layer with ``parallel_mode=None`` under expert parallelism or expert-TP, and TE's ``reset_parameters`` then
    sets ``partition_dim=0`` on every weight, the row-parallel ``linear_fc2`` included)."""
    for name, p in model.named_parameters():
        if ".mlp.experts." in name and getattr(p, "tensor_model_parallel", False):
            p.partition_dim = 0


def case(spec, layout, refs, te_labels=False):
    full, layouts = refs
    initialize_parallel(*layout)
    model = build_gpt_model(spec)
    load_full_state_dict(model, full)
    if te_labels:
        label_experts_as_te(model)
    rank = dist.get_rank()
    out = {}
    for infer_tp in (1, 2):
        want = expected(full, layouts, infer_tp, rank % infer_tp)
        for label, bucket in (("small", SMALL), ("large", LARGE)):
            out[f"infer_tp{infer_tp}_{label}"] = check_stream(model, want, infer_tp, bucket)
    out["bf16"] = check_stream(model, expected(full, layouts, 2, rank % 2, torch.bfloat16), 2, SMALL,
                               torch.bfloat16)
    if layout == (2, 1, 1):  # training TP = inference TP: the stream must give back this rank's own shards
        lays = param_layouts(model)
        streamed = {n: t for b in iter_refit_buckets(model, bucket_bytes=SMALL, infer_tp_size=2) for n, t in b}
        own = {lays[n].full_name: p.detach() for n, p in model.named_parameters()}
        out["own_shards_equal"] = all(torch.equal(streamed[n], t) for n, t in own.items())
    gathered = full_state_dict(model)
    out["full_state_dict_exact"] = sorted(gathered) == sorted(full) and all(
        torch.equal(gathered[n], full[n]) for n in full)
    out["no_alias"] = all(t.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
                          for t in gathered.values() for p in model.parameters())
    destroy_parallel()
    return out


def main():
    dist.init_process_group("gloo")
    initialize_parallel(1, 1, 1)
    dense, moe, tied = reference(DENSE), reference(MOE), reference(TIED)
    destroy_parallel()
    res = {"tp2": case(DENSE, (2, 1, 1), dense), "pp2": case(DENSE, (1, 2, 1), dense),
           "ep2": case(MOE, (1, 1, 2), moe), "tp2_moe": case(MOE, (2, 1, 1), moe),
           "tp2_moe_te_labels": case(MOE, (2, 1, 1), moe, te_labels=True),
           "pp2_tied": case(TIED, (1, 2, 1), tied)}
    with open(os.path.join(os.environ["OUT_DIR"], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(res, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
