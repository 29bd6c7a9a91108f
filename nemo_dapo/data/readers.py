"""Readers for the math sets used to train and evaluate DAPO, all into one row schema (:class:`MathRow`).

Formats:
  * verl / DAPO-Math-17k (parquet or jsonl): ``prompt=[{role:'user', content: <templated problem>}]``,
    ``reward_model={ground_truth, style}``, optional ``extra_info={index, raw_problem, split}``, ``data_source``.
    The content of a message list is used as it is; a bare string ``prompt`` is taken as the problem and gets the
    DAPO template unless it already has it.
    The public DAPO-Math-17k file repeats each prompt ~100x: de-duplicated by problem text by default.
    The AIME-2024 evaluation parquet is the same schema with 30 problems x 32 copies (avg@32 needs the copies,
    so :func:`read_aime2024` keeps them unless asked otherwise). The procedural task emits this schema too.
  * AIME-2025 jsonl ``{answer, problem}``; MATH-500 jsonl ``{problem, solution, answer, ...}``;
    GSM8K jsonl ``{question, answer: '<worked solution>\\n#### 18'}``.

Every reader applies the DAPO template to problems that do not carry it, normalises integer ground truths like
``str(int(x))`` (``'025'`` -> ``'25'``) and gives each problem a stable id (a hash of source and problem text, shared
by repeated copies). Malformed rows raise :class:`DataFormatError` naming the file, the 1-based row, the field and
the fix. A ground truth must be one answer: a string, or a number (normalised: ``12`` and ``12.0`` -> ``'12'``,
``3.5`` -> ``'3.5'``); missing, empty or whitespace-only, NaN/infinite, a boolean, a list or other container, or one
longer than ``MAX_GROUND_TRUTH_CHARS`` (the verifier could never match it) is an error, as is an empty prompt.
jsonl files are read as bytes and decoded line by line, so a non-UTF-8 byte is reported with its file offset (a
leading UTF-8 byte-order mark is skipped).
"""
from __future__ import annotations

import codecs
import hashlib
import json
import logging
import math
import os
import re
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

from nemo_dapo.core.answer_normalize import MAX_GROUND_TRUTH_CHARS
from nemo_dapo.data.template import apply_template, extract_problem

log = logging.getLogger(__name__)

_INT = re.compile(r"[+-]?\d+")
_INT_WITH_COMMAS = re.compile(r"[+-]?\d{1,3}(,\d{3})+")


# No tokenizer we know turns more characters than this into one token (byte-level BPE tokens are a few bytes; the
# longest merges of 150k-token vocabularies are runs of spaces or symbols well below it). A prompt longer than
# max_prompt_tokens * this cannot fit and is dropped before it is tokenized (tokenizing a 50 MB line took 20 GB).
MAX_CHARS_PER_TOKEN = 128


class DataFormatError(ValueError):
    """A data file is missing or does not have the expected schema."""


def prompt_far_too_long(prompt: str, max_prompt_tokens: int) -> bool:
    """True when ``prompt`` has more characters than ``max_prompt_tokens`` tokens can hold (no tokenizing)."""
    return len(prompt) > max_prompt_tokens * MAX_CHARS_PER_TOKEN


@dataclass(frozen=True)
class MathRow:
    id: str  # stable: same problem text from the same source -> same id (repeated copies share it)
    source: str
    problem: str  # the raw problem text
    prompt: str  # the user-turn text, DAPO template applied
    ground_truth: str  # normalised: integers as str(int(x))
    solution: Optional[str] = None  # worked solution when the source has one


def normalize_ground_truth(answer) -> str:
    """``'025'`` -> ``'25'``, ``'1,000'`` -> ``'1000'``, ``12.0`` -> ``'12'``; other answers are stripped strings."""
    if isinstance(answer, bool):
        raise TypeError(f"ground truth {answer!r} is a bool, not an answer")
    if isinstance(answer, int):
        return str(answer)
    if isinstance(answer, float) and answer.is_integer():
        return str(int(answer))
    text = str(answer).strip()
    if _INT.fullmatch(text) or _INT_WITH_COMMAS.fullmatch(text):
        return str(int(text.replace(",", "")))
    return text


def is_integer_answer(ground_truth: str) -> bool:
    return bool(_INT.fullmatch(ground_truth))


