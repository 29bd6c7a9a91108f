"""`nemo-dapo ablate`: the rows are the paper's Table 1 settings, a small ablation runs end to end, a killed or
partly failed ablation resumes without rerunning finished runs, and bad input is refused with the fix named."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from nemo_dapo.cli import EXIT_RUNS_FAILED, main
from nemo_dapo.local.config import load_config
from nemo_dapo.local import ablate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = "tiny_cpu_long"  # the command's default base recipe
# Very small sizes: a 30-update warm-up, 16 held-out problems, 4 groups of 8 per rollout step.
TINY = ["warmup.max_steps=30", "warmup.min_steps=10", "warmup.eval_every=10", "warmup.probe_size=16",
        "data.train_size=200", "data.heldout_size=16", "trainer.val_every=2", "trainer.val_problems=16",
        "eval.n_samples=2", "trainer.train_batch_size=4", "trainer.mini_batch_size=16", "trainer.tensorboard=false"]

# Table 1 of the paper, written out by hand: (eps_high, agg, overlong_filter, soft overlong punishment, dynamic
# sampling); every row has eps_low 0.2 and no dual clip.
OFF = {"eps_high": 0.2, "agg": "seq-mean-token-mean", "overlong_filter": False, "soft": False, "ds": False}
ON = {"eps_high": 0.28, "agg": "token-mean", "overlong_filter": True, "soft": True, "ds": True}
PAPER = {
    "grpo": dict(OFF),
    "+overlong_filter": {**OFF, "overlong_filter": True},
    "+clip_higher": {**OFF, "overlong_filter": True, "eps_high": 0.28},
    "+soft_overlong": {**OFF, "overlong_filter": True, "eps_high": 0.28, "soft": True},
    "+token_level": {**ON, "ds": False},
    "dapo": dict(ON),
    "dapo-overlong_filter": {**ON, "overlong_filter": False},
    "dapo-clip_higher": {**ON, "eps_high": 0.2},
    "dapo-soft_overlong": {**ON, "soft": False},
    "dapo-token_level": {**ON, "agg": "seq-mean-token-mean"},
    "dapo-dynamic_sampling": {**ON, "ds": False},
}


def _techniques(cfg) -> dict:
    a = cfg.algorithm
    return {"eps_high": a.eps_high, "agg": a.agg, "overlong_filter": a.overlong_filter,
            "soft": cfg.algorithm.overlong.enabled, "ds": a.dynamic_sampling.enabled}


# ---- (a) the rows are the paper's settings --------------------------------------------------------------------------
def test_progressive_rows_follow_table_1_in_order():
    assert ablate.PROGRESSIVE == ["grpo", "+overlong_filter", "+clip_higher", "+soft_overlong", "+token_level", "dapo"]
    assert set(ablate.LEAVE_ONE_OUT) | set(ablate.PROGRESSIVE) == set(PAPER)


@pytest.mark.parametrize("base", [BASE, "tiny_cpu"])
@pytest.mark.parametrize("row", sorted(PAPER))
def test_each_row_resolves_to_the_paper_setting(row, base):
    cfg = load_config(base, ablate.row_overrides(row))
    assert _techniques(cfg) == PAPER[row]
    assert cfg.algorithm.eps_low == 0.2 and cfg.algorithm.clip_c is None  # the base recipes have clip_c = 10
    assert cfg.algorithm.dynamic_sampling.skip_history.enabled is False


def test_skip_row_is_dapo_with_history_skipping():
    cfg = load_config(BASE, ablate.row_overrides("dapo+skip"))
    assert _techniques(cfg) == PAPER["dapo"] and cfg.algorithm.dynamic_sampling.skip_history.enabled is True


def test_grpo_row_equals_the_repos_naive_grpo_recipe():
    # tiny_cpu_grpo is the README's baseline, written independently of the row table.
    row, recipe = load_config("tiny_cpu", ablate.row_overrides("grpo")), load_config("tiny_cpu_grpo")
    assert row.algorithm == recipe.algorithm and row.reward == recipe.reward


# ---- (b) a 2-row x 1-seed ablation end to end -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def warm_base(tmp_path_factory):
    """A warmed OUT/base_model per base recipe, copied into each test's OUT (the ablation reuses a cached one)."""
    made = {}

    def copy_into(out: str, config_name: str) -> None:
        if config_name not in made:
            cfg = load_config(config_name, TINY + [f"run_dir={tmp_path_factory.mktemp('base')}", "rollout.processes=1"])
            made[config_name] = ablate.warm_base(cfg)
        shutil.copytree(made[config_name], os.path.join(out, "base_model"))

    return copy_into


