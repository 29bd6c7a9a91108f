"""The CPU main job end to end at toy sizes: train, resume, kill -9 + resume equality, bad inputs, eval, plot."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from nemo_dapo.cli import main
from nemo_dapo.local.config import load_config
from nemo_dapo.core.types import RolloutBatch
from nemo_dapo.local.run_log import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AIME = os.path.join(REPO, "tests", "fixtures", "aime-2024-head64.parquet")  # 64 rows of the real file

# A ~20k-parameter model, a few warm-up updates, 2 prompts x 4 samples per step: every phase runs, in seconds.
TINY = [
    "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2", "model.num_attention_heads=2",
    "model.num_key_value_heads=2", "model.max_position_embeddings=1024", "data.train_size=64",
    "data.heldout_size=6", "data.tokenizer_rows=200",
    "data.max_terms=3", "warmup.max_steps=3", "warmup.min_steps=1", "warmup.eval_every=3", "warmup.probe_size=4",
    "warmup.batch_size=8", "algorithm.group_size=4", "algorithm.dynamic_sampling.enabled=false",
    "trainer.train_batch_size=2", "trainer.mini_batch_size=4", "trainer.val_every=1", "trainer.val_problems=3",
    "trainer.save_every=1", "trainer.threads=1", "trainer.plots=false", "rollout.max_new_tokens=12",
    "rollout.processes=1",
    "algorithm.overlong.l_cache=4", "eval.n_samples=2", "optim.lr=1e-3",
]


def tiny_cfg(run_dir, *extra):
    return load_config("tiny_cpu", TINY + [f"run_dir={run_dir}", *extra])


def steady_records(run_dir):
    """Metrics records without timings (which differ between runs)."""
    out = []
    for r in read_metrics(run_dir):
        out.append({k: v for k, v in r.items() if not k.startswith(("timing/", "perf/", "wall_s", "eval/seconds",
                                                                    "val/seconds"))})
    return out


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A warmed-up toy base model (model + tokenizer) shared by the tests below."""
    from nemo_dapo.local.run_model import BASE_DIR, prepare_base_model

    run_dir = str(tmp_path_factory.mktemp("base"))
    prepare_base_model(tiny_cfg(run_dir))
    return os.path.join(run_dir, BASE_DIR)


def test_two_step_smoke_run_writes_everything_and_resumes(smoke_run, base_dir):
    from nemo_dapo.local.run import train

    run_dir, summary, seconds = smoke_run
    assert seconds < 60
    for key in ("base_accuracy", "final_accuracy", "heldout_size", "wall_seconds", "rollout_steps"):
        assert key in summary
    assert 0.0 <= summary["base_accuracy"] <= 1.0 and summary["heldout_size"] == 6
    assert summary["rollout_steps"] == 2 and summary["optimizer_steps"] == 4  # 8 samples / mini-batch 4
    assert json.load(open(os.path.join(run_dir, "summary.json")))["final_accuracy"] == summary["final_accuracy"]
    kinds = [(r["kind"], r["step"]) for r in read_metrics(run_dir)]
    assert kinds == [("eval", 0), ("train", 1), ("train", 2), ("final", 2)]
    train_rec = read_metrics(run_dir, "train")[-1]
    for key in ("train/reward", "train/acc", "actor/entropy", "response/length_mean", "filter/pass_rate",
                "val/accuracy", "actor/grad_norm", "counters/optimizer_steps", "timing/step_s"):
        assert key in train_rec, key
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["step_00000001.pt", "step_00000002.pt"]
    assert any(f.startswith("events") for f in os.listdir(os.path.join(run_dir, "tb")))
    assert os.path.isfile(os.path.join(run_dir, "final_model", "config.json"))
    # A second run of the same command resumes from the last checkpoint: no step is repeated.
    again = train(tiny_cfg(run_dir, "trainer.max_steps=2", f"model.path={base_dir}"))
    assert again["rollout_steps"] == 2 and again["base_accuracy"] == summary["base_accuracy"]
    assert [(r["kind"], r["step"]) for r in read_metrics(run_dir)] == kinds