def stable_id(source: str, problem: str) -> str:
    return f"{source}-{hashlib.sha1(problem.encode('utf-8')).hexdigest()[:12]}"


# --- file access ---------------------------------------------------------------------------------------------------
def _check_exists(path, what: str) -> str:
    path = os.fspath(path)
    if os.path.isdir(path):
        raise FileNotFoundError(f"{what} file {path!r} is a directory. Point the data path at the {what} file in "
                                "it (a .parquet or .jsonl file)")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} file not found: {path!r}. Point the data path at an existing "
                                f"{what} file (e.g. in ../shared/data or your own copy).")
    return path


def iter_jsonl(path) -> Iterator[tuple]:
    """(1-based line number, dict) for each non-blank line; bytes are decoded as UTF-8 line by line."""
    with open(path, "rb") as f:
        if f.read(4) == b"PAR1":  # parquet's magic bytes: the wrong reader, not a badly encoded file
            raise DataFormatError(f"{path}: a parquet file, read here as jsonl (one JSON object per line). Fix: a "
                                  "format that reads parquet (dapo_math, aime2024), or convert the file to jsonl")
        f.seek(0)
        offset = 0
        for lineno, raw in enumerate(f, 1):
            start, offset = offset, offset + len(raw)
            if lineno == 1 and raw.startswith(codecs.BOM_UTF8):
                raw, start = raw[len(codecs.BOM_UTF8):], start + len(codecs.BOM_UTF8)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataFormatError(f"{path}: row {lineno}: not UTF-8 text (byte {raw[e.start:e.start + 1]!r} at "
                                      f"byte offset {start + e.start} of the file). Fix: re-encode the file as "
                                      "UTF-8 (e.g. iconv -f latin1 -t utf-8).") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataFormatError(f"{path}: row {lineno}: not valid JSON ({e.msg} at column {e.colno}). "
                                      "Fix: one JSON object per line (jsonl).") from None
            except (ValueError, RecursionError) as e:  # nesting too deep, an integer of > 4300 digits
                raise DataFormatError(f"{path}: row {lineno}: JSON that cannot be read ({type(e).__name__}: "
                                      f"{str(e)[:100]}). Fix: one flat JSON object per line.") from None
            if not isinstance(obj, dict):
                raise DataFormatError(f"{path}: row {lineno}: expected a JSON object, got {type(obj).__name__}. "
                                      "Fix: one JSON object per line (jsonl).")
            yield lineno, obj


