import json
import os

import pytest

from nemo_dapo.core.answer_normalize import MAX_GROUND_TRUTH_CHARS
from nemo_dapo.data.readers import (MAX_CHARS_PER_TOKEN, DataFormatError, MathRow, from_verl_rows, ground_truth_of,
                                    normalize_ground_truth, prompt_far_too_long, read_aime2024, read_aime2025,
                                    read_dapo_math, read_dataset, read_gsm8k, read_math500, stable_id)
from nemo_dapo.data.template import apply_template

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data")
needs_data = pytest.mark.skipif(not os.path.isdir(DATA), reason="../shared/data is not present")
FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")  # a few real rows of each file, always present


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def verl_row(problem, answer, source="math_dapo", index=0):
    return {"data_source": source, "prompt": [{"role": "user", "content": apply_template(problem)}],
            "ability": "MATH", "reward_model": {"ground_truth": answer, "style": "rule"},
            "extra_info": {"index": index}}


# --- the real files ------------------------------------------------------------------------------------------------
@needs_data
def test_aime2024_parquet_keeps_copies_unless_asked():
    rows = read_aime2024(os.path.join(DATA, "aime-2024.parquet"))
    assert len(rows) == 960 and len({r.id for r in rows}) == 30
    assert all(r.prompt == apply_template(r.problem) for r in rows)
    assert all(r.ground_truth == str(int(r.ground_truth)) for r in rows)
    unique = read_aime2024(os.path.join(DATA, "aime-2024.parquet"), dedup=True)
    assert len(unique) == 30 and {r.id for r in unique} == {r.id for r in rows}


@needs_data
def test_aime2025_jsonl():
    rows = read_aime2025(os.path.join(DATA, "aime-2025.jsonl"))
    assert len(rows) == 30 and len({r.id for r in rows}) == 30
    assert rows[0].ground_truth == "70" and rows[0].prompt == apply_template(rows[0].problem)


@needs_data
def test_math500_jsonl_and_integer_filter():
    rows = read_math500(os.path.join(DATA, "math-500.jsonl"))
    ints = read_math500(os.path.join(DATA, "math-500.jsonl"), integer_only=True)
    # 311 plain integers plus '58,500', which normalises to an integer
    assert len(rows) == 500 and len(ints) == 312
    assert "58500" in {r.ground_truth for r in ints}
    assert all(r.solution for r in rows)


@needs_data
@pytest.mark.parametrize("name, n", [("gsm8k-test.jsonl", 1319), ("gsm8k-train.jsonl", 7473)])
def test_gsm8k_jsonl(name, n):
    rows = read_gsm8k(os.path.join(DATA, name))
    assert len(rows) == n
    assert all(r.ground_truth == str(int(r.ground_truth)) for r in rows)
    assert "####" not in rows[0].solution and rows[0].prompt == apply_template(rows[0].problem)


@needs_data
def test_read_dataset_dispatch():
    assert len(read_dataset("aime2025", os.path.join(DATA, "aime-2025.jsonl"))) == 30
    with pytest.raises(ValueError, match="aime2024"):
        read_dataset("aime24", os.path.join(DATA, "aime-2025.jsonl"))


# --- a few rows of the real files (tests/fixtures), so that a clone alone checks every reader's real format ------
def test_aime2025_fixture_rows():
    rows = read_aime2025(os.path.join(FIXTURES, "aime-2025-head4.jsonl"))
    assert [r.ground_truth for r in rows] == ["70", "588", "16", "117"]
    assert len({r.id for r in rows}) == 4 and all(r.prompt == apply_template(r.problem) for r in rows)
    assert rows[0].problem.startswith("Find the sum of all integer bases")


def test_math500_fixture_rows_and_integer_filter():
    path = os.path.join(FIXTURES, "math-500-6rows.jsonl")
    rows = read_math500(path)
    assert len(rows) == 6 and all(r.solution for r in rows)
    assert rows[1].ground_truth == "p - q"
    # '58,500' (the sixth row, MATH-500's row 344) is the one integer answer written with a comma
    assert [r.ground_truth for r in read_math500(path, integer_only=True)] == ["9", "58500"]


