"""plan_async.py: the colocated, partial-rollout and disaggregated one-step-off layouts of `nemo-dapo plan` (issue 22
section 4): the overlap never beats the slower side, max_staleness 0 removes it, the network refit follows the
stated bandwidth and 0 is refused, partial rollouts take no last wave, the printed layouts agree with their parts."""
import argparse
import re

import pytest
from omegaconf import OmegaConf

from nemo_dapo.cluster import plan as P
from nemo_dapo.cluster import plan_async as A
from nemo_dapo.cluster import plan_generation as G
from nemo_dapo.cluster.config_load import load_config

DENSE = "qwen2.5-32b_h100"  # TP8 PP1: whole-node splits are valid layouts
MOE = "qwen3-30b-a3b_h20"


def _plan(recipe=DENSE, overrides=()):
    return P.make_plan(OmegaConf.to_container(load_config(recipe, list(overrides)), resolve=True))


def _cli(capsys, *argv):
    ap = argparse.ArgumentParser()
    P.add_cli(ap.add_subparsers())
    args = ap.parse_args(["plan", *argv])
    code = args.func(args)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("recipe,overrides", [
    (DENSE, ()), (DENSE, ("plan.async.trainer_nodes=2",)), (DENSE, ("plan.async.trainer_nodes=12",)),
    (DENSE, ("plan.async.max_staleness=3",)), (MOE, ()), (MOE, ("plan.async.trainer_nodes=2",)),
    (DENSE, ("plan.assume.network_gb_per_s=0.5", "plan.async.trainer_nodes=8")),
])
def test_overlap_never_beats_the_slower_side(recipe, overrides):
    rows = _plan(recipe, overrides)["layouts"]
    for key in ("disaggregated", "disaggregated_partial"):
        row, parts = rows[key], rows[key]["parts"]
        assert row["overlap"]
        slower = max(parts["train side"], parts["generation side"])
        assert row["step"] >= slower + parts["network refit"] - 1e-9
        assert row["step"] == pytest.approx(slower + parts["network refit"])
        assert parts["train side"] == pytest.approx(sum(row["train"].values()))


def test_max_staleness_0_allows_no_overlap_and_no_partial_rollouts():
    rows = _plan(DENSE, ["plan.async.max_staleness=0", "plan.async.trainer_nodes=6"])["layouts"]
    row, parts = rows["disaggregated"], rows["disaggregated"]["parts"]
    assert not row["overlap"]
    assert row["step"] == pytest.approx(parts["train side"] + parts["generation side"] + parts["network refit"])
    one = _plan(DENSE, ["plan.async.max_staleness=1", "plan.async.trainer_nodes=6"])["layouts"]["disaggregated"]
    assert one["step"] < row["step"]  # the overlap is what one version of lag buys
    for key in ("colocated_partial", "disaggregated_partial"):
        assert "max_staleness=0" in rows[key]["refused"] and "abort" in rows[key]["refused"]


@pytest.mark.parametrize("value", ["0", "-5"])
def test_a_network_refit_at_zero_bandwidth_is_refused(capsys, value):
    code, out, err = _cli(capsys, DENSE, f"plan.assume.network_gb_per_s={value}")
    assert code == 2 and out == ""
    assert f"plan.assume.network_gb_per_s={value} must be a number > 0" in err


def test_the_network_refit_is_the_model_over_the_stated_bandwidth():
    plan = _plan(DENSE, ["plan.assume.network_gb_per_s=2.0", "plan.async.trainer_nodes=6"])
    refit = plan["layouts"]["disaggregated"]["parts"]["network refit"]
    assert refit == pytest.approx(2 * plan["arch"].total_params() / 2.0e9)
    faster = _plan(DENSE, ["plan.assume.network_gb_per_s=8.0", "plan.async.trainer_nodes=6"])
    assert faster["layouts"]["disaggregated"]["parts"]["network refit"] == pytest.approx(refit / 4)


def test_partial_rollouts_take_no_last_wave():
    """Colocated partial generation is the step's needed tokens at the full-batch rate (no drops at these lengths)
    plus the re-prefill, below the in-flight engine's queue + last wave."""
    plan = _plan(DENSE)
    t, gen, row = plan["time"], plan["time"]["gen"], plan["layouts"]["colocated_partial"]
    assert row["dropped"] < 1e-3
    needed = 512 * 16 / 0.5 / t["engines"]  # prompts x G over the recipe's prior pass rate, per engine
    assert row["parts"]["generation"] == pytest.approx(needed * t["lengths"].max_moment(1) / gen["tokens_per_s"],
                                                       rel=2e-3)
    assert row["parts"]["generation"] < gen["inflight"]
    others = {k: v for k, v in row["parts"].items() if k not in ("generation", "re-prefill after refit")}
    assert others == {k: v for k, v in plan["layouts"]["colocated"]["parts"].items() if k != "generation"}


def test_drops_grow_as_the_allowed_staleness_shrinks():
    lengths = G.ResponseLengths(20480, 6000, 0.05)
    common = dict(responses=400, rate=2000.0, step_s=0.5, phase=lambda gen: gen)  # ~3.6k tokens/phase
    one, four = (A.partial_seconds(lengths, staleness=s, **common) for s in (1, 4))
    assert one["dropped"] > four["dropped"] > 0 and one["wasted"] > four["wasted"] > 0
    assert one["generation"] > four["generation"] > 400 * lengths.max_moment(1) / 2000.0
    with pytest.raises(G.PlanError, match="max_staleness=0"):
        A.partial_seconds(lengths, staleness=0, **common)


