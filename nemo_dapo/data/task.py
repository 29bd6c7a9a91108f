"""A procedural integer-answer math task: arithmetic chains solved with worked steps.

``12+7-5`` is solved as::

    12+7=19
    19-5=14
    Answer: 14

Rows come out in the verl / DAPO-Math-17k row schema (``data_source``, ``prompt=[{role, content}]``, ``ability``,
``reward_model={ground_truth, style}``, ``extra_info={index, raw_problem, split}``), so the same reader, prompt
template and verifier serve this task and the real data sets. ``extra_info['solution']`` carries the worked solution
for the supervised warm-up.

Response length grows with the number of terms (one worked line per operator), so responses vary in length and the
longest chains come close to a small generation cap: token-level loss and overlong shaping have something to act on.

The split is a function of the problem text (a hash) and the split fractions, never of the seed or the difficulty
knobs: a problem is held out for every seed and every difficulty, so training rows can never contain a held-out
problem. Three disjoint splits: ``heldout`` (final evaluation), ``dev`` (small probes, e.g. the warm-up's stopping
rule, so that decisions taken during training never look at the evaluation problems) and ``train``.
"""
from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass
from typing import Iterator, Optional

from nemo_dapo.data.template import apply_template, format_answer_line

SPLITS = ("train", "dev", "heldout")
STYLES = ("rewrite", "steps")