def test_gsm8k_fixture_rows():
    rows = read_gsm8k(os.path.join(FIXTURES, "gsm8k-test-head4.jsonl"))
    assert [r.ground_truth for r in rows] == ["18", "3", "70000", "540"]
    assert all("####" not in r.solution and r.solution for r in rows)
    assert rows[0].problem.startswith("Janet") and rows[0].prompt == apply_template(rows[0].problem)


def test_read_dataset_dispatch_on_the_fixtures():
    assert len(read_dataset("aime2025", os.path.join(FIXTURES, "aime-2025-head4.jsonl"))) == 4
    assert len(read_dataset("math500", os.path.join(FIXTURES, "math-500-6rows.jsonl"), integer_only=True)) == 2
    with pytest.raises(ValueError, match="aime2024"):
        read_dataset("aime24", os.path.join(FIXTURES, "aime-2025-head4.jsonl"))


# --- verl / DAPO-Math-17k ------------------------------------------------------------------------------------------
def test_dapo_math_jsonl_is_deduplicated_by_problem(tmp_path):
    rows = [verl_row(f"problem {i % 3}", str(i % 3), index=i) for i in range(30)]
    path = write_jsonl(tmp_path / "dapo.jsonl", rows)
    unique = read_dapo_math(path)
    assert [r.problem for r in unique] == ["problem 0", "problem 1", "problem 2"]
    assert len(read_dapo_math(path, dedup=False)) == 30


def test_dapo_math_parquet_streams_and_deduplicates(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    rows = [verl_row(f"p{i % 5}", f"0{i % 5}", index=i) for i in range(100)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "dapo.parquet", row_group_size=7)
    unique = read_dapo_math(tmp_path / "dapo.parquet")
    assert [(r.problem, r.ground_truth) for r in unique] == [(f"p{i}", str(i)) for i in range(5)]


def test_ids_are_stable_and_shared_by_copies():
    a = from_verl_rows([verl_row("x+1", "2"), verl_row("x+1", "2")], dedup=False)
    assert a[0].id == a[1].id == stable_id("math_dapo", "x+1")
    assert a[0].id != stable_id("math_dapo", "x+2")


def test_problem_falls_back_to_the_template_then_the_content():
    templated = from_verl_rows([verl_row("what is 2+2?", "4")])[0]
    assert templated.problem == "what is 2+2?"
    raw = {"prompt": [{"role": "user", "content": "plain text"}], "reward_model": {"ground_truth": "1"}}
    assert from_verl_rows([raw])[0] == MathRow(id=stable_id("verl", "plain text"), source="verl",
                                               problem="plain text", prompt="plain text", ground_truth="1")


def test_bare_string_prompt_gets_the_template_once():
    bare = {"prompt": "what is 2+2?", "reward_model": {"ground_truth": "4"}}
    templated = {"prompt": apply_template("what is 2+2?"), "reward_model": {"ground_truth": "4"}}
    a, b = from_verl_rows([bare, templated], dedup=False)
    assert a.prompt == b.prompt == apply_template("what is 2+2?") and a.problem == b.problem == "what is 2+2?"
    assert a.id == b.id


def test_conflicting_copies_keep_the_first_and_warn(caplog):
    rows = from_verl_rows([verl_row("q", "1"), verl_row("q", "2")])
    assert [r.ground_truth for r in rows] == ["1"]
    assert "different ground truth" in caplog.text


@pytest.mark.parametrize("value, expected", [
    ("025", "25"), ("540", "540"), (" -3 ", "-3"), ("+7", "7"), ("1,000", "1000"), (12, "12"), (12.0, "12"),
    ("\\frac{1}{2}", "\\frac{1}{2}"), ("1,00", "1,00"), ("3.5", "3.5"),
])
def test_ground_truth_normalisation(value, expected):
    assert normalize_ground_truth(value) == expected


# --- bad input: one test per path ------------------------------------------------------------------------------------
@pytest.mark.parametrize("reader", [read_dapo_math, read_aime2024, read_aime2025, read_math500, read_gsm8k])
def test_missing_file_names_the_path(reader, tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        reader(tmp_path / "nope.jsonl")


def test_invalid_json_line_names_file_and_row(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"problem": "p", "answer": "1"}, "{not json"])
    with pytest.raises(DataFormatError, match=r"a.jsonl: row 2: not valid JSON.*Fix"):
        read_aime2025(path)