def _argv(out, *extra, config_name=BASE, budget=128):
    return ["ablate", "--config-name", config_name, "--seeds", "1", "--budget", str(budget), "--out", str(out),
            "--progress-every", "2", *extra, *TINY]


@pytest.mark.slow
def test_two_rows_one_seed_end_to_end(tmp_path, capsys):
    out = tmp_path / "ab"
    t0 = time.time()
    assert main(_argv(out, "--rows", "grpo,dapo")) == 0  # warms its own base model
    wall = time.time() - t0
    printed = capsys.readouterr().out
    for name in ("ablation.md", "ablation.png", "ablation.json"):
        assert (out / name).stat().st_size > 0
    table = [line for line in (out / "ablation.md").read_text().splitlines() if line.startswith("| ")]
    assert [line.split("|")[1].strip() for line in table[1:]] == ["grpo", "dapo"]
    assert "runs 2/2 done" in printed and "ETA" in printed
    report = json.loads((out / "ablation.json").read_text())
    assert [r["status"] for r in report["runs"]] == ["finished", "finished"]
    assert all(r["ended_by"] == "budget" and r["consumed_samples"] >= 128 for r in report["runs"])
    dapo = report["table"][1]
    assert dapo["pass_rate"] is not None and 0 <= dapo["pass_rate"] <= 1 and report["table"][0]["pass_rate"] is None
    for row in ("grpo", "dapo"):  # every run started from the one cached base model
        cfg_text = (out / row / "seed1" / "config.yaml").read_text()
        assert f"path: {out / 'base_model'}" in cfg_text and "max_samples: 128" in cfg_text
        assert "held-out accuracy" in (out / row / "seed1" / "train.log").read_text()
    os.unlink(out / "ablation.png")
    assert main(["plot", str(out)]) == 0  # redraws from the run directories
    assert (out / "ablation.png").is_file()
    print(f"\nablate smoke run (2 rows x 1 seed, warm-up included): {wall:.1f} s")


# ---- (c) resume ----------------------------------------------------------------------------------------------------
def _mtime(out, row):
    return os.stat(os.path.join(out, row, "seed1", "summary.json")).st_mtime_ns


@pytest.mark.slow
def test_failed_run_is_reported_others_go_on_and_a_rerun_completes_it(tmp_path, capsys, warm_base):
    from nemo_dapo.local.run_dir import RunDirLock

    out = tmp_path / "ab"
    warm_base(str(out), "tiny_cpu")
    busy = out / "grpo" / "seed1"
    busy.mkdir(parents=True)
    with RunDirLock(str(busy)):  # another process holds this run directory: its train exits 5
        rc = main(_argv(out, "--rows", "grpo,dapo", config_name="tiny_cpu"))
    err = capsys.readouterr().err
    assert rc == EXIT_RUNS_FAILED
    assert f"run grpo/seed1 failed with exit code 5; log {busy / 'train.log'}" in err
    assert (out / "dapo" / "seed1" / "summary.json").is_file() and not (busy / "summary.json").exists()
    assert [r["status"] for r in json.loads((out / "ablation.json").read_text())["runs"]] == ["failed", "finished"]
    before = _mtime(out, "dapo")
    assert main(_argv(out, "--rows", "grpo,dapo", config_name="tiny_cpu")) == 0
    assert "1 already finished, 1 to run" in capsys.readouterr().out
    assert _mtime(out, "dapo") == before and (busy / "summary.json").is_file()


@pytest.mark.slow
def test_killed_ablation_resumes_the_killed_run_and_skips_finished_ones(tmp_path, capsys, warm_base):
    out = tmp_path / "ab"
    warm_base(str(out), "tiny_cpu")
    argv = _argv(out, "--rows", "grpo,dapo", "--jobs", "1", "trainer.save_every=1", config_name="tiny_cpu",
                 budget=512)
    proc = subprocess.Popen([sys.executable, "-m", "nemo_dapo.cli", *argv], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    ckpts, deadline = out / "dapo" / "seed1" / "checkpoints", time.time() + 120
    while not (ckpts.is_dir() and any(p.suffix == ".pt" for p in ckpts.iterdir())):  # dapo runs after grpo
        assert proc.poll() is None and time.time() < deadline, "the ablation ended before the second run saved"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert not (out / "dapo" / "seed1" / "summary.json").exists()  # stopped mid-way, with its checkpoint
    before = _mtime(out, "grpo")
    assert main(argv) == 0
    assert "1 already finished, 1 to run" in capsys.readouterr().out
    assert _mtime(out, "grpo") == before
    assert "resumed from" in (out / "dapo" / "seed1" / "train.log").read_text()
    assert "| dapo |" in (out / "ablation.md").read_text()


# ---- (d) bad input -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, fragment", [
    (["--rows", "grpo,clip"], "unknown row 'clip'"),
    (["--rows", "grpo,grpo"], "names a row twice"),
    (["--seeds", "0"], "--seeds 0"),
    (["--jobs", "0"], "--jobs 0"),
    (["--budget", "0"], "--budget 0"),
    (["algorithm.eps_high=0.3"], "algorithm.eps_high"),
    (["algorithm.dynamic_sampling.enabled=false"], "algorithm.dynamic_sampling.enabled"),
    (["algorithm.overlong={enabled: false}"], "algorithm.overlong.enabled"),
    (["trainer.max_samples=10"], "use --budget"),
    (["seed=3"], "use --seeds"),
])
def test_bad_input_exits_2_naming_the_problem(tmp_path, capsys, extra, fragment):
    assert main(_argv(tmp_path / "ab", *extra, config_name="tiny_cpu")) == 2
    assert fragment in capsys.readouterr().err
    assert not (tmp_path / "ab").exists()  # refused before anything was written


