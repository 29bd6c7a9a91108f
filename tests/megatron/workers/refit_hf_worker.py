"""HF-named refit stream under torchrun (2 ranks, gloo, fp32): ``refit_hf.hf_weight_buckets`` on a sharded
megatron model must give back, on EVERY rank, the Hugging Face state dict it was converted from, bit for bit.

Models: the random tiny HF models of convert_models (vocabulary 250, megatron's padded to 256), converted and cut
for this rank (convert.hf_to_megatron + convert_shard.shard_state_dict), loaded strictly into convert_build's
GPTModel. Layouts, one process group for all: tp2 (every family; MoE experts TP-split), pp2 (every family; llama's
tied embedding split across stages), ep2 (mixtral, qwen2_moe; DP = 2).
Per case: a small bucket (many buckets, some tensors larger than one), a huge one (one bucket), a bf16 cast;
names / shapes / dtypes / values against the HF checkpoint; the bucket bound; storage never shared with a
parameter, and the model unchanged after every yielded tensor was overwritten. Per layout: the same stream
through MegatronPolicy.hf_weight_buckets (DDP-wrapped model), and a negative control: one parameter shard is
perturbed on one rank and exactly the HF tensors made from it must then differ, on both ranks.
Results: $OUT_DIR/rank{r}.json.
"""
import json
import os
import weakref

import tests.support.megatron_cpu_shim  # noqa: F401  (before megatron)

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from tests.support.megatron_convert import hf_to_megatron
from nemo_dapo.megatron.convert_build import gpt_model_from_hf
from nemo_dapo.megatron.convert_shard import Parallel
from tests.support.megatron_convert import shard_state_dict
from tests.support.megatron_model import destroy_parallel, initialize_parallel
from tests.support.megatron_policy import MegatronPolicy
from nemo_dapo.megatron.refit_gather import RefitStats
from nemo_dapo.megatron import refit_hf
from nemo_dapo.megatron.refit_hf import hf_weight_buckets
from tests.megatron.workers.convert_models import PADDED_VOCAB, configs, tiny_model

FAMILIES = ("llama", "qwen2", "mixtral", "qwen2_moe")
LAYOUTS = {"tp2": (Parallel(tp=2), FAMILIES), "pp2": (Parallel(pp=2), FAMILIES),
           "ep2": (Parallel(ep=2), ("mixtral", "qwen2_moe"))}
