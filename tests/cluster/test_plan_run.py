"""`nemo-dapo plan`'s whole-run line: the rollout steps the recipe runs times the step, in hours and GPU-hours."""
import pytest

from tests.cluster.test_plan import plan_of, run_cli


def printed(*argv, capsys) -> str:
    """The printed plan, whitespace joined (its lines wrap)."""
    assert run_cli(*argv) == 0
    return " ".join(capsys.readouterr().out.split())


def test_the_whole_run_is_the_recipes_steps_times_the_step(capsys):
    plan = plan_of("qwen2.5-32b_h100")
    steps, rows = 375, plan["layouts"]  # the recipe's trainer.dapo.max_steps
    assert plan["run"] == {"max_steps": steps, "max_epochs": 12, "save_interval": 1, "save_top_k": 3}
    sync, partial, high = rows["colocated"]["step"], rows["colocated_partial"]["step"], plan["time"]["eager_high"][1]
    assert partial == min(r["step"] for r in rows.values() if "step" in r)  # the fastest on this recipe
    out = printed("qwen2.5-32b_h100", capsys=capsys)
    assert (f"375 rollout steps (trainer.dapo.max_steps; max_epochs=12 may end it sooner) on 128 GPUs: "
            f"{steps * sync / 3600:.0f} h, {steps * sync / 3600 * 128 / 1e3:.1f}k GPU-hours as the recipe runs "
            f"({steps * high / 3600:.0f} h, {steps * high / 3600 * 128 / 1e3:.1f}k GPU-hours at 0.8 ms a layer); "
            f"{steps * partial / 3600:.0f} h, {steps * partial / 3600 * 128 / 1e3:.1f}k GPU-hours with colocated + "
            "partial rollouts (the fastest)") in out
    # by hand for this recipe: 375 x 1860 s = 194 h, x 128 GPUs = 24.8k GPU-hours (docs/cluster.md quotes these)
    assert steps * sync / 3600 == pytest.approx(194, abs=0.5)


def test_the_whole_run_scales_with_max_steps_and_names_what_it_cannot_know(capsys):
    out = printed("qwen2.5-32b_h100", "trainer.dapo.max_steps=750", "plan.cuda_graphs=true", capsys=capsys)
    sync = plan_of("qwen2.5-32b_h100", "plan.cuda_graphs=true")["layouts"]["colocated"]["step"]
    assert f"750 rollout steps (trainer.dapo.max_steps; max_epochs=12 may end it sooner) on 128 GPUs: " \
           f"{750 * sync / 3600:.0f} h" in out
    assert "at 0.8 ms a layer" not in out  # graphs: no launch-cost range
    out = printed("qwen2.5-32b_h100", "trainer.dapo.max_steps=-1", capsys=capsys)
    assert "trainer.dapo.max_steps=-1: the run ends after max_epochs=12 passes over the prompts, a length the plan " \
           "does not know" in out
    out = printed("qwen2.5-32b_h100", "trainer.dapo.max_steps=abc", capsys=capsys)
    assert "trainer.dapo.max_steps='abc' is not an integer: not estimated (fix: rollout steps, or -1)" in out


def test_the_checkpoints_are_weights_and_adam_state_and_the_kept_ones_add_up(capsys):
    from tests.cluster.test_plan import QWEN25_32B

    size = (2 + 12) * QWEN25_32B.total_params()  # bf16 weights; fp32 master, m and v (plan_model.py's 12 B/param)
    assert size / 1e12 == pytest.approx(0.46, abs=0.005)
    out = printed("qwen2.5-32b_h100", capsys=capsys)
    assert (f"each checkpoint {size / 1e12:.2f} TB (14 bytes a parameter: bf16 weights, fp32 master weights and "
            "Adam moments), written every trainer.dapo.save_interval=1 steps; save_top_k=3 best + the latest: up to "
            f"{4 * size / 1e12:.1f} TB on disk") in out
    out = printed("qwen2.5-32b_h100", "exp_manager.checkpoint_callback_params.save_top_k=1",
                  "trainer.dapo.save_interval=5", capsys=capsys)
    assert f"save_interval=5 steps; save_top_k=1 best + the latest: up to {2 * size / 1e12:.1f} TB" in out