def test_more_trainer_nodes_train_faster_and_generate_slower():
    two = _plan(DENSE, ["plan.async.trainer_nodes=2"])["layouts"]["disaggregated"]
    eight = _plan(DENSE, ["plan.async.trainer_nodes=8"])["layouts"]["disaggregated"]
    assert two["parts"]["train side"] == pytest.approx(4 * eight["parts"]["train side"], rel=1e-6)  # linear, PP1
    assert two["parts"]["generation side"] < eight["parts"]["generation side"]
    assert (two["engine_gpus"], eight["engine_gpus"]) == (112, 64)


def test_the_chosen_split_is_the_shortest():
    rows = _plan(DENSE)["layouts"]
    best = rows["disaggregated"]
    tried = 0
    for n in range(1, 16):
        other = _plan(DENSE, [f"plan.async.trainer_nodes={n}"])["layouts"]["disaggregated"]
        if "refused" not in other:
            tried += 1
            assert best["step"] <= other["step"] + 1e-9, n
    assert tried >= 10 and any(best["trainer_nodes"] == n for n in range(1, 16))


SEVEN_B = "benchmarks/calibration/verl-fully-async-qwen2.5-math-7b-128xh20.yaml"  # a 7B fits on one node


@pytest.mark.parametrize("recipe,overrides,message", [
    (SEVEN_B, ["trainer.num_nodes=1"], "it needs >= 2"),
    (DENSE, ["plan.async.trainer_nodes=16"], "leaves no engine node"),
    (DENSE, ["plan.async.trainer_nodes=1"], "GB/GPU > budget"),
])
def test_splits_the_planner_cannot_make_are_refused_with_the_reason(recipe, overrides, message):
    rows = _plan(recipe, overrides)["layouts"]
    assert message in rows["disaggregated"]["refused"] and message in rows["disaggregated_partial"]["refused"]
    assert "step" in rows["colocated"]


def test_a_training_layout_that_needs_every_gpu_cannot_be_split():
    rows = _plan("qwen3-235b-a22b_h100")["layouts"]  # ETP4 x EP16 x PP2: 128 GPUs per expert group
    assert "must be a multiple of 128" in rows["disaggregated"]["refused"]
    assert rows["colocated_partial"]["step"] < rows["colocated"]["step"]


@pytest.mark.parametrize("key,value", [("max_staleness", "-1"), ("trainer_nodes", "0"), ("old_logprob_pass", "3")])
def test_bad_async_settings_are_refused(capsys, key, value):
    code, _, err = _cli(capsys, DENSE, f"plan.async.{key}={value}")
    assert code == 2 and f"plan.async.{key}={value}" in err


def test_the_printed_layouts_agree_with_their_components(capsys):
    code, out, _ = _cli(capsys, DENSE)
    assert code == 0
    rows = _plan(DENSE)["layouts"]
    lines = out.splitlines()
    for key, label in A.LAYOUT_LABELS.items():
        i = next(i for i, x in enumerate(lines) if x.startswith(f"  {label} ") and " s (" in x)
        step = float(re.search(r"\s(\d+) s \(", lines[i]).group(1))
        assert step == round(rows[key]["step"])
        following = []
        for x in lines[i + 1:]:
            if not x.startswith("      "):
                break
            following.append(x.strip())
        detail = " ".join(following)
        if key.startswith("colocated"):
            numbers = [float(part.rsplit(" ", 1)[1]) for part in detail.split(";")[0].split(" + ")]
            assert len(numbers) == len(rows[key]["parts"]) and abs(sum(numbers) - step) <= len(numbers), detail
        else:
            m = re.search(r"max\(train side (\d+), generation side (\d+)\) \+ network refit (\d+)", detail)
            train, gen, refit = map(float, m.groups())
            assert abs(max(train, gen) + refit - step) <= 2, (key, detail)
    fastest = min(rows, key=lambda k: rows[k]["step"])
    assert f"fastest: {A.LAYOUT_LABELS[fastest]}" in out
    ratio = rows["colocated"]["step"] / rows[fastest]["step"]
    assert f"{ratio:.2f}x faster than today" in out
    for text in ("network_gb_per_s=8.0: published", "layout assumptions:", "stalls both sides"):
        assert text in out.replace("\n      ", " ")


@pytest.mark.parametrize("recipe", [DENSE, MOE])
def test_the_built_overlap_lies_between_the_ideal_and_no_overlap_and_grows_with_the_round(recipe):
    """What the trainer builds (one prompt-order round beside the train side) is no faster than the one-step-off
    ideal, no slower than training and generating in turn, and hides more with longer rounds."""
    steps = []
    for rounds in (256, 2048, 1 << 20):
        row = _plan(recipe, [f"trainer.dapo.rollout.round_tokens={rounds}"])["layouts"]["disaggregated_partial"]
        p, built = row["parts"], row["built"]
        in_turn = p["train side"] + p["generation side"] + p["network refit"]
        assert row["step"] - 1e-9 <= built["step"] <= in_turn + 1e-9
        assert built["step"] == pytest.approx(in_turn - min(p["train side"], p["generation side"], built["round"]))
        steps.append(built["step"])
    assert steps[0] > steps[1] >= steps[2]
    assert steps[2] == pytest.approx(row["step"])  # rounds as long as the responses: the ideal one-step-off
