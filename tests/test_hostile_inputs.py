"""Hostile inputs: data rows, configs, `eval` arguments, errors in `cli.main`, divergence, pathological ground truths.

Every case asserts the exit code (or the exception) and that the message names the input (file, row and field; the
config key; the flag). CLI cases run ``cli.main`` in this process: the same path as the console script.
"""
import json
import math
import os

import pytest

from nemo_dapo import cli
from nemo_dapo.core import answer_normalize as an
from nemo_dapo.core import health
from nemo_dapo.core.reward import _chunk_bounds, verify_batch
from nemo_dapo.data.readers import (MAX_CHARS_PER_TOKEN, DataFormatError, read_aime2025, read_dapo_math,
                                    read_gsm8k)
from tests.data.test_readers import verl_row, write_jsonl

HUGE = 10_000_000  # characters of a pathological ground truth


def err_of(argv, capsys, code, logs=False):
    """Run the CLI in-process; assert the exit code and one error line without a traceback; return that line.

    ``logs``: a training run's console log precedes the error line on stderr.
    """
    assert cli.main(argv) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err and (logs or err.strip().count("\n") == 0), err
    return err.strip().splitlines()[-1]


# ---- 1. data rows ---------------------------------------------------------------------------------------------------
def _write(tmp_path, kind, rows):
    if kind == "jsonl":
        return write_jsonl(tmp_path / "rows.jsonl", rows)
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _with_truth(value):
    row = verl_row("what is 1+1?", "2")
    if value is _MISSING:
        del row["reward_model"]["ground_truth"]
    else:
        row["reward_model"]["ground_truth"] = value
    return row


_MISSING = object()


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
@pytest.mark.parametrize("value, fragment", [
    (_MISSING, "missing reward_model.ground_truth"),
    ("", "'reward_model.ground_truth' is empty"),
    ("  \t ", "'reward_model.ground_truth' is only whitespace"),
    (float("nan"), "'reward_model.ground_truth' is nan"),
    (["1", "2"], "'reward_model.ground_truth' is a list"),
    (True, "'reward_model.ground_truth' is a boolean"),
    ("7" * 5000, "'reward_model.ground_truth' is 5000 characters long"),
], ids=["missing", "empty", "whitespace", "nan", "list", "bool", "long"])
def test_bad_ground_truth_names_file_row_and_field(tmp_path, kind, value, fragment):
    path = _write(tmp_path, kind, [_with_truth(value)])
    with pytest.raises(DataFormatError) as e:
        read_dapo_math(path)
    msg = str(e.value)
    assert f"rows.{kind}: row 1:" in msg and fragment in msg and "Fix:" in msg


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_integer_ground_truth_is_normalised_not_refused(tmp_path, kind):
    rows = read_dapo_math(_write(tmp_path, kind, [_with_truth(25)]))
    assert rows[0].ground_truth == "25"


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
@pytest.mark.parametrize("content, fragment", [("", "is empty"), ("   \n", "is only whitespace")])
def test_empty_prompt_names_the_field(tmp_path, kind, content, fragment):
    row = verl_row("x", "1")
    row["prompt"][0]["content"] = content
    with pytest.raises(DataFormatError, match=rf"rows.{kind}: row 1: 'prompt\[-1\].content' {fragment}"):
        read_dapo_math(_write(tmp_path, kind, [row]))


def test_bare_whitespace_prompt(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "  ", "reward_model": {"ground_truth": "1"}}])
    with pytest.raises(DataFormatError, match=r"d.jsonl: row 1: 'prompt' is only whitespace"):
        read_dapo_math(path)


@pytest.mark.parametrize("obj, fragment", [
    ({"problem": "p", "answer": [1, 2]}, "'answer' is a list"),
    ({"problem": "p", "answer": False}, "'answer' is a boolean"),
    ({"problem": ["p"], "answer": "1"}, "'problem' is list"),
])
def test_plain_jsonl_rows_are_checked_the_same_way(tmp_path, obj, fragment):
    path = write_jsonl(tmp_path / "a.jsonl", [{"problem": "ok", "answer": "3"}, obj])
    with pytest.raises(DataFormatError, match=rf"a.jsonl: row 2: {fragment}"):
        read_aime2025(path)


