import ast
import random

import pytest

from nemo_dapo.core.reward import verify
from nemo_dapo.data.readers import from_verl_rows
from nemo_dapo.data.task import ArithmeticTask, Sloppiness, render_chain, sloppy_solution, solve, split_score
from nemo_dapo.data.template import apply_template


def reference_value(problem: str) -> int:
    """Independent evaluator with standard precedence (parentheses, * before +/-), via the ast of the expression."""
    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp):
            a, b = ev(node.left), ev(node.right)
            ops = {ast.Add: lambda: a + b, ast.Sub: lambda: a - b, ast.Mult: lambda: a * b}
            return ops[type(node.op)]()
        raise AssertionError(f"unexpected node {ast.dump(node)}")
    return ev(ast.parse(problem, mode="eval"))


def test_same_seed_same_rows_and_other_seed_differs():
    task = ArithmeticTask()
    assert task.rows("train", 50, seed=3) == task.rows("train", 50, seed=3)
    assert task.rows("train", 50, seed=3) != task.rows("train", 50, seed=4)


@pytest.mark.parametrize("ops", ["+-", "+-*", "*"])
def test_answers_match_an_independent_evaluator(ops):
    task = ArithmeticTask(ops=ops, max_terms=5)
    for row in task.rows("train", 300, seed=0):
        problem = row["extra_info"]["raw_problem"]
        assert row["reward_model"]["ground_truth"] == str(reference_value(problem)), problem


def test_intermediate_values_stay_in_range():
    task = ArithmeticTask(max_operand=9, max_value=30)
    for problem in task.problems("train", 300, seed=1):
        lines, answer = solve(problem, "steps")
        values = [int(line.split("=")[1]) for line in lines]
        assert all(0 <= v <= 30 for v in values) and values[-1] == answer


@pytest.mark.parametrize("style, solution", [
    ("steps", "12+7=19\n19-5=14\nAnswer: 14"),
    ("rewrite", "=19-5\n=14\nAnswer: 14"),
])
def test_worked_solution_format(style, solution):
    row = ArithmeticTask(style=style).row("12+7-5", index=0)
    assert row["extra_info"]["solution"] == solution
    assert verify(row["extra_info"]["solution"], row["reward_model"]["ground_truth"]).acc


def test_rewrite_lines_are_the_rest_of_the_chain():
    problem = "((3+4)*2+1)*3"
    lines, answer = solve(problem, "rewrite")
    assert lines == ["=(7*2+1)*3", "=(14+1)*3", "=15*3", "=45"] and answer == 45
    # every rewritten line still has the problem's value under standard precedence
    assert all(reference_value(line[1:]) == reference_value(problem) for line in lines)


def test_row_schema_is_verl_and_reads_back():
    rows = ArithmeticTask().rows("heldout", 20, seed=0)
    r = rows[0]
    assert set(r) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    assert r["prompt"] == [{"role": "user", "content": apply_template(r["extra_info"]["raw_problem"])}]
    assert {"ground_truth", "style"} <= set(r["reward_model"])
    assert {"index", "raw_problem", "split"} <= set(r["extra_info"])
    math_rows = from_verl_rows(rows, "task")
    assert [m.problem for m in math_rows] == [x["extra_info"]["raw_problem"] for x in rows]
    assert [m.ground_truth for m in math_rows] == [x["reward_model"]["ground_truth"] for x in rows]


def test_splits_never_overlap_across_seeds_and_difficulties():
    a, b = ArithmeticTask(), ArithmeticTask(max_terms=3, max_operand=12)
    train = {p for t in (a, b) for s in range(3) for p in t.problems("train", 2000, seed=s, unique=False)}
    heldout = {p for t in (a, b) for s in range(3) for p in t.problems("heldout", 300, seed=s)}
    dev = {p for t in (a, b) for s in range(3) for p in t.problems("dev", 150, seed=s)}
    assert not train & heldout and not train & dev and not heldout & dev
    # the split is a pure function of the text: every problem lands where split_of says, for every task
    assert all(a.split_of(p) == b.split_of(p) == "heldout" for p in heldout)


