"""Qwen3 / Qwen3-MoE conversion parity under torchrun (2 ranks, gloo, fp32), through the checkpoint files the
conversion command writes (nemo_dapo.megatron.convert_ckpt). Needs $OUT_DIR prepared by qwen3_hf_worker.py make
(OUT/<family>/hf: a transformers-5 checkpoint; OUT/<family>/hf_logits.pt: its logits).

HF -> NeMo: for each conversion layout C (tp2, pp2, ep2 for the MoE), ``hf_to_nemo`` writes OUT/<family>/nemo_<C>;
that checkpoint is loaded (``load_nemo_weights``) in EVERY layout L (tp1 = DP 2, tp2, pp2, ep2) and run:
max |megatron logits - HF logits| on the real vocabulary (last stage). Also the direct per-rank conversion
(``hf_to_megatron_shard``, no file) in each layout.
NeMo -> HF: in each layout C a model with megatron-side random weights (not from the HF checkpoint: a full
single-rank state dict of random tensors, cut by ``load_full_state_dict``), its logits to
OUT/<family>/mc_<C>/megatron_logits.pt, saved as a NeMo checkpoint, then ``nemo_to_hf`` in another layout writes
OUT/<family>/mc_<C>/hf, which qwen3_hf_worker.py check loads with transformers.
Mutation (must fail): a QK-norm-less conversion (q/k norm weights set to 1) in tp1. Results: OUT/rank{r}.json.
"""
import json
import os

from tests.support import nemo_cpu  # noqa: F401  (CPU patches: megatron shim, torch 2.13's DCP writer)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402

from nemo_dapo.megatron.convert import load_hf_config  # noqa: E402
from tests.support.megatron_convert import hf_to_megatron  # noqa: E402
from nemo_dapo.megatron.convert_ckpt import (SafetensorsReader, build_model, hf_to_nemo, load_nemo_weights,  # noqa
                                             nemo_model_config, nemo_to_hf, save_nemo_checkpoint)
from nemo_dapo.megatron.convert_build import gpt_model_from_hf  # noqa: E402
from nemo_dapo.megatron.convert_shard import Parallel, hf_to_megatron_shard  # noqa: E402
from tests.support.dist import forbid_fork  # noqa: E402
from tests.support.megatron_model import destroy_parallel, initialize_parallel, load_full_state_dict  # noqa: E402
from tests.megatron.workers.convert_parity_worker import forward  # noqa: E402
from tests.megatron.workers.qwen3_models import CONFIGS, PADDED_VOCAB, VOCAB, tokens  # noqa: E402

OUT = os.environ["OUT_DIR"]
LAYOUTS = {"tp1": Parallel(), "tp2": Parallel(tp=2), "pp2": Parallel(pp=2), "ep2": Parallel(ep=2)}
nemo_cpu.allow_full_checkpoint_loads()


def layouts(family):
    return [k for k in LAYOUTS if k != "ep2" or "moe" in family]


def use(layout):
    if ps.model_parallel_is_initialized():
        destroy_parallel()
    p = LAYOUTS[layout]
    initialize_parallel(p.tp, p.pp, p.ep)
    return p


def model_for(family):
    return build_model(load_hf_config(os.path.join(OUT, family, "hf")), padded_vocab=PADDED_VOCAB,
                       dtype=torch.float32, parallel_output=False)


def max_diff(logits, want):
    return None if logits is None else (logits[..., :VOCAB] - want).abs().max().item()


def coords():
    return ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank()


def random_full_state(family, seed):
    """A single-rank megatron state dict of random tensors (names and shapes of the family; values unrelated to the
    HF checkpoint): norms 1 + N(0, 0.2^2), embedding N(0, 1), others N(0, 1/fan_in); padded vocabulary rows 0."""
    shapes = hf_to_megatron(SafetensorsReader(os.path.join(OUT, family, "hf")), load_hf_config(
        os.path.join(OUT, family, "hf")), padded_vocab=PADDED_VOCAB)
    g, full = torch.Generator().manual_seed(seed), {}
    for name, t in shapes.items():
        noise = torch.randn(t.shape, generator=g)
        if "norm" in name:
            full[name] = 1 + 0.2 * noise
        elif name.startswith("embedding."):
            full[name] = noise
        else:
            full[name] = noise / t.shape[-1] ** 0.5
        if name.startswith(("embedding.", "output_layer.")):
            full[name][VOCAB:] = 0
    return full