def test_gsm8k_nan_answer(tmp_path):
    path = tmp_path / "g.jsonl"
    path.write_text('{"question": "q", "answer": NaN}\n')
    with pytest.raises(DataFormatError, match=r"g.jsonl: row 1: 'answer' is float. Fix: 'answer' must be a non-empty string"):
        read_gsm8k(path)


def test_non_utf8_file_names_the_byte_offset(tmp_path):
    first = b'{"problem": "p", "answer": "1"}\n'
    second = b'{"problem": "caf\xe9", "answer": "2"}\n'
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(first + second)
    with pytest.raises(DataFormatError) as e:
        read_aime2025(path)
    offset = len(first) + second.index(b"\xe9")
    assert "latin1.jsonl: row 2: not UTF-8" in str(e.value) and f"byte offset {offset}" in str(e.value)


def test_a_parquet_file_given_to_a_jsonl_reader_is_named_as_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    path = tmp_path / "gsm8k.parquet"
    pq.write_table(pa.table({"question": ["1+1?"], "answer": ["#### 2"]}), path)
    with pytest.raises(DataFormatError, match="a parquet file, read here as jsonl") as e:  # was "not UTF-8"
        read_gsm8k(path)
    assert "re-encode" not in str(e.value)


def test_a_directory_given_as_a_data_file_is_named_as_one(model_dir, tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="is a directory"):  # was "file not found"
        read_gsm8k(tmp_path)
    err = err_of(["eval", "--model", str(model_dir), "--data", str(tmp_path), "--format", "gsm8k"], capsys, 2)
    assert f"--data {str(tmp_path)!r}: a directory" in err


def test_utf8_byte_order_mark_is_skipped(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"problem": "p", "answer": "1"}\n')
    assert read_aime2025(path)[0].ground_truth == "1"