def test_split_fractions_match_the_hash():
    task = ArithmeticTask(heldout_fraction=0.2, dev_fraction=0.1)
    rng = random.Random(0)
    problems = [task.sample_problem(rng) for _ in range(4000)]
    splits = [task.split_of(p) for p in problems]
    assert abs(splits.count("heldout") / 4000 - 0.2) < 0.03
    assert abs(splits.count("dev") / 4000 - 0.1) < 0.03
    assert all((split_score(p) < 0.2) == (s == "heldout") for p, s in zip(problems, splits))


def test_heldout_rows_are_distinct_and_labelled():
    rows = ArithmeticTask().rows("heldout", 250, seed=0)
    assert len({r["extra_info"]["raw_problem"] for r in rows}) == 250
    assert {r["extra_info"]["split"] for r in rows} == {"heldout"}


def all_problems(task):
    """Every problem text the knobs allow, by enumerating the chains (the slow reference of distinct_problems)."""
    out = set()

    def grow(first, value, pairs):
        if len(pairs) + 1 >= task.min_terms:
            out.add(render_chain(first, pairs))
        if len(pairs) + 1 == task.max_terms:
            return
        for op in set(task.ops):
            for b in range((task.max_multiplier if op == "*" else task.max_operand) + 1):
                new = value + b if op == "+" else value - b if op == "-" else value * b
                if 0 <= new <= task.max_value:
                    grow(first, new, pairs + [(op, b)])
    for first in range(task.max_operand + 1):
        grow(first, first, [])
    return out


@pytest.mark.parametrize("kwargs", [dict(max_terms=3), dict(max_terms=4, ops="+-*", max_multiplier=3),
                                    dict(min_terms=3, max_terms=4, ops="*-", max_operand=5, max_value=12),
                                    dict(max_terms=2, ops="+", max_operand=7, max_value=7)])
def test_the_counted_problems_are_the_enumerated_ones(kwargs):
    task = ArithmeticTask(**kwargs)
    assert task.distinct_problems() == len(all_problems(task))


def test_too_few_distinct_problems_is_refused_at_once_and_all_of_them_can_be_drawn(monkeypatch):
    task = ArithmeticTask(min_terms=2, max_terms=2, max_operand=4, max_value=8)
    train = {p for p in all_problems(task) if task.split_of(p) == "train"}
    assert len(train) <= task.most_distinct("train") < 500
    with monkeypatch.context() as m:  # refused before a single draw
        m.setattr(ArithmeticTask, "sample_problem", lambda *_: pytest.fail("drew a problem"))
        with pytest.raises(ValueError, match=r"cannot draw 500 distinct train problems \(the knobs allow at most"):
            task.problems("train", 500, seed=0)
    assert set(task.problems("train", len(train), seed=1)) == train
    with pytest.raises(ValueError, match=rf"could not draw {len(train) + 1} distinct train problems"):
        task.problems("train", len(train) + 1, seed=0)  # within the bound, past what there is: found by drawing
    with pytest.raises(ValueError, match="too few distinct problems"):  # a split the knobs leave empty
        ArithmeticTask(min_terms=2, max_terms=2, max_operand=2, max_value=4).problems("heldout", 5, seed=0)


@pytest.mark.parametrize("style", ["rewrite", "steps"])
def test_response_lengths_vary_with_the_number_of_terms(style):
    task = ArithmeticTask(min_terms=2, max_terms=6, style=style)
    n_lines = {len(r["extra_info"]["solution"].splitlines()) for r in task.rows("train", 300, seed=0)}
    assert n_lines == {2, 3, 4, 5, 6}  # 1..5 worked lines + the answer line


def test_multiplication_after_a_sum_is_parenthesised():
    task = ArithmeticTask(ops="+*", max_terms=6)
    problems = task.problems("train", 300, seed=0)
    assert any("(" in p for p in problems)
    for p in problems:
        assert reference_value(p) == solve(p, "steps")[1] == solve(p, "rewrite")[1]