def test_skip_row_needs_the_key(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(ablate, "SKIP_KEY", "algorithm.dynamic_sampling.no_such_option.enabled")
    assert main(_argv(tmp_path / "ab", "--rows", "dapo,dapo+skip", config_name="tiny_cpu")) == 2
    assert "--rows dapo+skip needs the config key algorithm.dynamic_sampling.no_such_option" in capsys.readouterr().err


@pytest.mark.parametrize("change, fragment", [({"budget": 999}, "budget: 999 -> 128"),
                                              ({"row_table": {"grpo": ["algorithm.eps_high=0.3"]}}, "row grpo")])
def test_changed_plan_is_refused(tmp_path, capsys, change, fragment):
    from nemo_dapo.local.run_log import write_json

    out = tmp_path / "ab"
    argv = _argv(out, "--rows", "grpo", config_name="tiny_cpu")
    plan = ablate.plan_runs(ablate_args(argv), str(out))[2]
    out.mkdir()
    write_json(str(out / "ablation.json"), {"plan": {**plan, **change}})
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err and "--out NEW_DIR" in err
    assert not (out / "base_model").exists()


def ablate_args(argv):
    from nemo_dapo.cli import build_parser

    return build_parser().parse_args(argv)


# ---- (e) the output directory and the last bad inputs ------------------------------------------------------------
def _one_error(err):
    lines = [line for line in err.splitlines() if line.startswith("nemo-dapo ablate: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("rows", ["", ",", " , "])
def test_rows_naming_no_row_is_refused_not_the_default_table(tmp_path, capsys, rows):
    """`--rows "$ROWS"` with ROWS unset must not start the 6-row default table."""
    assert main(_argv(tmp_path / "ab", "--rows", rows, config_name="tiny_cpu")) == 2
    line = _one_error(capsys.readouterr().err)
    assert "--rows" in line and "names no row" in line and ", ".join(ablate.PROGRESSIVE) in line
    assert not (tmp_path / "ab").exists()


@pytest.mark.parametrize("every", ["0", "-1", "nan"])
def test_progress_every_must_be_positive(tmp_path, capsys, every):
    argv = _argv(tmp_path / "ab", "--rows", "grpo", config_name="tiny_cpu")
    argv[argv.index("--progress-every") + 1] = every
    assert main(argv) == 2
    assert f"--progress-every {float(every)}: must be a positive number of seconds" in _one_error(
        capsys.readouterr().err)
    assert not (tmp_path / "ab").exists()


@pytest.mark.parametrize("config_name, max_samples", [(BASE, 8192), ("tiny_cpu", 51200)])
def test_budget_zero_names_the_flag_and_the_recipes_own_budget(tmp_path, capsys, config_name, max_samples):
    assert main(_argv(tmp_path / "ab", "--rows", "grpo", config_name=config_name, budget=0)) == 2
    line = _one_error(capsys.readouterr().err)
    assert "--budget 0: must be a positive number" in line and f"trainer.max_samples, {max_samples}" in line
    assert "sets no trainer.max_samples" not in line  # both recipes set one


@pytest.mark.parametrize("where", ["file", "under-a-file"])
def test_out_naming_a_file_is_one_error(tmp_path, capsys, where):
    f = tmp_path / "notes.txt"
    f.write_text("mine\n")
    out = f if where == "file" else f / "ab"
    assert main(_argv(out, "--rows", "grpo", config_name="tiny_cpu")) == 2
    line = _one_error(capsys.readouterr().err)
    assert "--out" in line and str(f) in line and "is a file" in line
    assert f.read_text() == "mine\n"


@pytest.mark.slow
def test_a_second_ablation_on_the_same_out_is_refused_while_the_first_runs(tmp_path, capsys):
    out = tmp_path / "ab"
    argv = _argv(out, "--rows", "grpo", config_name="tiny_cpu")
    first = subprocess.Popen([sys.executable, "-m", "nemo_dapo.cli", *argv], cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 120
        while not (out / "ablation.json").is_file():  # written under the lock, before the warm-up
            assert first.poll() is None and time.time() < deadline, "the first ablation did not start"
            time.sleep(0.05)
        plan = (out / "ablation.json").read_text()
        assert main(argv) == 5  # EXIT_BUSY, as for train
        line = _one_error(capsys.readouterr().err)
        assert f"ablation output directory {str(out)!r} is in use by pid {first.pid}" in line
        assert "--out NEW_DIR" in line
        assert first.poll() is None and (out / "ablation.json").read_text() == plan  # the first is undisturbed
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=60)


def _fake_run(out, row, seed, *, accuracy, diverged=None):
    """A run directory as train leaves it: summary.json and metrics.jsonl, and diverged.json if it diverged."""
    d = out / row / f"seed{seed}"
    d.mkdir(parents=True)
    summary = {"base_accuracy": 0.2, "final_accuracy": accuracy, "gain_points": 100 * (accuracy - 0.2),
               "wall_seconds": 10.0, "rl_seconds": 8.0, "rollout_steps": 4, "consumed_samples": 128,
               "diverged": diverged or []}
    (d / "summary.json").write_text(json.dumps(summary))
    (d / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "counters/consumed_samples": 128,
                                                 "actor/entropy": 1.0, "filter/trained_groups": 4}) + "\n")
    if diverged:
        (d / "diverged.json").write_text(json.dumps({"divergences": diverged}))


def test_a_run_that_diverged_is_never_a_row_result_even_when_continued(tmp_path):
    from nemo_dapo.local import ablate_report

    out = tmp_path / "ab"
    went = [{"step": 3, "reason": "8 optimizer updates in a row were skipped", "resumed": True}]
    _fake_run(out, "grpo", 1, accuracy=0.4)
    _fake_run(out, "grpo", 2, accuracy=0.9, diverged=went)  # continued with --resume-diverged, then finished
    meta = {"plan": {"config_name": "tiny_cpu", "overrides": [], "budget": 128, "row_table": {"grpo": []}},
            "rows": ["grpo"], "seeds": 2, "labels": {"grpo": "naive GRPO"}, "techniques": {"grpo": "grpo"}}
    md, _, js = ablate_report.write_report(str(out), meta, {})
    report = json.loads(open(js).read())
    assert [r["status"] for r in report["runs"]] == ["finished", "diverged"]
    assert "final_accuracy" not in report["runs"][1] and "at rollout step 3" in report["runs"][1]["diverged"]
    row = report["table"][0]
    assert row["final_accuracy"] == 0.4 and row["finished"] == 1 and row["diverged"] == 1
    text = open(md).read()
    assert "| 1/2 (1 diverged) |" in text and "- grpo/seed2: DIVERGED at rollout step 3" in text
    assert "0.900" not in text


@pytest.mark.slow
def test_a_diverging_run_is_reported_diverged_and_stays_so_on_a_rerun(tmp_path, capsys, warm_base):
    out = tmp_path / "ab"
    warm_base(str(out), "tiny_cpu")
    # lr 1e30: the first update that moves the weights makes them overflow, the next is skipped (non-finite loss).
    # The soft overlong punishment gives groups unequal rewards even at accuracy 0, so the updates do move them.
    row = "+soft_overlong"
    argv = _argv(out, "--rows", row, "optim.lr=1e30", "trainer.max_skipped_updates=1", config_name="tiny_cpu")
    for attempt in range(2):
        assert main(argv) == EXIT_RUNS_FAILED
        err = capsys.readouterr().err
        assert f"nemo-dapo ablate: run {row}/seed1 diverged (at rollout step" in err and "not counted" in err
        report = json.loads((out / "ablation.json").read_text())
        assert [r["status"] for r in report["runs"]] == ["diverged"] and report["table"][0]["finished"] == 0
        assert f"- {row}/seed1: DIVERGED at rollout step" in (out / "ablation.md").read_text()
    log = (out / row / "seed1" / "train.log").read_text()
    assert "holds a run that diverged" in log  # the rerun's train refused to continue it (exit 7)
    assert not (out / row / "seed1" / "summary.json").exists()