def iter_parquet(path, batch_size: int = 8192) -> Iterator[tuple]:
    """(1-based row number, dict) streamed in record batches (the public DAPO-Math-17k file has ~1.8M rows)."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from e
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid (and others) on non-parquet bytes
        raise DataFormatError(f"{path}: not a readable parquet file ({e}). Fix: pass a parquet file, or a .jsonl "
                              "file with one row per line.") from None
    n = 0
    batches = pf.iter_batches(batch_size=batch_size)
    while True:
        try:
            batch = next(batches, None)
        except Exception as e:  # noqa: BLE001 - a damaged page or invalid UTF-8 in a string column
            raise DataFormatError(f"{path}: rows after {n}: cannot be read ({type(e).__name__}: {str(e)[:200]}). "
                                  "Fix: rewrite the file (string columns must hold UTF-8 text).") from None
        if batch is None:
            return
        for row in batch.to_pylist():
            n += 1
            yield n, row


def iter_records(path) -> Iterator[tuple]:
    """Rows of a .parquet or .jsonl/.json file, by suffix."""
    lower = os.fspath(path).lower()
    if lower.endswith(".parquet"):
        return iter_parquet(path)
    if lower.endswith((".jsonl", ".json")):
        return iter_jsonl(path)
    raise DataFormatError(f"{path}: unknown file type. Fix: use a .parquet or .jsonl file.")


# --- verl / DAPO-Math-17k schema -----------------------------------------------------------------------------------
def _fail(origin: str, n: int, what: str, fix: str):
    raise DataFormatError(f"{origin}: row {n}: {what}. Fix: {fix}")


def ground_truth_of(value, origin: str, n: int, field: str) -> str:
    """The normalised ground truth of row ``n``, or :class:`DataFormatError` naming ``origin``, the row and field."""
    def bad(what: str, fix: str = "one answer per row, as a string or a number"):
        _fail(origin, n, f"'{field}' {what}", fix)

    if value is None:
        bad("is missing")
    if isinstance(value, bool):
        bad(f"is a boolean ({value})", "write the answer itself, e.g. '14'")
    if isinstance(value, float) and not math.isfinite(value):
        bad(f"is {value} (not a number)", "write the answer itself, e.g. '14'; a NaN usually means an empty cell")
    if isinstance(value, (list, tuple, dict, set, bytes, bytearray)):
        bad(f"is a {type(value).__name__}, not one answer",
            "one answer per row, as a string or a number (the verifier compares with a single answer)")
    if not isinstance(value, (str, int, float)):
        bad(f"has type {type(value).__name__}")
    if isinstance(value, str):
        if not value.strip():
            bad("is empty" if not value else "is only whitespace")
        if len(value) > MAX_GROUND_TRUTH_CHARS:
            bad(f"is {len(value)} characters long (at most {MAX_GROUND_TRUTH_CHARS}; a prediction is read from "
                "the response's last lines, so it could never match)", "store the final answer only")
    return normalize_ground_truth(value)


def _text_field(value, origin: str, n: int, field: str) -> str:
    if not isinstance(value, str):
        _fail(origin, n, f"'{field}' is {'missing' if value is None else type(value).__name__}",
              f"'{field}' must be a non-empty string")
    if not value.strip():
        _fail(origin, n, f"'{field}' is {'empty' if not value else 'only whitespace'}",
              f"'{field}' must hold the problem text")
    return value


def _prompt_content(row: dict, origin: str, n: int) -> str:
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        return _text_field(prompt, origin, n, "prompt")
    if not isinstance(prompt, (list, tuple)) or not prompt:
        _fail(origin, n, f"'prompt' is {type(prompt).__name__ if prompt is not None else 'missing'}",
              "verl rows need prompt=[{'role': 'user', 'content': <templated problem>}]")
    users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    if not users or not isinstance(users[-1].get("content"), str):
        _fail(origin, n, "'prompt' has no user message with a string 'content'",
              "verl rows need prompt=[{'role': 'user', 'content': <templated problem>}]")
    return _text_field(users[-1]["content"], origin, n, "prompt[-1].content")


def verl_row_to_math_row(row: dict, origin: str, n: int) -> MathRow:
    """One verl-schema dict -> :class:`MathRow` (``origin``/``n`` name the file and row in errors)."""
    if not isinstance(row, dict):
        _fail(origin, n, f"expected a dict, got {type(row).__name__}", "pass verl-schema rows")
    content = _prompt_content(row, origin, n)
    reward = row.get("reward_model")
    if not isinstance(reward, dict) or reward.get("ground_truth") is None:
        _fail(origin, n, "missing reward_model.ground_truth",
              "verl rows need reward_model={'ground_truth': '<answer>', 'style': 'rule'}")
    ground_truth = ground_truth_of(reward["ground_truth"], origin, n, "reward_model.ground_truth")
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    problem = extra.get("raw_problem") or extract_problem(content) or content
    if isinstance(row.get("prompt"), str) and extract_problem(content) is None:
        content = apply_template(content)  # a bare problem string (e.g. de-duplicated copies): template it
    source = str(row.get("data_source") or "verl")
    return MathRow(id=stable_id(source, problem), source=source, problem=problem, prompt=content,
                   ground_truth=ground_truth, solution=extra.get("solution"))


def dedup_by_problem(rows: Iterable[MathRow], origin: str = "rows") -> list:
    """First occurrence of each problem text; conflicting ground truths among copies are counted and logged."""
    out, seen, conflicts = [], {}, 0
    for r in rows:
        gt = seen.get(r.problem)
        if gt is None:
            seen[r.problem] = r.ground_truth
            out.append(r)
        elif gt != r.ground_truth:
            conflicts += 1
    if conflicts:
        log.warning("%s: %d repeated problems had a different ground truth than their first copy; kept the first",
                    origin, conflicts)
    return out


def from_verl_rows(rows: Iterable[dict], origin: str = "rows", dedup: bool = True) -> list:
    """verl-schema dicts (e.g. :meth:`ArithmeticTask.rows`) -> list of :class:`MathRow`."""
    out = [verl_row_to_math_row(r, origin, i) for i, r in enumerate(rows, 1)]
    return dedup_by_problem(out, origin) if dedup else out


def _nonempty(path, rows: list, what: str) -> list:
    if not rows:
        raise DataFormatError(f"{path}: no rows. Fix: point the data path at a non-empty {what} file.")
    return rows


def read_dapo_math(path, dedup: bool = True) -> list:
    """DAPO-Math-17k (or any verl-schema) parquet/jsonl; de-duplicated by problem text unless ``dedup=False``."""
    path = _check_exists(path, "verl/DAPO-Math")
    rows = (verl_row_to_math_row(row, path, n) for n, row in iter_records(path))
    rows = dedup_by_problem(rows, path) if dedup else list(rows)
    return _nonempty(path, rows, "verl/DAPO-Math")


def read_aime2024(path, dedup: bool = False) -> list:
    """The DAPO authors' AIME-2024 parquet: 960 rows = 30 problems x 32 copies (copies kept by default)."""
    return read_dapo_math(_check_exists(path, "AIME-2024"), dedup=dedup)