def test_json_nesting_bomb_is_a_data_error(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text("[" * 200_000 + "\n")
    with pytest.raises(DataFormatError, match="deep.jsonl: row 1: JSON that cannot be read"):
        read_aime2025(path)


def test_far_too_long_prompt_is_dropped_before_tokenizing():
    from nemo_dapo.data.readers import MathRow
    from nemo_dapo.local.run_data import encode

    seen = []

    class Tok:
        bos_token_id, pad_token_id = 1, 0

        def __call__(self, texts, add_special_tokens=False):
            seen.extend(len(text) for text in texts)
            return {"input_ids": [[5] * len(text.split()) for text in texts]}

    rows = [MathRow("a", "s", "p", "short prompt", "1"),
            MathRow("b", "s", "q", "x " * (16 * MAX_CHARS_PER_TOKEN), "2")]
    prompts = encode(Tok(), rows, max_prompt_tokens=16, what="train set")
    assert len(prompts) == 1 and prompts.ground_truths == ["1"]
    assert max(seen) <= 16 * MAX_CHARS_PER_TOKEN  # the long row never reached the tokenizer


# ---- 2. config --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, fragment", [
    ("optim.lr=0", "'optim.lr' = 0.0 must be > 0"),
    ("optim.lr=-1e-3", "'optim.lr' = -0.001 must be > 0"),
    ("optim.lr=.nan", "'optim.lr' = nan is not a finite number"),
    ("optim.lr=.inf", "'optim.lr' = inf is not a finite number"),
    ("warmup.lr=0", "'warmup.lr'"),
    ("model.num_attention_heads=3", "'model.num_attention_heads' = 3 does not divide model.hidden_size = 64"),
    ("model.num_key_value_heads=3", "'model.num_key_value_heads' = 3 does not divide"),
    ("algorithm.group_size=1", "'algorithm.group_size' = 1"),
    ("warmup.slip_prob=1.5", "'warmup.slip_prob' = 1.5 is out of range"),
    ("algorithm.dynamic_sampling.safety=0.5", "'algorithm.dynamic_sampling.safety' = 0.5 is out of range"),
    ("data.min_terms=1", "data.*"),
    ("optim.betas=[0.9,1.5]", "'optim.betas[1]' = 1.5"),
    ("trainer.max_entropy_fraction=1.5", "'trainer.max_entropy_fraction' = 1.5"),
    ("optim.betas=[0.9", "override 'optim.betas=[0.9'"),
    ("rollout.temperature=1e-9", "'rollout.temperature' = 1e-09 is below 0.0001"),
    ("eval.temperature=1e-39", "'eval.temperature' = 1e-39 is below 0.0001"),
    ("eval.max_new_tokens=0", "'eval.max_new_tokens' must be >= 1 or null, got 0"),  # was read as null
    ("warmup.max_new_tokens=-5", "'warmup.max_new_tokens' must be >= 1 or null, got -5"),
    ("data.train_file=/x/train.jsonl", "'data.train_file' is set, but data.task=arithmetic"),
    ("data.heldout_file=/x/aime.parquet", "'data.heldout_file' is set, but data.task=arithmetic"),
    ("name=a/../..", "'name' = 'a/../..' must be a plain folder name"),
    ("name=''", "'name' = '' must be a plain folder name"),
    ("run_dir=/dev/null", "'run_dir' = '/dev/null' is a file, not a directory"),
    # the penalty would start past the cap (40) of every response: overlong shaping silently off
    ("algorithm.overlong.l_max=100", "'algorithm.overlong.l_max' = 100 puts the soft penalty's start (l_max - l_cache "
                                     "= 88) at or past the generation cap 40"),
    ("algorithm.group_size=${oops}", "'algorithm.group_size' (in "),  # names the key, not only the recipe
    ("algorithm.dynamic_sampling.max_gen_batch_size=10", "'algorithm.dynamic_sampling.max_gen_batch_size' = 10 is "
                                                         "below gen_batch_size=100"),
], ids=lambda v: v if "=" in str(v) else None)
def test_untrainable_config_values_exit_2_with_the_key(override, fragment, capsys):
    extra = ["algorithm.dynamic_sampling.adaptive=false", "algorithm.dynamic_sampling.gen_batch_size=100"] \
        if "max_gen_batch_size" in override else []  # a fixed size above the bound: the bound did not hold
    err = err_of(["train", "--print-config", *extra, override], capsys, 2)
    assert fragment in err and "nemo-dapo train: error:" in err


@pytest.mark.parametrize("override, fragment", [
    ("rollout.max_new_tokens=256", "'rollout.max_new_tokens' = 256 leaves no room for a prompt: the model has 256"),
    ("eval.max_new_tokens=300", "'eval.max_new_tokens' = 300"),
    ("rollout.temperature=0", "'rollout.temperature' = 0.0"),
])
def test_checks_that_need_the_model_run_before_any_work(override, fragment, tmp_path, capsys):
    run_dir = tmp_path / "run"
    err = err_of(["train", f"run_dir={run_dir}", override], capsys, 2)
    assert fragment in err and "Fix:" in err
    assert not run_dir.exists()  # refused before the run directory was touched


def test_an_interpolation_in_an_override_resolves_in_the_whole_config():
    from nemo_dapo.local.config import load_config
    cfg = load_config("tiny_cpu", ["run_dir=/tmp/x/${name}", "trainer.max_steps=${trainer.train_batch_size}"])
    assert cfg.run_dir == "/tmp/x/tiny_cpu" and cfg.trainer.max_steps == cfg.trainer.train_batch_size == 16


@pytest.mark.parametrize("damage", ["weights missing", "weights truncated"])
def test_a_model_directory_with_damaged_weights_exits_2_naming_it(damage, tmp_path, capsys):
    from nemo_dapo.models.decoder import build_model, save_model
    model = save_model(build_model(dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64),
                                   vocab_size=32), tmp_path / "m")
    weights = os.path.join(model, "model.safetensors")
    if damage == "weights missing":
        os.remove(weights)
    else:
        with open(weights, "r+b") as f:
            f.truncate(40)
    data = write_jsonl(tmp_path / "a.jsonl", [{"problem": "p", "answer": "1"}])
    err = err_of(["eval", "--model", model, "--data", str(data), "--format", "gsm8k"], capsys, 2)
    assert f"cannot load the model in {model!r}" in err and "missing or damaged" in err