def test_json_line_that_is_not_an_object(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", ["[1, 2]"])
    with pytest.raises(DataFormatError, match="row 1: expected a JSON object"):
        read_aime2025(path)


def test_verl_row_without_prompt(tmp_path):
    bad = verl_row("p", "1")
    del bad["prompt"]
    path = write_jsonl(tmp_path / "d.jsonl", [verl_row("q", "2"), bad])
    with pytest.raises(DataFormatError, match=r"d.jsonl: row 2: 'prompt' is missing.*Fix: verl rows need"):
        read_dapo_math(path)


def test_verl_row_without_user_message(tmp_path):
    bad = verl_row("p", "1")
    bad["prompt"] = [{"role": "system", "content": "hi"}]
    with pytest.raises(DataFormatError, match="row 1: 'prompt' has no user message"):
        read_dapo_math(write_jsonl(tmp_path / "d.jsonl", [bad]))


def test_verl_row_without_ground_truth(tmp_path):
    bad = verl_row("p", "1")
    bad["reward_model"] = {"style": "rule"}
    with pytest.raises(DataFormatError, match="row 1: missing reward_model.ground_truth"):
        read_dapo_math(write_jsonl(tmp_path / "d.jsonl", [bad]))


def test_aime2025_row_without_answer(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"problem": "p", "answer": "1"}, {"problem": "q"}])
    with pytest.raises(DataFormatError, match="a.jsonl: row 2: missing or empty 'answer'"):
        read_aime2025(path)


def test_math500_row_without_problem(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"problem": "  ", "answer": "1"}])
    with pytest.raises(DataFormatError, match="row 1: missing or empty 'problem'"):
        read_math500(path)


def test_gsm8k_answer_without_marker(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", [{"question": "q", "answer": "it is 18"}])
    with pytest.raises(DataFormatError, match="row 1: 'answer' has no '#### <final answer>' marker"):
        read_gsm8k(path)


def test_gsm8k_empty_final_answer(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", [{"question": "q", "answer": "work\n####  "}])
    with pytest.raises(DataFormatError, match="nothing after '####'"):
        read_gsm8k(path)


def test_empty_file(tmp_path):
    path = write_jsonl(tmp_path / "e.jsonl", [])
    with pytest.raises(DataFormatError, match="e.jsonl: no rows"):
        read_aime2025(path)


def test_unknown_suffix(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("a,b\n")
    with pytest.raises(DataFormatError, match="unknown file type.*parquet or .jsonl"):
        read_dapo_math(path)


def test_corrupt_parquet(tmp_path):
    pytest.importorskip("pyarrow")
    path = tmp_path / "d.parquet"
    path.write_bytes(b"this is not parquet")
    with pytest.raises(DataFormatError, match="d.parquet: not a readable parquet file"):
        read_dapo_math(path)


def test_a_prompt_of_exactly_the_character_bound_is_kept():
    # 16 tokens hold 16 * MAX_CHARS_PER_TOKEN characters: "more characters than that" only is far too long.
    assert not prompt_far_too_long("x" * (16 * MAX_CHARS_PER_TOKEN), 16)
    assert prompt_far_too_long("x" * (16 * MAX_CHARS_PER_TOKEN + 1), 16)


def test_a_ground_truth_one_character_over_the_bound_is_refused():
    assert ground_truth_of("7" * MAX_GROUND_TRUTH_CHARS, "f", 1, "gt") == "7" * MAX_GROUND_TRUTH_CHARS
    with pytest.raises(DataFormatError, match="characters long"):
        ground_truth_of("7" * (MAX_GROUND_TRUTH_CHARS + 1), "f", 1, "gt")


def test_the_gsm8k_answer_is_after_the_last_marker(tmp_path):
    path = tmp_path / "g.jsonl"
    path.write_text('{"question": "q?", "answer": "step #### not this\\n#### 18"}\n')
    (row,) = read_gsm8k(path)
    assert row.ground_truth == "18" and row.solution == "step #### not this"


def test_the_last_user_message_is_the_prompt():
    row = {"prompt": [{"role": "user", "content": apply_template("first")},
                      {"role": "assistant", "content": "ok"},
                      {"role": "user", "content": apply_template("second")}],
           "reward_model": {"ground_truth": "2"}}
    (r,) = from_verl_rows([row])
    assert r.problem == "second" and r.prompt == apply_template("second")