SMALL, HUGE = 4096, 1 << 30
# (family, rank coordinate that perturbs, local parameter, HF tensors made from it)
PERTURB = {
    "tp2": ("qwen2", ("tp", 1), "decoder.layers.0.self_attention.linear_qkv.bias",
            [f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkv"]),
    "pp2": ("llama", ("pp", 1), "decoder.layers.0.mlp.linear_fc2.weight", ["model.layers.2.mlp.down_proj.weight"]),
    "ep2": ("mixtral", ("ep", 1), "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight",
            ["model.layers.1.block_sparse_moe.experts.2.w1.weight",
             "model.layers.1.block_sparse_moe.experts.2.w3.weight"]),
}


def hf_checkpoint(family):
    """The HF tensors of the tiny model as a checkpoint holds them (a tied lm_head is not saved)."""
    state = {n: t.detach().clone() for n, t in tiny_model(family).state_dict().items()}
    if configs()[family].tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


def build(family):
    return gpt_model_from_hf(configs()[family], padded_vocab=PADDED_VOCAB, use_cpu_initialization=True,
                             params_dtype=torch.float32, moe_token_dispatcher_type="alltoall")


def coords():
    return dict(tp=ps.get_tensor_model_parallel_rank(), pp=ps.get_pipeline_model_parallel_rank(),
                ep=ps.get_expert_model_parallel_rank())


def collect(buckets, bucket_bytes):
    """Join the stream; (dict, tensors in stream order, bucket sizes, bound respected, duplicate names)."""
    got, order, sizes, ok, dups = {}, [], [], True, 0
    for b in buckets:
        size = sum(t.numel() * t.element_size() for _, t in b)
        sizes.append(size)
        ok &= size <= bucket_bytes or len(b) == 1
        for name, t in b:
            dups += name in got
            got[name] = t
            order.append(t)
    return got, order, sizes, bool(ok), dups


def compare(got, want, dtype=None):
    """Names, shapes, dtypes and values of the joined stream against the HF state dict."""
    want = {n: t.to(dtype) for n, t in want.items()} if dtype is not None else want
    common = sorted(set(got) & set(want))
    return dict(missing=sorted(set(want) - set(got))[:6], extra=sorted(set(got) - set(want))[:6],
                wrong_shape=[n for n in common if got[n].shape != want[n].shape][:6],
                wrong_dtype=[n for n in common if got[n].dtype != want[n].dtype][:6],
                wrong_value=[n for n in common if got[n].shape == want[n].shape and not torch.equal(got[n], want[n])])


def exact(cmp):
    return not any(cmp.values())


class GatherTracker:
    """Independent peak measurement (not the generator's own ``RefitStats`` arithmetic): wraps the gather
    ``refit_hf`` pulls from and keeps a weak reference to every gathered tensor; ``sample(bucket)`` adds up the
    distinct storages still alive among them and among every HF tensor handed over so far (the current bucket
    included; views share their parent's storage and count once), sampled at each hand-over. The consumer drops
    each bucket before pulling the next, so anything else alive is held by the stream."""

    def __init__(self):
        self.refs, self.peak, self.peak_parts = [], 0, []
        self._inner = refit_hf.iter_refit_buckets

    def __enter__(self):
        def tracked(*args, **kwargs):
            for bucket in self._inner(*args, **kwargs):
                self.refs += [weakref.ref(t) for _, t in bucket]
                yield bucket
        refit_hf.iter_refit_buckets = tracked
        return self

    def __exit__(self, *exc):
        refit_hf.iter_refit_buckets = self._inner

    def sample(self, bucket):
        self.refs += [weakref.ref(t) for _, t in bucket]
        alive = [r() for r in self.refs]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in [a for a in alive if a is not None] + [t for _, t in bucket]}
        self.refs = [r for r, a in zip(self.refs, alive) if a is not None]
        if sum(storages.values()) > self.peak:
            self.peak, self.peak_parts = sum(storages.values()), sorted(storages.values())


def collect_tracked(buckets, tracker, hoard=False):
    """Sample ``tracker`` at every bucket; keep only names and shapes, or (``hoard``, the negative control of the
    measurement) every bucket, as a consumer that never frees would."""
    shapes, kept = {}, []
    for b in buckets:
        tracker.sample(b)
        shapes.update((name, list(t.shape)) for name, t in b)
        if hoard:
            kept.append(b)
        del b
    return shapes


def check_stream(model, cfg, want, bucket_bytes, dtype=None):
    tracked_stats = RefitStats()
    with GatherTracker() as tracker:
        shapes = collect_tracked(
            hf_weight_buckets(model, cfg, bucket_bytes=bucket_bytes, dtype=dtype, stats=tracked_stats), tracker)
    stats = RefitStats()
    got, order, sizes, ok, dups = collect(
        hf_weight_buckets(model, cfg, bucket_bytes=bucket_bytes, dtype=dtype, stats=stats), bucket_bytes)
    cmp = compare(got, want, dtype)
    model_bytes = sum(t.numel() * t.to(dtype or t.dtype).element_size() for t in want.values())
    return dict(exact=exact(cmp), cmp=cmp, bucket_ok=ok, duplicates=dups, buckets=len(sizes),
                max_bucket=max(sizes), oversized=sum(s > bucket_bytes for s in sizes),
                peak=stats.peak_buffered_bytes, bound=bucket_bytes + stats.max_tensor_bytes,
                stats_buckets=stats.buckets, stats_bytes=stats.bytes, want_bytes=model_bytes,
                shapes=shapes, tracked_peak=tracker.peak, tracked_parts=tracker.peak_parts,
                tracked_bound=bucket_bytes + tracked_stats.max_tensor_bytes), got, order


def case(family, parallel, want, full):
    cfg = configs()[family]
    local = shard_state_dict(full, parallel, **{f"{k}_rank": v for k, v in coords().items()})
    model = build(family)
    model.load_state_dict(local, strict=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    param_storage = {p.untyped_storage().data_ptr() for p in model.parameters()}
    res = {}
    res["small"], got, order = check_stream(model, cfg, want, SMALL)
    res["no_alias"] = all(t.untyped_storage().data_ptr() not in param_storage for t in order)
    with torch.no_grad():
        for t in order:  # an engine may do anything with what it is given
            t.add_(1.0).mul_(-3.0)
    res["model_unchanged"] = all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    del got, order
    res["huge"] = check_stream(model, cfg, want, HUGE)[0]
    res["bf16"] = check_stream(model, cfg, want, SMALL, torch.bfloat16)[0]
    res["after_mutation"] = check_stream(model, cfg, want, SMALL)[0]["exact"]
    with GatherTracker() as tracker:
        collect_tracked(hf_weight_buckets(model, cfg, bucket_bytes=SMALL), tracker, hoard=True)
    res["hoard_peak"] = tracker.peak
    return model, res


def perturbed(model, cfg, want, where, name):
    """Add 1 to parameter ``name`` on the ranks at coordinate ``where``, stream, restore; the differing HF names."""
    axis, index = where
    param = dict(model.named_parameters())[name]
    saved = param.detach().clone()
    if coords()[axis] == index:
        with torch.no_grad():
            param.add_(1.0)
    got = collect(hf_weight_buckets(model, cfg, bucket_bytes=SMALL), SMALL)[0]
    with torch.no_grad():
        param.copy_(saved)
    cmp = compare(got, want)
    return dict(wrong_value=sorted(cmp["wrong_value"]), other=exact({k: v for k, v in cmp.items()
                                                                    if k != "wrong_value"}))


def via_policy(model, cfg, want):
    policy = MegatronPolicy(model, torch.optim.SGD(model.parameters(), lr=0.0), micro_batch_size=1, hf_config=cfg)
    stats = RefitStats()
    got, order, sizes, ok, dups = collect(policy.hf_weight_buckets(SMALL, stats=stats), SMALL)
    param_storage = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return dict(exact=exact(compare(got, want)), bucket_ok=ok, duplicates=dups, buckets=len(sizes),
                spec=policy.hf_spec, no_alias=all(t.untyped_storage().data_ptr() not in param_storage for t in order))


def main():
    dist.init_process_group("gloo")
    wants = {f: hf_checkpoint(f) for f in FAMILIES}
    fulls = {f: hf_to_megatron(wants[f], configs()[f], padded_vocab=PADDED_VOCAB) for f in FAMILIES}
    out = {}
    for layout, (parallel, families) in LAYOUTS.items():
        initialize_parallel(parallel.tp, parallel.pp, parallel.ep)
        p_family, where, name, expected = PERTURB[layout]
        for family in families:
            model, out[f"{layout}/{family}"] = case(family, parallel, wants[family], fulls[family])
            if family == p_family:
                out[f"perturb/{layout}"] = dict(perturbed(model, configs()[family], wants[family], where, name),
                                                expected=sorted(expected))
            if family == families[-1]:
                out[f"policy/{layout}/{family}"] = via_policy(model, configs()[family], wants[family])
            del model
        destroy_parallel()
    with open(os.path.join(os.environ["OUT_DIR"], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(out, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