def test_warmup_result_is_cached_in_the_run_directory(tmp_path):
    from nemo_dapo.local.run import LocalRun

    cfg = tiny_cfg(str(tmp_path), "warmup.max_steps=1")
    first = LocalRun(cfg)
    assert first.base_info["source"] == "warmup"
    second = LocalRun(cfg)
    assert second.base_info["source"] == "cache"
    for a, b in zip(first.model.parameters(), second.model.parameters()):
        assert torch.equal(a, b)
    third = LocalRun(tiny_cfg(str(tmp_path), "warmup.max_steps=2"))  # changed warm-up: rebuilt, not reused
    assert third.base_info["source"] == "warmup"


def test_nan_loss_skips_the_update_and_leaves_weights_unchanged(tmp_path, base_dir, caplog):
    from nemo_dapo.local.run import LocalRun

    run = LocalRun(tiny_cfg(str(tmp_path), f"model.path={base_dir}"))
    real = run.loop.loss_fn

    class NaNLoss:
        normalizer = staticmethod(real.normalizer)

        def __call__(self, logp, entropy, mb, num_tokens):
            loss, metrics = real(logp, entropy, mb, num_tokens)
            return loss * float("nan"), metrics

    run.loop.loss_fn = NaNLoss()
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    with caplog.at_level("WARNING"):
        m = run.loop.step()
    assert m["counters/skipped_updates"] == 2 and m["counters/optimizer_steps"] == 0
    assert "non-finite" in caplog.text
    for k, v in run.model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_missing_data_file_and_malformed_rows_give_clear_errors(tmp_path, base_dir, capsys):
    from nemo_dapo.data.readers import DataFormatError
    from nemo_dapo.local.run import LocalRun

    missing = str(tmp_path / "nope.parquet")
    code = main(["train", f"run_dir={tmp_path / 'r'}", "data.task=file", f"data.train_file={missing}",
                 f"data.heldout_file={AIME}", f"model.path={base_dir}"])
    assert code == 2 and "nope.parquet" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1"}],
                               "reward_model": {"ground_truth": "2"}}) + "\n" + json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(DataFormatError, match=r"bad.jsonl.*2"):
        LocalRun(tiny_cfg(str(tmp_path / "r2"), "data.task=file", f"data.train_file={bad}",
                          f"data.heldout_file={bad}", f"model.path={base_dir}"))
    code = main(["train", "trainer.max_step=1"])
    assert code == 2 and "trainer.max_steps" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="config.json"):
        LocalRun(tiny_cfg(str(tmp_path / "r3"), f"model.path={tmp_path}"))


def test_eval_command_reports_avg_pass_maj_on_aime(tmp_path, base_dir, capsys):
    out = tmp_path / "eval.json"
    code = main(["eval", "--model", base_dir, "--data", AIME, "--limit", "64", "--max-new-tokens", "4",
                 "--out", str(out)])
    assert code == 0
    res = json.load(open(out))
    # The x32 file holds shuffled copies: samples are grouped by problem id, k = the fewest copies of a problem.
    from collections import Counter

    from nemo_dapo.data.readers import read_aime2024

    copies = Counter(row.id for row in read_aime2024(AIME)[:64])
    k = min(copies.values())
    assert res["problems"] == len(copies) and res["k"] == k and res["rows"] == 64
    assert {f"avg@{k}", f"pass@{k}", f"maj@{k}", "length_mean", "clip_ratio"} <= set(res)
    assert 0.0 <= res[f"avg@{k}"] <= res[f"pass@{k}"] <= 1.0


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, base_dir):
    """A 2-step run (trained once for the tests that read its outputs)."""
    from nemo_dapo.local.run import train

    run_dir = str(tmp_path_factory.mktemp("smoke") / "run")
    t0 = time.time()
    summary = train(tiny_cfg(run_dir, "trainer.max_steps=2", f"model.path={base_dir}"))
    return run_dir, summary, time.time() - t0