def test_max_new_tokens_against_a_model_directory(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"max_position_embeddings": 32}))
    err = err_of(["train", f"run_dir={tmp_path / 'run'}", f"model.path={tmp_path / 'm'}"], capsys, 2)
    assert "'rollout.max_new_tokens' = 40" in err and "config.json" in err


def test_yaml_syntax_error_is_one_line_with_file_line_and_column(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("defaults:\n  - /dapo_base\n  - _self_\nname: x\n  oops: [1\n")
    err = err_of(["train", "--config-name", str(bad), "--print-config"], capsys, 2)
    assert "bad.yaml" in err and "line 5, column" in err and "YAML syntax error" in err


@pytest.mark.parametrize("content, fragment", [
    (b"name: caf\xe9\n", "not UTF-8"),
    (b"- just\n- a list\n", "top level must be a mapping"),
])
def test_unreadable_yaml_files(tmp_path, capsys, content, fragment):
    bad = tmp_path / "odd.yaml"
    bad.write_bytes(content)
    err = err_of(["train", "--config-name", str(bad), "--print-config"], capsys, 2)
    assert "odd.yaml" in err and fragment in err


# ---- 3. eval arguments ---------------------------------------------------------------------------------------------
@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


@pytest.mark.parametrize("extra, fragment", [
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--limit", "-3"], "--limit must be >= 1"),
    (["--limit", "0"], "--limit must be >= 1"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--samples", "0"], "--samples must be >= 1, got 0"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--format", "aime24"], "--format 'aime24' is not one of"),
    (["--verifier", "exact"], "--verifier 'exact' is not one of"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--temperature", "nan"], "--temperature must be 0 (greedy) or a finite number >= 0.0001"),
    (["--temperature", "1e-9"], "--temperature must be 0 (greedy) or a finite number >= 0.0001"),
    (["--temperature", "-1"], "--temperature must be 0 (greedy) or a finite number >= 0.0001"),
    (["--out", "."], "--out '.' is a directory; it names the JSON file"),  # refused before the evaluation runs
])
def test_eval_arguments_exit_2_naming_the_flag(extra, fragment, model_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "a.jsonl", [{"problem": "p", "answer": "1"}])
    err = err_of(["eval", "--model", str(model_dir), "--data", str(data), *extra], capsys, 2)
    assert fragment in err and err.startswith("nemo-dapo eval: error:")


def test_eval_suggests_the_close_format(model_dir, tmp_path, capsys):
    err = err_of(["eval", "--model", str(model_dir), "--data", "x.jsonl", "--format", "aime2O24"], capsys, 2)
    assert "did you mean 'aime2024'" in err


@pytest.mark.parametrize("which", ["--model", "--data", "--out"])
def test_eval_missing_paths_are_named(which, model_dir, tmp_path, capsys):
    paths = {"--model": str(model_dir), "--data": str(write_jsonl(tmp_path / "a.jsonl", [{"problem": "p"}]))}
    paths[which] = str(tmp_path / "nowhere" / "x")
    argv = ["eval"] + [a for flag, path in paths.items() for a in (flag, path)]
    err = err_of(argv, capsys, 2)
    assert which in err and "nowhere" in err


# ---- 4. cli.main: one line, --debug, exit codes ------------------------------------------------------------------
def _raising(exc):
    def run(cfg, **kwargs):
        raise exc
    return run


def test_debug_flag_and_env_var_keep_the_traceback(capsys, monkeypatch):
    assert cli.main(["--debug", "train", "--print-config", "optim.lr=0"]) == 2
    assert "Traceback" in capsys.readouterr().err
    assert cli.main(["train", "--print-config", "optim.lr=0", "--debug"]) == 2
    assert "Traceback" in capsys.readouterr().err
    monkeypatch.setenv("NEMO_DAPO_DEBUG", "1")
    assert cli.main(["train", "--print-config", "optim.lr=0"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "'optim.lr'" in err


@pytest.mark.parametrize("exc, code, fragment", [
    (health.TrainingDiverged("training diverged at rollout step 3: ... optim.lr=1.0"), cli.EXIT_DIVERGED,
     "stopped: training diverged"),
    (OSError(28, "No space left on device", "/runs/x/summary.json"), cli.EXIT_UNWRITABLE, "summary.json"),
    (PermissionError(13, "Permission denied", "/data/secret.jsonl"), cli.EXIT_BAD_INPUT, "secret.jsonl"),
    (KeyboardInterrupt(), cli.EXIT_INTERRUPTED, "interrupted"),
    (ModuleNotFoundError("verifier mode='math_verify' needs the math-verify package: `pip install math-verify`"),
     cli.EXIT_BAD_INPUT, "pip install math-verify"),
])
def test_anticipated_errors_have_distinct_codes(exc, code, fragment, monkeypatch, capsys):
    import nemo_dapo.local.run as run_mod

    monkeypatch.setattr(run_mod, "train", _raising(exc))
    err = err_of(["train", "trainer.max_steps=1"], capsys, code)
    assert fragment in err


def test_a_bug_keeps_its_traceback_and_exits_1(monkeypatch, capsys):
    import nemo_dapo.local.run as run_mod

    monkeypatch.setattr(run_mod, "train", _raising(TypeError("unsupported operand")))
    assert cli.main(["train"]) == cli.EXIT_INTERNAL
    err = capsys.readouterr().err
    assert "Traceback" in err and "internal error (TypeError: unsupported operand)" in err


def test_exit_codes_are_distinct_and_agree_with_the_run_directory():
    from nemo_dapo.local import run_dir

    codes = [cli.EXIT_OK, cli.EXIT_INTERNAL, cli.EXIT_BAD_INPUT, cli.EXIT_BUDGET, cli.EXIT_ENGINE, cli.EXIT_BUSY,
             cli.EXIT_UNWRITABLE, cli.EXIT_DIVERGED, cli.EXIT_INTERRUPTED]
    assert len(set(codes)) == len(codes) and set(codes) <= set(cli.EXIT_CODES)
    assert (cli.EXIT_BUSY, cli.EXIT_UNWRITABLE, cli.EXIT_DIVERGED) == (run_dir.EXIT_BUSY, run_dir.EXIT_UNWRITABLE,
                                                                       run_dir.EXIT_DIVERGED)


# ---- 5. training health ------------------------------------------------------------------------------------------------
def test_skip_streak_grows_on_fully_skipped_steps_and_resets():
    s = health.skipped_streak(0, {"actor/skipped": 4.0, "actor/updates": 4})
    s = health.skipped_streak(s, {})  # a step without updates (nothing kept) changes nothing
    assert s == 4 and health.skipped_streak(s, {"actor/skipped": 4.0, "actor/updates": 4}) == 8
    assert health.skipped_streak(8, {"actor/skipped": 1.0, "actor/updates": 4}) == 1


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(streak=8, max_skipped_updates=8, entropy=0.5, start_entropy=0.5), "trainer.max_skipped_updates=8"),
    (dict(streak=0, max_skipped_updates=8, entropy=math.log(512) * 0.95, start_entropy=0.7),
     "trainer.max_entropy_fraction=0.9"),
    (dict(streak=0, max_skipped_updates=8, entropy=float("nan"), start_entropy=0.7), "entropy of the rollouts is nan"),
    (dict(streak=7, max_skipped_updates=8, entropy=1.0, start_entropy=0.7), None),
    (dict(streak=99, max_skipped_updates=0, entropy=1.0, start_entropy=0.7), None),  # 0 = never
    (dict(streak=0, max_skipped_updates=8, entropy=6.2, start_entropy=6.1), None),  # started near uniform
])
def test_divergence_signals(kwargs, fragment):
    reason = health.divergence(vocab_size=512, max_entropy_fraction=0.9, **kwargs)
    assert (fragment in reason) if fragment else reason == ""