# --- plain jsonl sets ----------------------------------------------------------------------------------------------
def _field(path, n: int, obj: dict, key: str, fmt: str):
    value = obj.get(key)
    if value is None or (isinstance(value, str) and not value.strip()):
        _fail(path, n, f"missing or empty '{key}'", f"{fmt} rows need a non-empty '{key}' field")
    return value


def _plain_rows(path, source: str, fmt: str, problem_key: str, answer_of, answer_key: str = "answer") -> list:
    out = []
    for n, obj in iter_jsonl(path):
        problem = _text_field(_field(path, n, obj, problem_key, fmt), path, n, problem_key).strip()
        answer, solution = answer_of(path, n, obj)
        out.append(MathRow(id=stable_id(source, problem), source=source, problem=problem,
                           prompt=apply_template(problem), ground_truth=ground_truth_of(answer, path, n, answer_key),
                           solution=solution))
    return _nonempty(path, out, fmt)


def read_aime2025(path) -> list:
    """AIME-2025 jsonl ``{answer, problem}``."""
    path = _check_exists(path, "AIME-2025")
    fmt = "AIME-2025 {answer, problem}"
    return _plain_rows(path, "aime2025", fmt, "problem", lambda p, n, o: (_field(p, n, o, "answer", fmt), None))


def read_math500(path, integer_only: bool = False) -> list:
    """MATH-500 jsonl ``{problem, solution, answer, ...}``; ``integer_only`` keeps the integer-answer rows (312: 311
    plain integers and "58,500")."""
    path = _check_exists(path, "MATH-500")
    fmt = "MATH-500 {problem, solution, answer}"
    rows = _plain_rows(path, "math500", fmt, "problem",
                       lambda p, n, o: (_field(p, n, o, "answer", fmt), o.get("solution")))
    return [r for r in rows if is_integer_answer(r.ground_truth)] if integer_only else rows


def _gsm8k_answer(path, n: int, obj: dict) -> tuple:
    fmt = "GSM8K {question, answer}"
    text = _text_field(_field(path, n, obj, "answer", fmt), path, n, "answer")
    if "####" not in text:
        _fail(path, n, "'answer' has no '#### <final answer>' marker",
              "GSM8K answers end with a line '#### 18' holding the final answer")
    solution, final = text.rsplit("####", 1)
    final = final.strip()
    if not final:
        _fail(path, n, "nothing after '####' in 'answer'", "put the final answer after '####'")
    return final, solution.strip()


def read_gsm8k(path) -> list:
    """GSM8K jsonl ``{question, answer}``: the ground truth is the text after ``####``."""
    path = _check_exists(path, "GSM8K")
    return _plain_rows(path, "gsm8k", "GSM8K {question, answer}", "question", _gsm8k_answer)


READERS = {
    "dapo_math": read_dapo_math,
    "verl": read_dapo_math,
    "aime2024": read_aime2024,
    "aime2025": read_aime2025,
    "math500": read_math500,
    "gsm8k": read_gsm8k,
}


def read_dataset(fmt: str, path, **kwargs) -> list:
    """Dispatch by format name (one of :data:`READERS`)."""
    if fmt not in READERS:
        raise ValueError(f"unknown data format {fmt!r}; use one of {sorted(READERS)}")
    return READERS[fmt](path, **kwargs)
