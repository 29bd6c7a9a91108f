"""HF <-> megatron-core conversion parity under torchrun (2 ranks, gloo, fp32).

For every tiny family of convert_models: the HF logits of one batch; the HF state dict converted to a single-rank
megatron state dict (vocabulary padded 250 -> 256), cut for this rank by convert_shard, loaded with strict=True
into the GPTModel built by convert_build, and run. Layouts: tp1 (every family; DP=2), tp2 (every family; MoE
experts TP-split, ETP=2), pp2 (llama: tied embeddings across stages; mixtral), ep2 (mixtral, qwen2_moe; DP=2).
Per case, on every rank:
  * max |megatron logits - HF logits| over the real vocabulary (the last pipeline stage; NaN elsewhere);
  * the per-rank state dict equals the one that model.load_full_state_dict (an independent split that reads
    megatron's own partition attributes) puts into the same model;
  * every rank's state dict, gathered and merged, gives back the single-rank state dict exactly, and that converts
    back to the HF state dict exactly.
Mutations (must fail the parity check, proving it can): tp1/llama_naive_qkv (q, k, v concatenated without the
per-group interleave), tp2/qwen2_unpaired_fc1 (linear_fc1 split in contiguous halves, breaking gate/up pairs).
Also megatron's own TE-spec rename map (sharded_state_dict_keys_map). Results: $OUT_DIR/rank{r}.json.
"""
import json
import os

import tests.support.megatron_cpu_shim  # noqa: F401  (before megatron)

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

from tests.support.megatron_convert import hf_to_megatron, megatron_to_hf
from nemo_dapo.megatron.convert_build import gpt_model_from_hf
from nemo_dapo.megatron.convert_shard import Parallel, tp_shard
from tests.support.megatron_convert import merge_state_dicts, shard_state_dict
from tests.support.megatron_model import destroy_parallel, initialize_parallel, load_full_state_dict
from tests.megatron.workers.convert_models import PADDED_VOCAB, VOCAB, configs, tiny_model, tokens

LAYOUTS = {"tp1": (Parallel(), ("llama", "qwen2", "mixtral", "qwen2_moe")),
           "tp2": (Parallel(tp=2), ("llama", "qwen2", "mixtral", "qwen2_moe")),
           "pp2": (Parallel(pp=2), ("llama", "mixtral")),
           "ep2": (Parallel(ep=2), ("mixtral", "qwen2_moe"))}


def build(family):
    model = gpt_model_from_hf(configs()[family], padded_vocab=PADDED_VOCAB, parallel_output=False,
                              use_cpu_initialization=True, params_dtype=torch.float32,
                              moe_token_dispatcher_type="alltoall")
    return model.eval()


@torch.no_grad()
def forward(model, ids):
    """Full logits [b, s, V] on the last pipeline stage (None elsewhere); stages pass hidden states by p2p."""
    b, s = ids.shape
    pos = torch.arange(s)[None].expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    if not ps.is_pipeline_first_stage():
        hidden = torch.empty(s, b, model.config.hidden_size)
        dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden)
    out = model(ids, pos, mask)
    if not ps.is_pipeline_last_stage():
        dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        return None
    return out


def max_diff(logits, want):
    return float("nan") if logits is None else (logits[..., :VOCAB] - want).abs().max().item()


def coords():
    return (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
            ps.get_expert_model_parallel_rank())


def case(family, parallel, hf_state, full, want):
    tp_rank, pp_rank, ep_rank = coords()
    local = shard_state_dict(full, parallel, tp_rank=tp_rank, pp_rank=pp_rank, ep_rank=ep_rank)
    model = build(family)
    model.load_state_dict(local, strict=True)
    res = {"max_diff": max_diff(forward(model, tokens()), want), "logit_scale": want.abs().max().item()}
    other = build(family)
    load_full_state_dict(other, full)
    theirs = {n: t for n, t in other.state_dict().items() if not n.endswith("_extra_state")}
    res["same_as_load_full_state_dict"] = sorted(theirs) == sorted(local) and all(
        torch.equal(theirs[n], local[n]) for n in local)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (coords(), local))
    merged = merge_state_dicts(dict(gathered), parallel, tied=configs()[family].tie_word_embeddings)
    res["merge_exact"] = sorted(merged) == sorted(full) and all(torch.equal(merged[n], full[n]) for n in full)
    back = megatron_to_hf(merged, configs()[family])
    res["hf_roundtrip_exact"] = all(torch.equal(back[n], hf_state[n]) for n in back) and set(back) <= set(hf_state)
    return res


def mutation(name, full, family, parallel):
    """A deliberately wrong conversion of ``full`` for this rank."""
    tp_rank = ps.get_tensor_model_parallel_rank()
    local = shard_state_dict(full, parallel, tp_rank=tp_rank)
    if name == "naive_qkv":
        cfg = configs()[family]
        hf = tiny_model(family).state_dict()
        for i in range(cfg.num_hidden_layers):
            qkv = [hf[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qkv"]
            local[f"decoder.layers.{i}.self_attention.linear_qkv.weight"] = torch.cat(qkv)
    elif name == "unpaired_fc1":
        for n, t in full.items():
            if n.endswith("mlp.linear_fc1.weight"):
                local[n] = tp_shard(t, 0, 1, parallel.tp, tp_rank)
    model = build(family)
    model.load_state_dict(local, strict=True)
    return model


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    refs = {}
    for family in configs():
        hf = tiny_model(family)
        with torch.no_grad():
            want = hf(tokens()).logits
        hf_state = {n: t.detach().clone() for n, t in hf.state_dict().items()}
        refs[family] = (hf_state, hf_to_megatron(hf_state, configs()[family], padded_vocab=PADDED_VOCAB), want)
    out = {}
    for layout, (parallel, families) in LAYOUTS.items():
        initialize_parallel(parallel.tp, parallel.pp, parallel.ep)
        for family in families:
            out[f"{layout}/{family}"] = case(family, parallel, *refs[family])
        for mut_layout, family, name in (("tp1", "llama", "naive_qkv"), ("tp2", "qwen2", "unpaired_fc1")):
            if mut_layout == layout:
                model = mutation(name, refs[family][1], family, parallel)
                out[f"mutation/{layout}/{family}_{name}"] = {"max_diff": max_diff(forward(model, tokens()),
                                                                                   refs[family][2])}
        destroy_parallel()
    out["te_keys_map"] = get_gpt_layer_local_spec().submodules.sharded_state_dict_keys_map
    with open(os.path.join(os.environ["OUT_DIR"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