def test_a_diverging_run_stops_with_a_checkpoint_and_exit_7(tmp_path, monkeypatch, capsys):
    from tests.local.test_run import TINY

    _diverge(monkeypatch)
    run_dir = tmp_path / "run"
    argv = ["train", *TINY, f"run_dir={run_dir}", "trainer.max_skipped_updates=2", "trainer.max_steps=20",
            "trainer.val_every=0", "trainer.save_every=100", "data.heldout_size=2", "eval.n_samples=1",
            "warmup.max_steps=1"]
    err = err_of(argv, capsys, cli.EXIT_DIVERGED, logs=True)
    assert err.startswith("nemo-dapo train: stopped: training diverged at rollout step 1") and "optim.lr=0.001" in err
    assert os.listdir(run_dir / "checkpoints") and not (run_dir / "summary.json").exists()


def _diverge(monkeypatch):
    from nemo_dapo.local.policy import LocalPolicy

    def nan_step(self, batch, *, norm, loss_fn):
        return {"loss": float("nan"), "skipped": 1.0}  # what a non-finite loss reports: weights unchanged

    monkeypatch.setattr(LocalPolicy, "train_step", nan_step)


def _ckpts(run_dir):
    d = run_dir / "checkpoints"
    return {n: os.path.getmtime(d / n) for n in sorted(os.listdir(d))}


