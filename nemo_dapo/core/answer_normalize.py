"""Final-answer extraction, normalisation and matching for math responses. Pure text, stdlib only.

Worker processes of ``reward.verify_batch`` import this module, so it must stay free of torch and heavy packages.

Two rule-based matchers share the same bounded view of a response: its last ``ANSWER_TAIL_CHARS`` characters.

* ``match_dapo``: the reference ``math_dapo`` semantics. Last line matching ``(?i)Answer\\s*:\\s*([^\\n]+)``, Minerva
  normalisation of prediction and ground truth, exact string equality. Known false negatives are kept on purpose:
  ``540.``, ``540.0``, ``**540**``, ``\\(540\\)``, ``0540``, boxed-only answers.
* ``match_tolerant``: same extraction, plus a final ``\\boxed{}``; a canonical form that forgives formatting
  (markdown, TeX delimiters, trailing period, equal numeric values) but never a different value.

Nothing here evaluates model text. Responses are cut to their tail before any regex runs, so megabyte responses
and deep nesting cost microseconds; ground truths (data, not model output) are normalised in linear time.
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional

ANSWER_TAIL_CHARS = 300  # the reference keeps this many trailing characters (MATH-500's longest answer: 159)
# A prediction comes from one line of that tail (normalised, at most ~5/3 as long), so a ground truth several times
# longer cannot equal one: such a ground truth scores every response wrong without being normalised, which keeps a
# 10 MB or pathological ground truth as cheap as a short one. The data readers refuse them up front.
MAX_GROUND_TRUTH_CHARS = 4 * ANSWER_TAIL_CHARS
INVALID = "[INVALID]"  # the reference's prediction when no answer line is found

# Minerva (Lewkowycz et al. 2022) normalisation tables, applied in this order with plain substring replacement.
# Case-sensitive, so "a " also eats the article inside words ending in "a" followed by a space.
MINERVA_SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
MINERVA_REMOVED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3",
    "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)

_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


# ---------------------------------------------------------------------------------------------------------------
# Minerva normalisation. The reference states these steps as regex substitutions whose '.' stops at newlines; some
# of them backtrack quadratically on long lines, so below they are linear scans or anchored / fixed-width patterns
# with the same per-line behaviour (tests compare them with a regex formulation on random strings).
# ---------------------------------------------------------------------------------------------------------------

# A line holding two or more '$' becomes '$' + the text between its first two '$' + '$'. Anchored at line starts,
# so each line is scanned once (an unanchored lazy pattern rescans a long line from every position).
_FIRST_DOLLAR_PAIR = re.compile(r"^[^\n$]*\$([^\n$]*)\$[^\n]*", re.MULTILINE)


def _unwrap_to_first_close(line: str, opener: str) -> str:
    """Replace each ``opener...}`` with its content, closing at the FIRST '}' (no brace matching)."""
    out, pos = [], 0
    while True:
        k = line.find(opener, pos)
        if k < 0:
            break
        start = k + len(opener)
        j = line.find("}", start)
        if j < 0:  # no later opener on this line can close either
            break
        out.append(line[pos:k])
        out.append(line[start:j])
        pos = j + 1
    if not out:
        return line
    out.append(line[pos:])
    return "".join(out)


def _unwrap_boxed_greedy(line: str) -> str:
    """The first ``\\boxed{`` of a line is unwrapped up to the LAST '}' of that line (greedy, not brace-matched)."""
    k = line.find("\\boxed{")
    if k < 0:
        return line
    start = k + len("\\boxed{")
    j = line.rfind("}")
    return line if j < start else line[:k] + line[start:j] + line[j + 1:]


# Shorthand TeX: "\\fracab" -> "\\frac{a}{b}", "\\sqrta" -> "\\sqrt{a}" when the next char is not '{'. The first
# argument may be a newline, the second may not (as in the reference). Fixed-width patterns: linear, no backtracking.
_FRAC_SHORTHAND = re.compile(r"frac([^{])([^\n])")
_SQRT_SHORTHAND = re.compile(r"sqrt([^{])")


def _per_line_if(s: str, marker: str, fn) -> str:
    """Apply ``fn`` to each line containing ``marker`` (regex '.' in the reference stops at newlines)."""
    if marker not in s:
        return s
    if "\n" not in s:
        return fn(s)
    return "\n".join(fn(line) if marker in line else line for line in s.split("\n"))


def minerva_normalize(answer: str) -> str:
    """Normalise a final-answer string the way the reference does, for the prediction and the ground truth alike.

    Text after the last '=', substitution and removal tables, first ``$..$`` pair, ``\\text{}``/``\\textbf{}``/
    ``\\overline{}``/``\\boxed{}`` unwrapped, ``\\frac``/``\\sqrt`` shorthand expanded, '$' dropped, commas dropped
    from strings that are otherwise all digits, surrounding whitespace stripped.
    """
    s = answer.rpartition("=")[2]
    for before, after in MINERVA_SUBSTITUTIONS:
        s = s.replace(before, after)
    for expr in MINERVA_REMOVED:
        s = s.replace(expr, "")
    s = _FIRST_DOLLAR_PAIR.sub(lambda m: "$" + m.group(1) + "$", s)  # callables beat templates per match
    for opener in ("\\text{", "\\textbf{", "\\overline{"):
        s = _per_line_if(s, opener, lambda line, o=opener: _unwrap_to_first_close(line, o))
    s = _per_line_if(s, "\\boxed{", _unwrap_boxed_greedy)
    s = _FRAC_SHORTHAND.sub(lambda m: "frac{" + m.group(1) + "}{" + m.group(2) + "}", s)
    s = _SQRT_SHORTHAND.sub(lambda m: "sqrt{" + m.group(1) + "}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


# ---------------------------------------------------------------------------------------------------------------
# Extraction
# ---------------------------------------------------------------------------------------------------------------

def last_answer_line(text: str) -> Optional[re.Match]:
    """The last non-overlapping match of ``(?i)Answer\\s*:\\s*([^\\n]+)`` in ``text`` (group 1 is the answer)."""
    last = None
    for last in _ANSWER_LINE.finditer(text):
        pass
    return last


def last_boxed(text: str) -> Optional[tuple[int, str]]:
    """(start index, content) of the last ``\\boxed{...}`` with balanced braces; None if absent or unclosed."""
    k = text.rfind("\\boxed{")
    if k < 0:
        return None
    start = k + len("\\boxed{")
    depth = 1
    for i in range(start, len(text)):
        c = text[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return k, text[start:i]
    return None  # truncated box: do not fall back to an earlier (mid-text) one


# ---------------------------------------------------------------------------------------------------------------
# Matchers
# ---------------------------------------------------------------------------------------------------------------

def _minerva_gold(ground_truth: str) -> Optional[str]:
    return minerva_normalize(ground_truth) if len(ground_truth) <= MAX_GROUND_TRUTH_CHARS else None


def _match_dapo_gold(response: str, gold: Optional[str]) -> tuple[bool, str]:
    m = last_answer_line(response[-ANSWER_TAIL_CHARS:])
    pred = minerva_normalize(m.group(1) if m else INVALID)
    return gold is not None and pred == gold, pred


def match_dapo(response: str, ground_truth: str) -> tuple[bool, str]:
    """Reference ``math_dapo`` decision: (exact match of normalised strings, normalised prediction)."""
    return _match_dapo_gold(response, _minerva_gold(ground_truth))


# Formatting that says nothing about the value; removed before the Minerva steps in tolerant mode.
_TOLERANT_DROP = ("\\(", "\\)", "\\[", "\\]", "\\,", "\\!")
# \left, \right and \displaystyle as whole commands: \leftarrow and \rightarrow stay apart
_TOLERANT_COMMANDS = re.compile(r"\\(?:left|right|displaystyle)(?![A-Za-z])")
_TOLERANT_SWAP = (("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\u2212", "-"))
_PREFIXES = ("the final answer is", "final answer is", "the answer is")
_SUFFIXES = ("i hope it is correct.", "i hope it is correct")
# ASCII digits only (\d would also take other scripts' digits).
_DECIMAL = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)")
_RATIO = re.compile(r"([+-]?[0-9]+)/([0-9]+)")
_TEX_FRAC = re.compile(r"([+-]?)\\frac\{([+-]?[0-9]+)\}\{([0-9]+)\}")
_MAX_NUMERIC_CHARS = 1000  # int() refuses > 4300 digits; answers are far shorter


def _numeric_value(s: str) -> Optional[Fraction]:
    """Exact value of a plain decimal, ``p/q`` or ``\\frac{p}{q}`` (integers only); None for anything else."""
    if len(s) > _MAX_NUMERIC_CHARS:
        return None
    if _DECIMAL.fullmatch(s):
        return Fraction(s)
    m = _RATIO.fullmatch(s)
    if m and int(m.group(2)) != 0:
        return Fraction(int(m.group(1)), int(m.group(2)))
    m = _TEX_FRAC.fullmatch(s)
    if m and int(m.group(3)) != 0:
        value = Fraction(int(m.group(2)), int(m.group(3)))
        return -value if m.group(1) == "-" else value
    return None


def tolerant_canonical(answer: str) -> str:
    """Canonical form used by tolerant mode: same string for answers that differ only in presentation.

    Removes the "The final answer is ... I hope it is correct." wrapper, markdown emphasis, inline-TeX delimiters,
    ``\\left``/``\\right`` and thin spaces, then applies the Minerva steps, drops trailing sentence punctuation and
    writes plain numbers by exact value (``0540``, ``540.0``, ``+540`` -> ``540``; ``0.5``, ``1/2``,
    ``\\frac{1}{2}`` -> ``1/2``). Different values never collide: no rounding, no evaluation of expressions.
    """
    s = answer.strip()
    low = s.lower()
    for p in _PREFIXES:
        if low.startswith(p):
            s, low = s[len(p):].lstrip(), low[len(p):].lstrip()
            break
    for suf in _SUFFIXES:
        if low.endswith(suf):
            s = s[:len(s) - len(suf)].rstrip()
            break
    s = s.strip("*`").strip()
    for expr in _TOLERANT_DROP:
        s = s.replace(expr, "")
    s = _TOLERANT_COMMANDS.sub("", s)
    for before, after in _TOLERANT_SWAP:
        s = s.replace(before, after)
    s = minerva_normalize(s)
    s = s.rstrip(".,;:").strip("*`").strip()  # not "!": 5! is a factorial
    value = _numeric_value(s)
    if value is None:
        return s
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def _tolerant_gold(ground_truth: str) -> Optional[tuple[str, str]]:
    if len(ground_truth) > MAX_GROUND_TRUTH_CHARS:
        return None
    return tolerant_canonical(ground_truth), minerva_normalize(ground_truth)


def _match_tolerant_gold(response: str, gold: Optional[tuple[str, str]]) -> tuple[bool, str]:
    tail = response[-ANSWER_TAIL_CHARS:]
    line = last_answer_line(tail)
    box = last_boxed(tail)
    if box is not None and (line is None or box[0] >= line.end()):
        candidate, from_line = box[1], False
    elif line is not None:
        candidate, from_line = line.group(1), True
    else:
        return False, INVALID
    pred = tolerant_canonical(candidate)
    if gold is None:
        return False, pred
    ok = pred == gold[0]
    if not ok and from_line:
        ok = minerva_normalize(candidate) == gold[1]
    return ok, pred


def match_tolerant(response: str, ground_truth: str) -> tuple[bool, str]:
    """Tolerant decision: (match, canonical prediction).

    The candidate is the reference's answer line, or a final ``\\boxed{}`` that starts after it (or stands alone)
    in the same tail; numbers elsewhere in the reasoning are never looked at. When the answer line is the candidate
    a reference match also counts, so tolerant mode accepts everything ``match_dapo`` accepts on that line.
    """
    return _match_tolerant_gold(response, _tolerant_gold(ground_truth))


def _math_verify_gold(ground_truth: str):
    """math-verify's parse of ``\\boxed{ground_truth}`` (or of the bare expression); None when over the bound."""
    if len(ground_truth) > MAX_GROUND_TRUTH_CHARS:
        return None
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    gold = parse("\\boxed{" + ground_truth + "}", extraction_config=[LatexExtractionConfig()])
    return gold or parse(ground_truth, extraction_config=[ExprExtractionConfig()]) or None


def _match_math_verify_gold(response: str, gold) -> tuple[bool, str]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    pred = parse(response[-ANSWER_TAIL_CHARS:], extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()])
    if not gold or not pred:
        return False, INVALID if not pred else str(pred[-1])
    return bool(verify(gold, pred)), str(pred[-1])