def test_plot_command_writes_pngs(smoke_run, tmp_path, capsys):
    run_dir = smoke_run[0]
    assert main(["plot", run_dir, "--out", str(tmp_path)]) == 0
    written = capsys.readouterr().out.split()
    assert sorted(os.path.basename(p) for p in written) == ["dynamics.png", "time.png", "training.png"]
    for p in written:
        assert open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_comparison_table_has_one_column_per_run(tmp_path):
    from nemo_dapo.local.plots import comparison_table

    runs = []
    for name, base, final in (("tiny_cpu", 0.2, 0.55), ("tiny_cpu_grpo", 0.2, 0.4)):
        d = tmp_path / name
        d.mkdir()
        (d / "summary.json").write_text(json.dumps({"config": name, "base_accuracy": base, "final_accuracy": final,
                                                    "gain_points": round(100 * (final - base), 2)}))
        runs.append(str(d))
    table = comparison_table(runs).splitlines()
    assert table[0].startswith("| run | held-out acc. base | held-out acc. final | gain (points) |")
    assert table[2].startswith("| tiny_cpu | 0.200 | 0.550 | 35.0 |")
    assert table[3].startswith("| tiny_cpu_grpo | 0.200 | 0.400 | 20.0 |") and len(table) == 4
    with pytest.raises(FileNotFoundError, match="summary.json"):
        comparison_table([str(tmp_path)])


# Partial rollouts in prompt order through the local engine server: the reproducible mode of asynchronous DAPO
# (dynamic sampling off, as the toy base rarely solves a problem; 4 prompts drawn for 2 trained: 2 are suspended)
PROMPT_ORDER_PARTIAL = ["rollout.engine=local", "rollout.streaming=true", "rollout.on_filler_full=suspend",
                        "rollout.max_staleness=1", "rollout.fill_order=prompt", "rollout.round_tokens=4",
                        "algorithm.tis_cap=2.0", "algorithm.dynamic_sampling.enabled=false",
                        "algorithm.dynamic_sampling.adaptive=false", "algorithm.dynamic_sampling.gen_batch_size=4"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", [["rollout.processes=2"], PROMPT_ORDER_PARTIAL,
                                  PROMPT_ORDER_PARTIAL + ["rollout.overlap=true", "rollout.server.sleep_level=0"]],
                         ids=["inprocess", "prompt_partial", "prompt_overlap"])
