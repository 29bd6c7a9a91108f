"""plan_model.py (GPUs, architectures and presets, layouts, training FLOPs) and the memory phases of the engine
path (refit, results exchange, what is offloaded) against hand computations."""
import math

import pytest
from omegaconf import OmegaConf

from nemo_dapo.cluster import plan as P
from nemo_dapo.cluster import plan_model as M
from nemo_dapo.cluster.config_load import load_config
from nemo_dapo.cluster.plan_shapes import Arch, Layout

ES = "trainer.dapo.engine_server"


def plan_of(recipe, *overrides):
    return P.make_plan(OmegaConf.to_container(load_config(recipe, overrides), resolve=True))


def tensor_shapes(arch: M.Arch):
    """The slow obvious reference: every weight tensor of the model as a shape, like a Hugging Face state dict."""
    h, d = arch.hidden_size, arch.kv_channels
    q, kv = arch.num_attention_heads * d, arch.num_query_groups * d
    yield (arch.vocab_size, h)
    for _ in range(arch.num_layers):
        yield from [(h,), (q, h), (kv, h), (kv, h), (h, q), (h,)]
        if arch.qkv_bias:
            yield from [(q,), (kv,), (kv,)]
        if arch.qk_norm:
            yield from [(d,), (d,)]  # q_norm, k_norm over the head dimension
        if arch.is_moe:
            yield (arch.num_moe_experts, h)
            for _ in range(arch.num_moe_experts):
                yield from [(arch.moe_ffn_hidden_size, h)] * 2 + [(h, arch.moe_ffn_hidden_size)]
            if arch.moe_shared_expert_size:
                yield from [(arch.moe_shared_expert_size, h)] * 2 + [(h, arch.moe_shared_expert_size)]
        else:
            yield from [(arch.ffn_hidden_size, h)] * 2 + [(h, arch.ffn_hidden_size)]
    yield (h,)
    if not arch.tied_embeddings:
        yield (arch.vocab_size, h)


@pytest.mark.parametrize("name", sorted(M.ARCH_PRESETS))
def test_preset_param_count_equals_the_sum_over_tensors(name):
    arch = M.ARCH_PRESETS[name]
    assert arch.total_params() == sum(math.prod(s) for s in tensor_shapes(arch))


@pytest.mark.parametrize("name,total,active", [
    ("qwen3-32b", 32.8e9, 32.8e9), ("qwen3-30b-a3b", 30.5e9, 3.3e9), ("qwen3-235b-a22b", 235.1e9, 22.2e9),
    ("llama3.1-8b", 8.03e9, 8.03e9), ("qwen2.5-math-7b", 7.62e9, 7.62e9), ("mixtral-8x22b", 140.6e9, 39.2e9)])
def test_presets_match_the_published_sizes(name, total, active):
    arch = M.ARCH_PRESETS[name]
    assert arch.total_params() == pytest.approx(total, rel=0.01)
    assert arch.active_params() == pytest.approx(active, rel=0.02)


def test_qwen3_head_dim_is_not_hidden_over_heads():
    arch = M.ARCH_PRESETS["qwen3-32b"]
    assert arch.head_dim == 128 != arch.hidden_size // arch.num_attention_heads  # 5120 / 64 = 80
    # q and o are hidden x heads x head_dim = 5120 x 8192, not 5120 x 5120
    assert arch.attention_params() == 2 * 5120 * 8192 + 2 * 5120 * 1024 + 2 * 128
    assert arch.kv_bytes_per_token() == 2 * 64 * 8 * 128 * 2


def test_shared_expert_counts_as_always_active():
    base = M.ARCH_PRESETS["qwen3-30b-a3b"]
    shared = M.Arch(**{**base.__dict__, "moe_shared_expert_size": 1024})
    extra = base.num_layers * 3 * base.hidden_size * 1024
    assert shared.total_params() - base.total_params() == extra == shared.active_params() - base.active_params()


def test_gpu_entries_carry_vendor_figures():
    g = M.GPUS
    assert (g["h200"].memory_gb, g["h200"].hbm_tb_s, g["h200"].bf16_tflops) == (141.0, 4.8, 989.0)
    assert (g["b200"].memory_gb, g["b200"].hbm_tb_s, g["b200"].bf16_tflops) == (180.0, 8.0, 2250.0)
    assert (g["gb200"].memory_gb, g["gb200"].hbm_tb_s, g["gb200"].bf16_tflops) == (186.0, 8.0, 2500.0)
    assert all(gpu.source for gpu in g.values())