@pytest.mark.slow
def test_a_diverged_run_stays_diverged_until_the_user_continues_it(tmp_path, monkeypatch, capsys):
    """Exit 7 is recorded (diverged.json and the checkpoint); a rerun exits 7 again without training (before, it
    continued silently from the diverged checkpoint); --resume-diverged continues it, and it stays marked."""
    import shutil

    from nemo_dapo.core.checkpoint import load_checkpoint
    from tests.local.test_run import TINY

    run_dir = tmp_path / "run"
    argv = ["train", *TINY, f"run_dir={run_dir}", "trainer.max_skipped_updates=2", "trainer.max_steps=2",
            "trainer.val_every=0", "trainer.save_every=100", "data.heldout_size=2", "eval.n_samples=1",
            "warmup.max_steps=1"]
    with monkeypatch.context() as m:
        _diverge(m)
        err = err_of(argv, capsys, cli.EXIT_DIVERGED, logs=True)
    assert "training diverged at rollout step 1" in err and "--resume-diverged" in err
    recorded = json.loads((run_dir / "diverged.json").read_text())["divergences"]
    assert [(d["step"], d["resumed"]) for d in recorded] == [(1, False)] and "skipped" in recorded[0]["reason"]
    state = load_checkpoint(str(run_dir / "checkpoints" / "step_00000001.pt"))
    assert state["health"]["diverged"][0]["step"] == 1  # the checkpoint carries it too
    before, metrics = _ckpts(run_dir), (run_dir / "metrics.jsonl").read_text()

    # The healthy code now: a rerun must still refuse, naming the way out, and change nothing.
    err = err_of(argv, capsys, cli.EXIT_DIVERGED)
    assert err.startswith(f"nemo-dapo train: error: run directory {str(run_dir)!r} holds a run that diverged at "
                          "rollout step 1") and "resume=never" in err and "--resume-diverged" in err
    assert _ckpts(run_dir) == before and (run_dir / "metrics.jsonl").read_text() == metrics
    assert not (run_dir / "summary.json").exists()
    copy = tmp_path / "copy"  # the checkpoint alone (diverged.json not copied) still says so
    shutil.copytree(run_dir, copy)
    os.unlink(copy / "diverged.json")
    err = err_of([a.replace(str(run_dir), str(copy)) for a in argv], capsys, cli.EXIT_DIVERGED)
    assert "diverged at rollout step 1" in err

    assert cli.main(argv[:1] + ["--resume-diverged"] + argv[1:]) == 0  # the user says otherwise: continued
    capsys.readouterr()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rollout_steps"] == 2 and [d["resumed"] for d in summary["diverged"]] == [True]
    assert json.loads((run_dir / "diverged.json").read_text())["divergences"][0]["resumed"] is True
    assert cli.main(argv) == 0  # finished: reported, not refused
    assert "is finished" in capsys.readouterr().err

    never = argv + ["resume=never"]  # starting over clears the record
    assert cli.main(never) == 0
    capsys.readouterr()
    assert not (run_dir / "diverged.json").exists()
    assert json.loads((run_dir / "summary.json").read_text())["diverged"] == []