def test_sigkill_then_resume_gives_the_same_metrics_as_an_uninterrupted_run(tmp_path, base_dir, mode):
    args = TINY + ["trainer.max_steps=6", "trainer.save_every=2", f"model.path={base_dir}",
                   "algorithm.dynamic_sampling.enabled=true",
                   "algorithm.dynamic_sampling.on_budget_exhausted=train_partial", *mode]
    cmd = [sys.executable, "-m", "nemo_dapo.cli", "train"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    full = str(tmp_path / "full")
    subprocess.run(cmd + args + [f"run_dir={full}"], check=True, env=env, capture_output=True, timeout=600)

    killed = str(tmp_path / "killed")
    proc = subprocess.Popen(cmd + args + [f"run_dir={killed}"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    first_ckpt = os.path.join(killed, "checkpoints", "step_00000002.pt")
    deadline = time.time() + 300
    while not os.path.exists(first_ckpt) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed; make it longer"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    steps_done = len(read_metrics(killed, "train"))
    assert steps_done < 6
    subprocess.run(cmd + args + [f"run_dir={killed}"], check=True, env=env, capture_output=True, timeout=600)
    assert steady_records(killed) == steady_records(full)
    if "rollout.on_filler_full=suspend" in mode:  # partial work was carried over a refit, the comparison covers it
        assert max(r.get("partial/resumed_groups", 0) for r in steady_records(full)) > 0
    assert json.load(open(os.path.join(killed, "summary.json")))["final_accuracy"] == \
        json.load(open(os.path.join(full, "summary.json")))["final_accuracy"]


def _failing_engine(monkeypatch, where: str, refits: int) -> dict:
    """Make the engine fail once the trainer has sent ``refits`` weight updates (the first is the start's): in
    the next generation (a step's or a validation's), the next refit, or (overlap in prompt order) while the trainer
    waits for the round that ran during its update."""
    from nemo_dapo.core.loop_stream import StreamingPhase
    from nemo_dapo.engines.base import EngineError
    from nemo_dapo.engines.client import EngineClient
    from nemo_dapo.engines.generator import EngineGenerator

    seen = {"refits": 0, "parking": False, "failed": False}

    def wrap(cls, name, due, before=lambda: None):
        orig = getattr(cls, name)

        def call(*args, **kwargs):
            before()
            if due():
                seen["failed"] = True
                raise EngineError(f"engine failed in the {where} (injected)")
            return orig(*args, **kwargs)
        monkeypatch.setattr(cls, name, call)

    wrap(EngineGenerator, "update_weights", lambda: where == "refit" and seen["refits"] == refits + 1,
         before=lambda: seen.update(refits=seen["refits"] + 1))
    wrap(StreamingPhase, "_park_ahead", lambda: False, before=lambda: seen.update(parking=seen["refits"] >= refits))
    wrap(EngineClient, "next_completion", lambda: seen["refits"] >= refits and (
        where in ("generation", "validation") or (where == "park" and seen["parking"])))
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("where,mode", [
    ("generation", PROMPT_ORDER_PARTIAL), ("refit", PROMPT_ORDER_PARTIAL), ("validation", PROMPT_ORDER_PARTIAL),
    ("park", PROMPT_ORDER_PARTIAL + ["rollout.overlap=true", "rollout.server.sleep_level=0"])],
    ids=["generation", "refit", "validation", "overlap-park"])
def test_an_engine_failing_mid_step_loses_nothing_and_the_rerun_repeats_the_uninterrupted_run(
        tmp_path, base_dir, monkeypatch, capsys, where, mode):
    """Step 4 of 5 fails (checkpoints and validation every 2 steps): the error saves step 3 as it ended, not the
    failed step half done (prompts drawn, suspended groups taken up, weights trained but not sent, validation not
    logged), and the same command resumes to the uninterrupted run's metrics."""
    args = TINY + ["trainer.max_steps=5", "trainer.save_every=2", "trainer.val_every=2", f"model.path={base_dir}",
                   "algorithm.dynamic_sampling.enabled=true",
                   "algorithm.dynamic_sampling.on_budget_exhausted=train_partial", *mode]
    full, failed = str(tmp_path / "full"), str(tmp_path / "failed")
    assert main(["train", *args, f"run_dir={full}"]) == 0
    with monkeypatch.context() as patch:
        # after the start's and steps 1-3's refits; the validation of step 4 follows its refit
        seen = _failing_engine(patch, where, refits=5 if where == "validation" else 4)
        code = main(["train", *args, f"run_dir={failed}"])
    err = capsys.readouterr().err
    assert code == 4 and seen["failed"], err
    assert f"engine failed in the {where}" in err and "rollout step 4 stopped; the checkpoint of step 3" in err
    assert [r["step"] for r in read_metrics(failed, "train")] == [1, 2, 3]
    ckpts = sorted(os.listdir(os.path.join(failed, "checkpoints")))
    assert ckpts == ["step_00000002.pt", "step_00000003.pt"], ckpts
    assert main(["train", *args, f"run_dir={failed}"]) == 0
    assert steady_records(failed) == steady_records(full)
    assert max(r.get("partial/resumed_groups", 0) for r in steady_records(full)) > 0


def test_rollout_batch_contract_of_the_sampler_matches_the_loop(tmp_path, base_dir):
    """The loop's payloads from the real sampler are valid RolloutBatches (left-padded prompts, EOS in mask)."""
    from nemo_dapo.local.run import LocalRun

    run = LocalRun(tiny_cfg(str(tmp_path), f"model.path={base_dir}", "rollout.temperature=0.6"))
    groups = run.loop._generate_groups(2, dict.fromkeys(("gen", "reward"), 0.0))
    for g in groups:
        b = g.payload
        assert isinstance(b, RolloutBatch) and len(b) == 4 and bool(b.prompt_mask[:, -1].all())
        assert torch.equal(b.lengths, b.response_mask.sum(-1).long()) and b.engine_logp.shape == b.response_ids.shape
        # the trainer scores the samples at the temperature they were drawn at
        m = b.response_mask.bool()
        torch.testing.assert_close(run.policy.logprobs(b)[0][m], b.engine_logp[m], atol=1e-4, rtol=0)


def _copy_run(smoke_run, tmp_path):
    import shutil

    dst = str(tmp_path / "run")
    shutil.copytree(smoke_run[0], dst)
    return dst


def test_a_resumed_run_judges_divergence_against_the_runs_first_step(smoke_run, base_dir, tmp_path):
    """The entropy check compares with the run's first rollout step, not with the first one after a resume (a run
    resumed after its entropy rose would otherwise never be flagged)."""
    from nemo_dapo.core.checkpoint import load_checkpoint
    from nemo_dapo.local.run import train

    run_dir = _copy_run(smoke_run, tmp_path)
    first = read_metrics(run_dir, "train")[0]["actor/entropy"]
    train(tiny_cfg(run_dir, "trainer.max_steps=3", f"model.path={base_dir}"))
    records = read_metrics(run_dir, "train")
    assert [r["step"] for r in records] == [1, 2, 3] and records[2]["actor/entropy"] != first
    health = load_checkpoint(os.path.join(run_dir, "checkpoints", "step_00000003.pt"))["health"]
    assert health["start_entropy"] == first and health["diverged"] == []


@pytest.mark.parametrize("has_config", [False, True], ids=["older-checkpoint-without-config", "allowed-change"])
def test_a_checkpoint_of_another_model_is_one_error_not_a_size_mismatch(smoke_run, tmp_path, capsys, has_config):
    from nemo_dapo.core.checkpoint import load_checkpoint
    from nemo_dapo.local.run_model import BASE_DIR, prepare_base_model

    run_dir = _copy_run(smoke_run, tmp_path)
    latest = os.path.join(run_dir, "checkpoints", "step_00000002.pt")
    if not has_config:  # as an older version wrote it
        state = load_checkpoint(latest)
        del state["config"]
        torch.save(state, latest)
    os.unlink(os.path.join(run_dir, "summary.json"))
    other = str(tmp_path / "other")
    prepare_base_model(tiny_cfg(other, "model.hidden_size=16", "model.intermediate_size=32", "warmup.max_steps=1"))
    argv = ["train", *TINY, f"run_dir={run_dir}", f"model.path={os.path.join(other, BASE_DIR)}",
            "model.hidden_size=16", "model.intermediate_size=32", "trainer.max_steps=3"]
    code = main(argv[:1] + (["--allow-config-change"] if has_config else []) + argv[1:])
    err = capsys.readouterr().err
    assert code == 2, err
    line = err.strip().splitlines()[-1]
    assert "Traceback" not in err and line.startswith(f"nemo-dapo train: error: checkpoint {latest} is of another "
                                                      "model")
    assert "do not match the configured model's shapes" in line and "[32" in line and "[16" in line
    assert ("holds no config" in line) != has_config and "resume=never" in line and "model.*" in line
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["step_00000001.pt", "step_00000002.pt"]
    assert "hidden_size: 32" in open(os.path.join(run_dir, "config.yaml")).read()  # the stored config kept