def test_update_is_6n_without_recompute_and_8n_with_it():
    arch, gpu = M.ARCH_PRESETS["qwen3-32b"], M.GPUS["h100"]
    kw = dict(world=32, tokens=1e6, seq_len=3000, hfu=0.4, logprob_hfu=0.2)
    off, on = (M.training_seconds(arch, gpu, recompute=r, **kw) for r in (False, True))
    attn = arch.attention_flops_per_token(3000)
    assert off["training"] * 32 * 989e12 * 0.4 == pytest.approx(1e6 * (6 * arch.active_params() + 3 * attn))
    assert on["training"] * 32 * 989e12 * 0.4 == pytest.approx(1e6 * (8 * arch.active_params() + 4 * attn))
    assert off["reference_logprob"] == 0.0
    ref = M.training_seconds(arch, gpu, recompute=False, logprob_passes=2, **kw)
    assert ref["reference_logprob"] == pytest.approx(ref["old_logprob"]) == pytest.approx(off["old_logprob"])
    stretched = M.training_seconds(arch, gpu, recompute=False, bubble=0.25, **kw)
    assert stretched["training"] == pytest.approx(1.25 * off["training"])


def test_expert_tensor_parallelism_other_than_tp():
    arch = M.ARCH_PRESETS["qwen3-235b-a22b"]
    etp_tp = M.Layout(world=128, tp=2, pp=8, cp=2, ep=8)  # NeMo 2.1: ETP = TP
    etp1 = M.Layout(world=128, tp=2, pp=8, cp=2, ep=16, etp=1)  # NeMo-RL's layout
    assert (etp_tp.expert_dp, etp1.expert_dp) == (1, 1)
    _, e_tp = M.params_per_gpu(arch, etp_tp)
    _, e_1 = M.params_per_gpu(arch, etp1)
    assert e_1 == pytest.approx(e_tp) == pytest.approx(12 * 128 * 3 * 4096 * 1536 / 16)


def test_context_parallelism_shards_activations_and_optimizer():
    arch = M.ARCH_PRESETS["qwen2.5-32b"]
    kw = dict(seq_tokens=22528, in_flight=1, recompute="full", distributed_optimizer=True, grad_bytes=4)
    cp1 = M.training_memory(arch, M.Layout(world=128, tp=8, pp=1, sequence_parallel=True), **kw)
    cp2 = M.training_memory(arch, M.Layout(world=128, tp=8, pp=1, cp=2, sequence_parallel=True), **kw)
    assert cp2["activations"] == pytest.approx(cp1["activations"] / 2)
    assert cp2["optimizer"] == pytest.approx(cp1["optimizer"])  # d = DP x CP: 8 x 2 = 16 x 1
    assert cp2["weights"] == cp1["weights"]


def test_chunked_logprob_logits():
    arch, lay = M.ARCH_PRESETS["qwen2.5-32b"], M.Layout(world=128, tp=8, pp=1)
    kw = dict(seq_tokens=22528, in_flight=1, recompute="full", distributed_optimizer=True, grad_bytes=4)
    assert M.training_memory(arch, lay, logprob_chunk=256, **kw)["logits"] == 3 * 256 * 152064 / 8 * 4
    assert M.training_memory(arch, lay, **kw)["logits"] == 22528 * 152064 / 8 * 4