def split_score(problem: str) -> float:
    """A number in [0, 1) fixed by the problem text: [0, heldout) -> heldout, [heldout, heldout + dev) -> dev."""
    digest = hashlib.sha256(problem.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64


@dataclass(frozen=True)
class ArithmeticTask:
    """Left-to-right chains of ``min_terms..max_terms`` integers joined by ``ops``.

    Difficulty knobs: the number of terms (response length and error compounding), ``max_operand`` (operands in
    ``[0, max_operand]``; carries start at 10), ``max_value`` (every intermediate result stays in ``[0, max_value]``,
    so there are no negative numbers), ``ops`` (any of ``+-*``; a ``*`` operand is at most ``max_multiplier`` and a
    product after a sum is written with parentheses, ``(3+4)*2``, so standard precedence gives the same answer).
    ``style`` of the worked lines: "steps" (``12+7=19``) or "rewrite" (``=19-5``, see :func:`worked_lines`).
    Defaults: the CPU job's task. With them the default model's errors after a short warm-up are mostly in looking
    up the next operand of long chains (measured: ~70% of wrong greedy answers), which RL sharpens quickly; the
    "rewrite" style, meant to make that look-up local, learnt slower in the same budget.
    """

    min_terms: int = 2
    max_terms: int = 6
    max_operand: int = 9
    max_value: int = 20
    ops: str = "+-"
    max_multiplier: int = 9
    heldout_fraction: float = 0.1
    dev_fraction: float = 0.05
    style: str = "steps"
    data_source: str = "nemo_dapo/arith"

    def __post_init__(self):
        if not 2 <= self.min_terms <= self.max_terms:
            raise ValueError(f"ArithmeticTask: need 2 <= min_terms <= max_terms, got {self.min_terms}, "
                             f"{self.max_terms}; set min_terms to at least 2")
        if self.style not in STYLES:
            raise ValueError(f"ArithmeticTask: style={self.style!r} must be one of {STYLES}")
        if not self.ops or set(self.ops) - set("+-*"):
            raise ValueError(f"ArithmeticTask: ops={self.ops!r} must be a non-empty string over '+-*'")
        if self.max_operand < 1 or self.max_value < self.max_operand:
            raise ValueError(f"ArithmeticTask: need 1 <= max_operand <= max_value, got {self.max_operand}, "
                             f"{self.max_value}")
        if not (0.0 < self.heldout_fraction and 0.0 < self.dev_fraction
                and self.heldout_fraction + self.dev_fraction < 1.0):
            raise ValueError(f"ArithmeticTask: heldout_fraction={self.heldout_fraction} and dev_fraction="
                             f"{self.dev_fraction} must be > 0 with a sum below 1 (the rest is train)")

    # --- problems -------------------------------------------------------------------------------------------
    def split_of(self, problem: str) -> str:
        score = split_score(problem)
        if score < self.heldout_fraction:
            return "heldout"
        return "dev" if score < self.heldout_fraction + self.dev_fraction else "train"

    def sample_problem(self, rng: random.Random) -> str:
        """One problem text, e.g. ``12+7-5``; intermediate values stay in ``[0, max_value]``."""
        n_terms = rng.randint(self.min_terms, self.max_terms)
        first = value = rng.randint(0, self.max_operand)
        pairs = []
        for _ in range(n_terms - 1):
            while True:
                op = rng.choice(self.ops)
                b = rng.randint(0, self.max_multiplier if op == "*" else self.max_operand)
                new = _apply(value, op, b)
                if 0 <= new <= self.max_value:
                    break
            pairs.append((op, b))
            value = new
        return render_chain(first, pairs)

    def iter_problems(self, split: str, seed: int) -> Iterator[str]:
        """Endless problems of one split (repeats allowed), deterministic in ``seed``."""
        _check_split(split)
        rng = random.Random(f"{seed}:{split}")
        misses = 0
        while True:
            problem = self.sample_problem(rng)
            if self.split_of(problem) == split:
                misses = 0
                yield problem
            else:
                misses += 1
                if misses > 100_000:
                    raise ValueError(f"ArithmeticTask: 100000 draws in a row fell outside the {split!r} split; the "
                                     "knobs allow too few distinct problems: raise max_terms or max_operand")

    def distinct_problems(self) -> int:
        """How many distinct problem texts the knobs allow, over all splits (counted, not drawn: chains by their
        value after each term; :func:`render_chain` writes distinct chains as distinct texts)."""
        top, step = self.max_value, self.max_operand
        counts = [1 if v <= step else 0 for v in range(top + 1)]  # chains of one term, by value
        total = 0
        for n_terms in range(1, self.max_terms + 1):
            if n_terms >= self.min_terms:
                total += sum(counts)
            prefix = [0]
            for c in counts:
                prefix.append(prefix[-1] + c)
            nxt = [0] * (top + 1)
            for v in range(top + 1):  # v = u + b or u - b with b in [0, step]: a window of u
                if "+" in self.ops:
                    nxt[v] += prefix[v + 1] - prefix[max(0, v - step)]
                if "-" in self.ops:
                    nxt[v] += prefix[min(top, v + step) + 1] - prefix[v]
            if "*" in self.ops:
                for u, c in enumerate(counts):
                    for b in range(self.max_multiplier + 1):
                        if c and u * b <= top:
                            nxt[u * b] += c
            counts = nxt
        return total

    def most_distinct(self, split: str) -> int:
        """The most distinct problems of one split worth drawing for: each text falls in a split with the split's
        share as its chance, so more than 5 standard deviations past that mean cannot be there."""
        _check_split(split)
        share = {"heldout": self.heldout_fraction, "dev": self.dev_fraction}.get(
            split, 1.0 - self.heldout_fraction - self.dev_fraction)
        mean = share * self.distinct_problems()
        return int(mean + 5 * math.sqrt(mean) + 10)

    def problems(self, split: str, n: int, seed: int, unique: bool = True) -> list:
        """``n`` problems of one split; distinct when ``unique`` (raises if the knobs allow too few)."""
        most = self.most_distinct(split) if unique else n
        if n > most:  # refused at once, not after minutes of draws
            raise ValueError(f"ArithmeticTask: cannot draw {n} distinct {split} problems (the knobs allow at most "
                             f"{most}); raise max_terms or max_operand, or ask for fewer")
        out, seen = [], set()
        stale = 0  # draws since the last new problem: the split is exhausted once it far exceeds those found
        for problem in self.iter_problems(split, seed):
            if unique and problem in seen:
                stale += 1
                if stale > 20 * len(out) + 10_000:  # (a new one among N distinct is due within N draws)
                    raise ValueError(f"ArithmeticTask: could not draw {n} distinct {split} problems (the knobs allow "
                                     f"about {len(out)}); raise max_terms or max_operand, or ask for fewer")
                continue
            stale = 0
            seen.add(problem)
            out.append(problem)
            if len(out) == n:
                return out
        raise AssertionError("unreachable")

    # --- rows -----------------------------------------------------------------------------------------------
    def row(self, problem: str, index: int, split: Optional[str] = None) -> dict:
        """A verl-schema row for ``problem``; the worked solution is in ``extra_info['solution']``."""
        lines, answer = solve(problem, self.style)
        return {
            "data_source": self.data_source,
            "prompt": [{"role": "user", "content": apply_template(problem)}],
            "ability": "MATH",
            "reward_model": {"ground_truth": str(answer), "style": "rule"},
            "extra_info": {"index": index, "raw_problem": problem, "split": split or self.split_of(problem),
                           "solution": "\n".join(lines + [format_answer_line(answer)])},
        }

    def rows(self, split: str, n: int, seed: int, unique: bool = True) -> list:
        return [self.row(p, i, split) for i, p in enumerate(self.problems(split, n, seed, unique))]


@dataclass(frozen=True)
class Sloppiness:
    """How a "sloppy" worked solution deviates from the clean one (used to make a base model with fixable faults).

    slip_prob: per worked line, the written result is off by 1 or 10 (later lines carry the slip on, so the final
    answer is wrong: careless arithmetic). format_prob: the final line misses the verifier's format (``Answer: 14.``
    or ``The answer is 14.``; the DAPO verifier scores both wrong). ramble_prob: the steps are written out a second
    time under ``Check:`` before the answer, doubling the length (long chains then run into the generation cap).
    ramble_passes: a rambling solution repeats its steps under ``Check:`` 1..ramble_passes times (uniform), so its
    length is 2x..(1 + ramble_passes)x the clean one; 1 (one pass, no extra random draw) is the default job's.
    """

    slip_prob: float = 0.0
    format_prob: float = 0.0
    ramble_prob: float = 0.0
    ramble_passes: int = 1

    def __post_init__(self):
        for name in ("slip_prob", "format_prob", "ramble_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"Sloppiness.{name}={getattr(self, name)} must be a probability in [0, 1]")
        if isinstance(self.ramble_passes, bool) or not isinstance(self.ramble_passes, int) or self.ramble_passes < 1:
            raise ValueError(f"Sloppiness.ramble_passes={self.ramble_passes!r} must be an integer >= 1 (1 = one "
                             "'Check:' pass)")


def sloppy_solution(problem: str, rng: random.Random, sloppiness: Sloppiness, style: str = "steps") -> str:
    """A worked solution of ``problem`` in ``style`` with the faults of ``sloppiness`` drawn from ``rng``."""
    slip = lambda v: max(0, v + rng.choice((-10, -1, 1, 10) if v >= 10 else (-1, 1, 10)))  # noqa: E731
    lines, value = worked_lines(problem, style,
                                corrupt=lambda v: slip(v) if rng.random() < sloppiness.slip_prob else v)
    if rng.random() < sloppiness.ramble_prob:
        # Only draw the pass count when there is a choice: one pass keeps the default job's random stream.
        passes = rng.randint(1, sloppiness.ramble_passes) if sloppiness.ramble_passes > 1 else 1
        lines = lines + (["Check: " + lines[0]] + lines[1:]) * passes
    r = rng.random()
    if r < sloppiness.format_prob / 2:
        last = f"{format_answer_line(value)}."
    elif r < sloppiness.format_prob:
        last = f"The answer is {value}."
    else:
        last = format_answer_line(value)
    return "\n".join(lines + [last])


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {SPLITS}")


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def tokenize_problem(problem: str) -> list:
    """``'(3+4)*2'`` -> ``[3, '+', 4, '*', 2]`` (parentheses dropped: chains are evaluated left to right)."""
    out, num = [], ""
    for ch in problem:
        if ch.isdigit():
            num += ch
            continue
        if num:
            out.append(int(num))
            num = ""
        if ch in "+-*":
            out.append(ch)
        elif ch not in "() ":
            raise ValueError(f"arithmetic problem {problem!r}: unexpected character {ch!r}")
    if num:
        out.append(int(num))
    if len(out) % 2 == 0 or not all(isinstance(t, int) for t in out[::2]):
        raise ValueError(f"arithmetic problem {problem!r} is not of the form int (op int)*")
    return out


def render_chain(first: int, pairs: list) -> str:
    """``3, [('+', 4), ('*', 2)]`` -> ``(3+4)*2``: a left-to-right chain written so that standard precedence agrees
    (a product after a sum or difference gets the prefix in parentheses)."""
    text, last_op = str(first), None
    for op, b in pairs:
        if op == "*" and last_op in ("+", "-"):
            text = f"({text})"
        text, last_op = f"{text}{op}{b}", op
    return text


def worked_lines(problem: str, style: str = "steps", corrupt=None) -> tuple:
    """(worked lines, final value) of a chain evaluated left to right, one line per operator.

    style "rewrite": each line rewrites the rest of the chain with its first operation done (``12+7-5`` ->
    ``=19-5``, ``=14``); style "steps": each line is one operation (``12+7=19``, ``19-5=14``).
    ``corrupt(value) -> value`` may alter each written result (sloppy solutions); later lines carry it on.
    """
    if style not in STYLES:
        raise ValueError(f"style={style!r} must be one of {STYLES}")
    tokens = tokenize_problem(problem)
    pairs = list(zip(tokens[1::2], tokens[2::2]))
    value, lines = tokens[0], []
    for i, (op, b) in enumerate(pairs):
        new = _apply(value, op, b)
        new = corrupt(new) if corrupt else new
        lines.append(f"={render_chain(new, pairs[i + 1:])}" if style == "rewrite" else f"{value}{op}{b}={new}")
        value = new
    return lines, value


def solve(problem: str, style: str = "steps") -> tuple:
    """(worked lines, answer) of the clean solution (see :func:`worked_lines`)."""
    return worked_lines(problem, style)