def match_math_verify(response: str, ground_truth: str) -> tuple[bool, str]:
    """math-verify's symbolic comparison of the tail against ``\\boxed{ground_truth}``.

    Its timeouts use ``signal.alarm``: call this only in a process's main thread (``reward`` runs it in workers).
    """
    return _match_math_verify_gold(response, _math_verify_gold(ground_truth))


MATCHERS = {"dapo": match_dapo, "tolerant": match_tolerant, "math_verify": match_math_verify}


# mode -> (ground truth -> prepared gold, (response, gold) -> (acc, pred)): a batch prepares each distinct ground
# truth once (a group repeats it G times), however many responses it is compared with.
_GOLD = {"dapo": (_minerva_gold, _match_dapo_gold), "tolerant": (_tolerant_gold, _match_tolerant_gold),
         "math_verify": (_math_verify_gold, _match_math_verify_gold)}


def match_many(mode: str, responses: list, ground_truths: list) -> list:
    """[(acc, pred)] for aligned lists; the unit of work a verifier worker process runs.

    Each distinct ground truth is normalised (math_verify: parsed) once per call, not once per response.
    """
    prepare, match = _GOLD[mode]
    golds: dict = {}
    out = []
    for r, g in zip(responses, ground_truths):
        if g not in golds:
            golds[g] = prepare(g)
        out.append(match(r, golds[g]))
    return out