def test_preset_in_a_config_and_disagreement_refused():
    plan = plan_of("qwen2.5-32b_h100", *(f"plan.arch.{k}=null" for k in ("num_layers", "hidden_size",
                   "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "vocab_size")),
                   "plan.arch.qkv_bias=False", "plan.arch.preset=qwen2.5-32b")
    assert plan["arch"] == M.ARCH_PRESETS["qwen2.5-32b"]
    with pytest.raises(P.PlanError, match=r"plan.arch.num_layers=64 disagrees with plan.arch.preset=qwen3-30b-a3b"):
        plan_of("qwen2.5-32b_h100", "plan.arch.preset=qwen3-30b-a3b")
    with pytest.raises(P.PlanError, match="plan.arch.preset='qwen9' is not one of"):
        plan_of("qwen2.5-32b_h100", "plan.arch.preset=qwen9")


def test_refit_phase_by_hand():
    plan = plan_of("qwen2.5-32b_h100")
    refit, train = plan["phases"]["refit"], plan["phases"]["train"]
    assert "kv_cache" not in refit and "activations" not in refit  # KV asleep, training peak released
    assert refit["engine_weights"] == pytest.approx(2 * M.ARCH_PRESETS["qwen2.5-32b"].total_params() / 8)
    assert refit["refit_buckets"] == 2 * 512 * 2 ** 20  # engine_server.bucket_mb: trainer gather + engine copy
    assert refit["weights"] == train["weights"] and refit["grads"] == train["grads"]
    assert refit["optimizer"] == 0.0 < train["optimizer"]  # apex distributed Adam, offload_adam_states True
    assert sum(refit.values()) <= plan["budget"]


def test_results_exchange_by_hand():
    plan = plan_of("qwen2.5-32b_h100")
    rows = 1536 * 16 / 16  # max_gen_batch_size x group_size over DP 16; one engine owner per TP8 group
    assert plan["phases"]["generate"]["results_gather"] == rows * (8 * 20481 + 4 * 20480 * 2)


def test_adam_states_stay_resident_unless_the_code_offloads_them():
    kept = plan_of("qwen2.5-32b_h100", "model.dapo.offload_adam_states=False")["phases"]
    assert kept["generate"]["optimizer"] == kept["refit"]["optimizer"] == kept["train"]["optimizer"] > 0
    mcore = plan_of("moe-mixtral-8x22b_h100")["phases"]  # Megatron's optimizer (EP) is never offloaded
    assert mcore["generate"]["optimizer"] == mcore["train"]["optimizer"] > 10e9



def test_training_state_offload_is_planned_from_the_trainers_key():
    """model.dapo.offload_training_state (what aligner/training_offload.py does): nothing of the training state
    while generating; the refit keeps the weights it gathers, grads and optimizer states are gone before it."""
    base = plan_of("moe-mixtral-8x22b_h100")["phases"]
    whole = plan_of("moe-mixtral-8x22b_h100", "model.dapo.offload_training_state=True")["phases"]
    assert whole["generate"]["weights"] == whole["generate"]["grads"] == whole["generate"]["optimizer"] == 0.0
    assert whole["refit"]["weights"] == base["refit"]["weights"] == base["train"]["weights"] > 0
    assert whole["refit"]["grads"] == whole["refit"]["optimizer"] == 0.0 < base["refit"]["optimizer"]
    assert whole["train"] == base["train"]  # training itself holds everything either way


def test_the_planners_former_offload_key_is_refused_naming_the_trainers():
    with pytest.raises(P.PlanError, match="plan.generate_offload is not read any more.*"
                                          "model.dapo.offload_training_state=True"):
        plan_of("moe-mixtral-8x22b_h100", "+plan.generate_offload=training_state")


def test_refit_that_does_not_fit_is_refused_naming_the_key():
    with pytest.raises(P.PlanError, match=f"refit phase needs .* fix: lower {ES}.bucket_mb"):
        plan_of("moe-mixtral-8x22b_h100", f"{ES}.bucket_mb=8192")


def test_engine_across_nodes_is_refused():
    with pytest.raises(P.PlanError, match="engines must not span nodes"):
        plan_of("qwen2.5-32b_h100", f"{ES}.tensor_parallel_size=16")


@pytest.mark.parametrize("recipe", ["qwen2.5-32b_h100", "qwen2.5-32b_h20", "moe-mixtral-8x22b_h100",
                                    "moe-mixtral-8x22b_h20"])
def test_every_recipe_prints_three_phases_that_fit(recipe, capsys):
    import argparse

    ap = argparse.ArgumentParser()
    P.add_cli(ap.add_subparsers())
    args = ap.parse_args(["plan", recipe])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("per-GPU memory"))
    assert header.split("(on the host")[0].split()[-3:] == ["train", "refit", "generate"]
    plan = plan_of(recipe)
    assert set(plan["phases"]) == {"train", "refit", "generate"}
    assert all(sum(p.values()) <= plan["budget"] for p in plan["phases"].values())


ALLTOALL_LAYOUTS = [  # (world, GPUs a node, TP = ETP, EP, PP): the recipes' and the edges
    (128, 8, 4, 16, 2),  # qwen3-235b-a22b: 8 nodes
    (32, 8, 2, 8, 1),  # qwen3-30b-a3b: 2 nodes, half the peers at home
    (128, 8, 8, 8, 2),  # mixtral 8x22b: ETP8, one EP peer a node
    (48, 8, 1, 24, 1),  # 3 nodes of 8 peers
    (64, 4, 2, 8, 2),  # 4-GPU nodes
    (64, 8, 16, 2, 1),  # ETP wider than a node
    (32, 8, 2, 4, 1),  # the EP group inside a node: nothing crosses
]


@pytest.mark.parametrize("world,devices,tp,ep,pp", ALLTOALL_LAYOUTS)
def test_expert_alltoall_against_megatron_cores_rank_layout(world, devices, tp, ep, pp):
    """The slow reference: megatron-core's own RankGenerator places every EP group; each rank sends its sequence
    shard's tokens top-k times through every layer of its stage, spread evenly over the group's ranks; count the
    bytes whose destination sits on another node (rank // devices)."""
    RankGenerator = pytest.importorskip("megatron.core.parallel_state").RankGenerator
    arch = M.ARCH_PRESETS["qwen3-235b-a22b"]
    layout = M.Layout(world=world, tp=tp, pp=pp, ep=ep, sequence_parallel=tp > 1)
    tokens = 1.5e8
    got = M.expert_alltoall(arch, layout, tokens=tokens, devices=devices, gb_per_s=40.0)
    order = "tp-cp-ep-dp-pp"
    groups = RankGenerator(tp=tp, ep=ep, dp=world // (tp * ep * pp), pp=pp, cp=1, order=order).get_ranks("ep")
    assert sorted(r for g in groups for r in g) == list(range(world))
    per_rank_tokens = tokens / (layout.dp * tp)  # each DP rank's tokens, split over its TP ranks (SP)
    crossing, spans = {}, set()
    for group in groups:
        spans.add(len({q // devices for q in group}))
        for r in group:
            layers = math.ceil(arch.num_layers / pp)
            away = sum(q // devices != r // devices for q in group) / ep
            crossing[r] = per_rank_tokens * layers * arch.moe_router_topk * arch.hidden_size * 2 * away
    assert len(set(round(v) for v in crossing.values())) == 1  # every GPU sends the same
    assert got["bytes"] == pytest.approx(crossing[0], rel=1e-12)
    assert got["seconds"] == pytest.approx(crossing[0] / 40e9, rel=1e-12)
    assert spans == {got["nodes"]}
    if crossing[0] == 0:
        assert got == {"nodes": 1, "off_node": 0.0, "bytes": 0.0, "seconds": 0.0}


def test_expert_alltoall_is_zero_for_dense_models_and_scales_with_the_tokens_per_gpu():
    moe, dense = M.ARCH_PRESETS["qwen3-235b-a22b"], M.ARCH_PRESETS["qwen2.5-32b"]
    lay = M.Layout(world=128, tp=4, pp=2, ep=16, sequence_parallel=True)
    assert M.expert_alltoall(dense, M.Layout(world=128, tp=8, pp=2), tokens=1e8, devices=8,
                             gb_per_s=40.0)["seconds"] == 0.0
    one = M.expert_alltoall(moe, lay, tokens=1e8, devices=8, gb_per_s=40.0)["seconds"]
    assert M.expert_alltoall(moe, M.Layout(world=256, tp=4, pp=2, ep=16, sequence_parallel=True), tokens=1e8,
                             devices=8, gb_per_s=40.0)["seconds"] == pytest.approx(one / 2)
    assert M.expert_alltoall(moe, lay, tokens=1e8, devices=8, gb_per_s=80.0)["seconds"] == pytest.approx(one / 2)


@pytest.mark.parametrize("recompute,passes,bubble", [(False, 1, 0.0), (True, 1, 0.0), (True, 2, 0.25)])
def test_training_seconds_charge_the_alltoall_per_send(recompute, passes, bubble):
    arch, gpu = M.ARCH_PRESETS["qwen3-30b-a3b"], M.GPUS["h100"]
    kw = dict(world=32, tokens=1e8, seq_len=6000, hfu=0.25, logprob_hfu=0.125, recompute=recompute,
              logprob_passes=passes, bubble=bubble)
    base, more = M.training_seconds(arch, gpu, **kw), M.training_seconds(arch, gpu, **kw, alltoall_s=10.0)
    stretch = 1 + bubble
    assert more["old_logprob"] - base["old_logprob"] == pytest.approx(2 * 10.0 * stretch)
    assert more["reference_logprob"] - base["reference_logprob"] == pytest.approx((passes - 1) * 2 * 10.0 * stretch)
    assert more["training"] - base["training"] == pytest.approx((6 if recompute else 4) * 10.0 * stretch)


def test_the_plan_charges_and_prints_the_alltoall_of_an_ep_group_across_nodes(capsys):
    from tests.cluster.test_plan import run_cli

    fast = "plan.assume.alltoall_gb_per_s=1e9"  # the same plan with the all-to-all almost free
    plan, free = plan_of("qwen3-235b-a22b_h100"), plan_of("qwen3-235b-a22b_h100", fast)
    a2a = plan["time"]["alltoall"]
    assert a2a["nodes"] == 8 and a2a["off_node"] == pytest.approx(1 - 2 / 16)
    assert plan["time"]["total"] - free["time"]["total"] == pytest.approx(a2a["step_seconds"], rel=1e-6)
    trainer = lambda p: p["layouts"]["disaggregated"]  # noqa: E731
    if "refused" not in trainer(plan):
        assert trainer(plan)["train_side"] > trainer(free)["train_side"]
    assert plan_of("qwen2.5-32b_h100")["time"]["alltoall"]["seconds"] == 0.0
    assert run_cli("qwen3-235b-a22b_h100") == 0
    out = " ".join(capsys.readouterr().out.split())  # the report wraps its lines
    assert "of which MoE all-to-all across nodes" in out and "EP16 x ETP4 = 64 GPUs span 8 nodes" in out
    assert run_cli("qwen2.5-32b_h100") == 0
    assert "all-to-all across nodes" not in capsys.readouterr().out


TINY_MOE = Arch(num_layers=2, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2, num_query_groups=1,
                kv_channels=4, vocab_size=10, num_moe_experts=8, moe_ffn_hidden_size=4, moe_router_topk=2)
TINY_DENSE = Arch(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                  kv_channels=16, vocab_size=100)


def test_alltoall_tokens_a_gpu_are_split_over_context_parallel_ranks():
    # 16 GPUs = DP 8 x CP 2 (TP = PP = 1): 1600 tokens -> 100 a GPU; each sent to top-2 experts in 2 layers at
    # hidden 8 x 2 B = 100 * 2 * 2 * 8 * 2 = 6400 B; EP 8 over 4-GPU nodes: 4 peers on the node -> half leaves it.
    a2a = M.expert_alltoall(TINY_MOE, Layout(world=16, tp=1, pp=1, cp=2, ep=8, etp=1), tokens=1600, devices=4,
                          gb_per_s=1.0)
    assert a2a["off_node"] == 0.5 and a2a["nodes"] == 2
    assert a2a["bytes"] == pytest.approx(3200.0)


def test_no_allreduce_is_charged_without_tensor_parallelism():
    kw = dict(batch=4, context=100.0, efficiency=0.75)
    h100 = M.GPUS["h100"]
    tp1 = [P.decode_step_seconds(TINY_DENSE, h100, gen_tp=1, gen_pp=1, allreduce_s=s, **kw) for s in (0.0, 1.0)]
    assert tp1[0] == tp1[1]
    tp2 = [P.decode_step_seconds(TINY_DENSE, h100, gen_tp=2, gen_pp=1, allreduce_s=s, **kw) for s in (0.0, 1.0)]
    assert tp2[1] - tp2[0] == pytest.approx(2 * TINY_DENSE.num_layers * 1.0)  # two all-reduces a layer


def test_the_pipeline_bubble_is_pp_minus_one_over_the_micro_batches():
    cfg = {"model": {"micro_batch_size": 1, "encoder_seq_length": 100, "dapo": {}}}
    # PP 4, DP 2: 1600 tokens an update -> 800 a DP rank -> 8 micro-batches of 100 -> bubble (4 - 1) / 8
    assert P._pipeline_bubble(cfg, Layout(world=8, tp=1, pp=4), 1600) == pytest.approx(3 / 8)
    assert P._pipeline_bubble(cfg, Layout(world=8, tp=1, pp=1), 1600) == 0.0


def test_micro_batches_in_flight_are_counted_per_data_parallel_rank():
    # world 16 = TP 1 x PP 4 x DP 4; global batch 8 of micro-batch 1 -> 2 micro-batches a DP rank, so 2 in flight
    # on stage 0 (fewer than PP = 4)
    cfg = {"model": {"micro_batch_size": 1, "global_batch_size": 8, "encoder_seq_length": 256,
                     "activations_checkpoint_granularity": "full", "optim": {"name": "distributed_fused_adam"},
                     "dapo": {}}}
    layout = Layout(world=16, tp=1, pp=4)
    got = P.training_state(cfg, TINY_DENSE, layout)
    want = M.training_memory(TINY_DENSE, layout, seq_tokens=256, in_flight=2, recompute="full",
                           distributed_optimizer=True, grad_bytes=4)
    assert got["activations"] == want["activations"]


def test_offload_time_counts_the_copy_out_and_the_copy_back():
    cfg = OmegaConf.to_container(load_config("moe-mixtral-8x22b_h100", ["model.dapo.offload_training_state=True"]),
                                 resolve=True)
    plan = P.make_plan(cfg)
    train = plan["phases"]["train"]
    moved = train["weights"] + train["grads"] + train["optimizer"]
    assert moved > 0
    # host <- device while generating, device <- host before training: each byte crosses PCIe twice
    assert plan["time"]["overhead"]["offload"] == pytest.approx(2 * moved / (plan["assume"]["pcie_gb_per_s"] * 1e9))
