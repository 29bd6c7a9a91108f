"""`nemo-dapo plan` for an engine that decodes without CUDA graphs (the pinned TensorRT-LLM): the host's kernel
launches against the GPU's work, by hand, and what the plan reads and prints."""
import pytest

from nemo_dapo.cluster import plan as P
from nemo_dapo.cluster.plan_assumptions import DEFAULT_ASSUMPTIONS, EAGER_LAYER_MS_RANGE
from tests.cluster.test_plan import QWEN25_32B, plan_of, run_cli

H100 = P.GPUS["h100"]


def device_s(batch, context, tp=8, pp=1):
    """The slow obvious reference of one stage's GPU work at TP8 (dense 32B): weight shard + KV read at 0.75 x HBM."""
    weights = 2 * QWEN25_32B.total_params() / (tp * pp)
    kv = batch * context * 64 // pp * 2 * 128 * 2  # layers x (K, V) x one KV head per GPU x head dim x bf16
    return (weights + kv) / (0.75 * H100.hbm_tb_s * 1e12)


@pytest.mark.parametrize("pp", [1, 2])
def test_a_stage_takes_the_longer_of_the_launches_and_the_gpu_work(pp):
    kw = dict(gen_tp=8, gen_pp=pp, efficiency=0.75, overhead_s=3e-3)
    launch = 0.25e-3
    # batch 1: the GPU reads the weight shard in well under 64 / pp launches: the host sets the pace
    small = P.decode_step_seconds(QWEN25_32B, H100, batch=1, context=1000, launch_s=launch, **kw)
    assert device_s(1, 1000, pp=pp) < 64 // pp * launch
    assert small == pytest.approx(pp * (64 // pp) * launch + 3e-3, rel=1e-6)
    # a full in-flight batch: the KV reads outlast the launches, which run meanwhile: the same as with graphs
    big = P.decode_step_seconds(QWEN25_32B, H100, batch=256, context=6000, launch_s=launch, **kw)
    graphs = P.decode_step_seconds(QWEN25_32B, H100, batch=256, context=6000, **kw)
    assert device_s(256, 6000, pp=pp) > 64 // pp * launch
    assert big == graphs == pytest.approx(pp * device_s(256, 6000, pp=pp) + 3e-3, rel=1e-3)


def test_trtllm_decodes_without_graphs_and_plan_cuda_graphs_overrides_it():
    eager = plan_of("qwen2.5-32b_h100")
    graphs = plan_of("qwen2.5-32b_h100", "plan.cuda_graphs=true")
    free = plan_of("qwen2.5-32b_h100", "plan.assume.eager_layer_ms=0")
    assert not eager["gen"]["graphs"] and graphs["gen"]["graphs"]
    assert graphs["time"]["total"] == pytest.approx(free["time"]["total"])  # no launch cost is graphs
    assert graphs["time"]["total"] < eager["time"]["total"]
    # the tail (one request left) is launch-bound: 64 x 0.25 ms + 3 ms + 2 all-reduces of 15 us per layer
    tail = eager["time"]["gen"]["small_step_s"]
    assert tail == pytest.approx(64 * DEFAULT_ASSUMPTIONS["eager_layer_ms"] / 1e3 + 3e-3 + 128 * 15e-6, rel=1e-6)
    # every layout's engines decode the same way; the launches outlast the GPU's work only in the tail, which partial
    # rollouts do not wait for (here the full in-flight batch is KV-bound: 16 ms of launches hide under it)
    for key in ("colocated", "disaggregated"):
        assert eager["layouts"][key]["step"] > graphs["layouts"][key]["step"], key
    for key in ("colocated_partial", "disaggregated_partial"):
        assert eager["layouts"][key]["step"] == pytest.approx(graphs["layouts"][key]["step"]), key
    # the top of the published range, beside the estimate
    high_ms, high_s = eager["time"]["eager_high"]
    top = plan_of("qwen2.5-32b_h100", f"plan.assume.eager_layer_ms={EAGER_LAYER_MS_RANGE[1]}")
    assert high_ms == EAGER_LAYER_MS_RANGE[1] and high_s == pytest.approx(top["time"]["total"])
    assert "eager_high" not in graphs["time"]


def test_the_printed_plan_says_what_decoding_without_graphs_costs(capsys):
    plan = plan_of("qwen2.5-32b_h100")
    assert run_cli("qwen2.5-32b_h100") == 0
    out = " ".join(capsys.readouterr().out.split())
    high = plan["time"]["eager_high"][1]
    assert ("no CUDA graphs (trtllm: nemo_dapo/core/engine_registry.py, or plan.cuda_graphs): the host launches 64 "
            "layers x 0.25 ms = 16.0 ms of kernels a decode step") in out
    assert f"at 0.8 ms a layer, the top of the published range, the step is {high:.0f} s ({high / 60:.0f} min)" in out
    assert "eager_layer_ms=0.25: GUESS" in out  # with the other assumptions
    assert run_cli("qwen2.5-32b_h100", "plan.cuda_graphs=true") == 0
    assert "no CUDA graphs" not in capsys.readouterr().out


@pytest.mark.parametrize("value", ["maybe", "1", "[true]"])
def test_a_cuda_graphs_value_that_is_not_a_boolean_is_refused(value, capsys):
    assert run_cli("qwen2.5-32b_h100", f"plan.cuda_graphs={value}") == 2
    err = capsys.readouterr().err
    assert "plan.cuda_graphs=" in err and "must be true, false or null" in err