@pytest.mark.parametrize("kwargs, match", [
    (dict(min_terms=1), "min_terms"),
    (dict(min_terms=4, max_terms=3), "min_terms"),
    (dict(ops="+/"), "ops"),
    (dict(style="prose"), "style"),
    (dict(max_operand=0), "max_operand"),
    (dict(heldout_fraction=0.0), "heldout_fraction"),
    (dict(heldout_fraction=0.6, dev_fraction=0.5), "heldout_fraction"),
])
def test_bad_knobs_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ArithmeticTask(**kwargs)


def test_unknown_split_and_bad_problem_text():
    with pytest.raises(ValueError, match="split"):
        ArithmeticTask().problems("test", 1, seed=0)
    with pytest.raises(ValueError, match="unexpected character"):
        solve("1+2/3")


@pytest.mark.parametrize("style", ["rewrite", "steps"])
def test_clean_sloppiness_gives_the_clean_solution(style):
    task = ArithmeticTask(style=style)
    rng = random.Random(0)
    for row in task.rows("train", 50, seed=0):
        problem = row["extra_info"]["raw_problem"]
        assert sloppy_solution(problem, rng, Sloppiness(), style) == row["extra_info"]["solution"]


def test_each_fault_makes_the_verifier_say_wrong_or_lengthens():
    rng = random.Random(0)
    problem, truth = "12+7-5+30", "44"
    for style in ("rewrite", "steps"):
        slipped = sloppy_solution(problem, rng, Sloppiness(slip_prob=1.0), style)
        assert not verify(slipped, truth).acc
    for _ in range(20):
        off_format = sloppy_solution(problem, rng, Sloppiness(format_prob=1.0))
        assert off_format.endswith(("Answer: 44.", "The answer is 44.")) and not verify(off_format, truth).acc
    rambling = sloppy_solution(problem, rng, Sloppiness(ramble_prob=1.0))
    assert "Check: " in rambling and verify(rambling, truth).acc
    assert len(rambling.splitlines()) == 2 * 3 + 1 and rambling.splitlines()[3] == "Check: 12+7=19"
    with pytest.raises(ValueError, match="slip_prob"):
        Sloppiness(slip_prob=1.5)


def test_ramble_passes_repeat_the_steps_one_to_n_times():
    rng = random.Random(1)
    problem, truth = "12+7-5+30", "44"
    counts = set()
    for _ in range(40):
        text = sloppy_solution(problem, rng, Sloppiness(ramble_prob=1.0, ramble_passes=3))
        passes = text.count("Check: ")
        counts.add(passes)
        assert len(text.splitlines()) == 3 * (1 + passes) + 1 and verify(text, truth).acc
    assert counts == {1, 2, 3}
    with pytest.raises(ValueError, match="ramble_passes"):
        Sloppiness(ramble_passes=0)


def test_one_ramble_pass_draws_no_extra_random_number():
    # The default job's warm-up data must not change: with one pass the rng is consumed as before (one draw per
    # worked line for the slip, one for rambling, one for the format).
    problem = "12+7-5+30"
    rng, reference = random.Random(4), random.Random(4)
    sloppy_solution(problem, rng, Sloppiness(ramble_prob=1.0, ramble_passes=1))
    for _ in range(3 + 2):
        reference.random()
    assert rng.getstate() == reference.getstate()
    sloppy_solution(problem, rng, Sloppiness(ramble_prob=1.0, ramble_passes=2))
    for _ in range(3 + 2):
        reference.random()
    assert rng.getstate() != reference.getstate()  # two passes draw the count: the check can fail


def test_a_slip_always_changes_a_small_result():
    # 1+2 = 3 (< 10): a slip writes 3-1, 3+1 or 3+10, never 3 itself (Sloppiness: "off by 1 or 10").
    for seed in range(40):
        text = sloppy_solution("1+2", random.Random(seed), Sloppiness(slip_prob=1.0))
        first = text.splitlines()[0]
        assert first.startswith("1+2=") and int(first.split("=")[1]) in (2, 4, 13), (seed, text)