# ---- 6. verifier: ground truths cost what a short one costs ------------------------------------------------------
def _spy(monkeypatch, name):
    calls = []
    real = getattr(an, name)

    def spy(text):
        calls.append(len(text))
        return real(text)

    monkeypatch.setattr(an, name, spy)
    return calls


@pytest.mark.parametrize("mode", ["dapo", "tolerant"])
def test_ground_truth_normalised_once_per_group(mode, monkeypatch):
    calls = _spy(monkeypatch, "minerva_normalize")
    g = 16
    responses = [f"work\nAnswer: {i}" for i in range(2 * g)]
    responses[g + 3] = "work\nAnswer: 14"
    truths = ["\\frac{1}{2}"] * g + ["14"] * g
    verdicts = verify_batch(responses, truths, mode=mode, num_workers=1)
    assert [i for i, v in enumerate(verdicts) if v.acc] == [g + 3]
    per_response = {"dapo": 1, "tolerant": 2}[mode]  # tolerant: canonical form and the reference fallback
    assert len(calls) <= per_response * 2 * g + per_response * 2  # 2 distinct ground truths, each once


@pytest.mark.parametrize("mode", ["dapo", "tolerant"])
def test_ten_megabyte_ground_truth_is_never_normalised(mode, monkeypatch):
    calls = _spy(monkeypatch, "minerva_normalize")
    huge = "1" * HUGE
    verdicts = verify_batch(["Answer: " + "1" * 200] * 8, [huge] * 8, mode=mode, num_workers=1)
    assert not any(v.acc for v in verdicts)
    assert calls and max(calls) <= an.MAX_GROUND_TRUTH_CHARS


def test_math_verify_is_bounded_the_same_way(monkeypatch):
    pytest.importorskip("math_verify")
    import math_verify

    lengths = []
    real = math_verify.parse

    def parse(text, *a, **k):
        lengths.append(len(text))
        return real(text, *a, **k)

    monkeypatch.setattr(math_verify, "parse", parse)
    responses = ["so \\boxed{4}"] * 4 + ["so \\boxed{5}"] * 4
    verdicts = verify_batch(responses, ["4"] * 4 + ["1" * HUGE] * 4, mode="math_verify", num_workers=1)
    assert [v.acc for v in verdicts] == [True] * 4 + [False] * 4
    assert max(lengths) <= an.MAX_GROUND_TRUTH_CHARS + len("\\boxed{}")
    assert len(lengths) == 8 + 1  # 8 responses, the short ground truth once for its group, the huge one never


def test_pool_chunks_never_split_a_group():
    truths = [t for t in "abcde" for _ in range(4)]
    bounds = _chunk_bounds(truths, 3)
    assert bounds[0][0] == 0 and bounds[-1][1] == len(truths)
    assert all(b == c for (_, b), (c, _) in zip(bounds, bounds[1:]))
    assert all(truths[b - 1] != truths[b] for _, b in bounds[:-1])


def test_readers_refuse_what_the_verifier_could_never_match(tmp_path):
    ok = "9" * an.MAX_GROUND_TRUTH_CHARS
    assert read_dapo_math(write_jsonl(tmp_path / "ok.jsonl", [_with_truth(ok)]))[0].ground_truth == ok
    with pytest.raises(DataFormatError, match="long.jsonl: row 1: 'reward_model.ground_truth' is 1201"):
        read_dapo_math(write_jsonl(tmp_path / "long.jsonl", [_with_truth(ok + "9")]))