def hf_direction(family, res):
    hf_dir, want = os.path.join(OUT, family, "hf"), torch.load(os.path.join(OUT, family, "hf_logits.pt"))
    cfg = load_hf_config(hf_dir)
    for layout in layouts(family):
        p = use(layout)
        t, s, e = coords()
        model = model_for(family)
        model.load_state_dict(hf_to_megatron_shard(SafetensorsReader(hf_dir), cfg, p, tp_rank=t, pp_rank=s,
                                                   ep_rank=e, padded_vocab=PADDED_VOCAB), strict=True)
        res[f"{family}/direct/{layout}"] = max_diff(forward(model, tokens()), want)
        if layout != "tp1":
            hf_to_nemo(hf_dir, os.path.join(OUT, family, f"nemo_{layout}"), dtype="fp32", padded_vocab=PADDED_VOCAB)
    for saved in layouts(family):
        if saved == "tp1":
            continue
        for layout in layouts(family):
            use(layout)
            model = model_for(family)
            load_nemo_weights(model, os.path.join(OUT, family, f"nemo_{saved}"))
            res[f"{family}/nemo_{saved}/load_{layout}"] = max_diff(forward(model, tokens()), want)
    use("tp1")
    model = model_for(family)
    norm = model.decoder.layers[0].self_attention.q_layernorm
    res[f"{family}/qk_norm"] = [type(norm).__name__, list(norm.normalized_shape), norm.eps]
    load_nemo_weights(model, os.path.join(OUT, family, "nemo_tp2"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "q_layernorm" in name or "k_layernorm" in name:
                param.fill_(1.0)
    res[f"mutation/{family}/no_qk_norm"] = max_diff(forward(model, tokens()), want)


def megatron_direction(family, res):
    hf_dir = os.path.join(OUT, family, "hf")
    cfg = load_hf_config(hf_dir)
    names = [k for k in layouts(family) if k != "tp1"]  # the conversion runs on exactly tp x pp x ep ranks
    for i, layout in enumerate(names):
        p = use(layout)
        # megatron's own initialisation sets the split attributes that load_full_state_dict reads
        model = gpt_model_from_hf(cfg, padded_vocab=PADDED_VOCAB, parallel_output=False, use_cpu_initialization=True,
                                  params_dtype=torch.float32, moe_token_dispatcher_type="alltoall").eval()
        load_full_state_dict(model, random_full_state(family, seed=100 + i))
        logits = forward(model, tokens())
        case = os.path.join(OUT, family, f"mc_{layout}")
        if logits is not None and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
            os.makedirs(case, exist_ok=True)
            torch.save(logits[..., :VOCAB].clone(), os.path.join(case, "megatron_logits.pt"))
        nemo_cfg = nemo_model_config(cfg, p, precision="fp32", padded_vocab=PADDED_VOCAB)
        save_nemo_checkpoint(model, os.path.join(case, "nemo"), nemo_cfg=nemo_cfg,
                             hf_config_file=os.path.join(hf_dir, "config.json"))
        export = names[(i + 1) % len(names)]  # export in another layout than the one that saved
        use(export)
        nemo_to_hf(os.path.join(case, "nemo"), os.path.join(case, "hf"))
        res[f"{family}/mc_{layout}/export_layout"] = export


def main():
    forbid_fork()  # ~20 checkpoint saves: none may fork from this multi-threaded rank (dist_save.py)
    dist.init_process_group("gloo")
    res = {}
    for family in CONFIGS:
        hf_direction(family, res)
        megatron_direction(family, res)
    destroy_parallel()
    with open(os.path.join(OUT, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(res, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