# ---- 7. `plan` arguments -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, fragment", [
    ("trainer.num_nodes=0", "trainer.num_nodes=0 must be an integer >= 1"),
    ("trainer.devices=0", "trainer.devices=0 must be an integer >= 1"),
    ("trainer.devices=-8", "trainer.devices=-8 must be an integer >= 1"),
    ("model.tensor_model_parallel_size=abc", "model.tensor_model_parallel_size='abc' must be an integer >= 1"),
    ("model.tensor_model_parallel_size=1.5", "model.tensor_model_parallel_size=1.5 must be an integer >= 1"),
    ("model.tensor_model_parallel_size=-2", "model.tensor_model_parallel_size=-2 must be an integer >= 1"),
    ("model.pipeline_model_parallel_size=0", "model.pipeline_model_parallel_size=0 must be an integer >= 1"),
    ("model.expert_model_parallel_size=true", "model.expert_model_parallel_size=True must be an integer >= 1"),
    ("plan.assume.decode_efficiency=0", "plan.assume.decode_efficiency=0 must be a number in (0, 1]"),
    ("plan.assume.hfu=-1", "plan.assume.hfu=-1 must be a number in (0, 1]"),
    ("plan.assume.hfu=1.5", "plan.assume.hfu=1.5 must be a number in (0, 1]"),
    ("plan.assume.refit_gb_per_s=0", "plan.assume.refit_gb_per_s=0 must be a number > 0"),
    ("plan.assume.pcie_gb_per_s=-25", "plan.assume.pcie_gb_per_s=-25 must be a number > 0"),
    ("plan.assume.handover_gb_per_s=.inf", "plan.assume.handover_gb_per_s=inf must be a number > 0"),
    ("plan.assume.mean_prompt_tokens=-5", "plan.assume.mean_prompt_tokens=-5 must be a number > 0"),
    ("plan.assume.mean_response_tokens=0", "plan.assume.mean_response_tokens=0 must be a number > 0"),
    ("plan.assume.truncated_fraction=-0.1", "plan.assume.truncated_fraction=-0.1 must be a number in [0, 1]"),
    ("plan.assume.usable_fraction=0", "plan.assume.usable_fraction=0 must be a number in (0, 1]"),
    ("plan.assume.oversample=0", "plan.assume.oversample=0 must be a number >= 1"),
    ("plan.assume.pass_rate=0", "plan.assume.pass_rate=0 must be a number in (0, 1]"),
    ("plan.assume.cuda_reserved_gb=abc", "plan.assume.cuda_reserved_gb='abc' must be a number >= 0"),
    ("+plan.assume.hfu_dense=0.4", "plan.assume.hfu_dense: unknown assumption"),
    ("plan.arch.num_layers=0", "plan.arch.num_layers=0 must be an integer >= 1"),
    ("model.dapo.eps_hihg=0.3", "override 'model.dapo.eps_hihg=0.3': no key 'model.dapo.eps_hihg'"),
], ids=lambda v: v if "=" in str(v) else None)
def test_plan_arguments_exit_2_naming_the_key(override, fragment, capsys):
    err = err_of(["plan", "qwen2.5-32b_h100", override], capsys, 2)
    assert fragment in err and err.startswith("nemo-dapo plan: error:")
    assert "fix" in err.lower() or "use +" in err  # every message says how to get out


def test_plan_unknown_recipe_names_the_recipes_that_exist(capsys):
    err = err_of(["plan", "qwen2.5-32b-h100"], capsys, 2)
    assert "config 'qwen2.5-32b-h100' not found" in err
    known = err.split("known recipes: ")[1].rstrip(")").split(", ")
    assert "qwen2.5-32b_h100" in known and "moe-mixtral-8x22b_h20" in known and len(known) == len(set(known))


@pytest.mark.parametrize("override", ["plan.assume.decode_step_floor_ms=0", "plan.assume.sleep_wake_s=0",
                                      "plan.assume.truncated_fraction=0", "plan.assume.hfu=1"])
def test_plan_accepts_the_edges_of_each_range(override, capsys):
    assert cli.main(["plan", "qwen2.5-32b_h100", override]) == 0
    out = capsys.readouterr().out
    assert "-> fits" in out and override.split("plan.assume.")[1] in out  # the assumptions line of the report
