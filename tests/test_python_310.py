"""The trainer image runs Python 3.10 (NeMo-Aligner 0.7.0's image: PyTorch 24.07), the CPU tests 3.11: the package
and the launcher must parse as 3.10 and import no standard-library name that 3.10 lacks."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*ROOT.joinpath("nemo_dapo").rglob("*.py"), *ROOT.joinpath("examples").rglob("*.py")])
# module -> names added after 3.10 (whole modules: "*")
NEWER = {"tomllib": {"*"}, "wsgiref.types": {"*"}, "enum": {"StrEnum", "verify", "member", "nonmember"},
         "typing": {"Self", "LiteralString", "Never", "NotRequired", "Required", "TypeVarTuple", "Unpack",
                    "assert_never", "assert_type", "reveal_type", "dataclass_transform", "override"},
         "itertools": {"batched"}, "datetime": {"UTC"}, "contextlib": {"chdir"}, "hashlib": {"file_digest"},
         "asyncio": {"TaskGroup", "Runner", "timeout"}, "operator": {"call"}, "math": {"cbrt", "exp2"}}


def newer_names(tree: ast.AST) -> list:
    """(line, 'module.name') for every use of a name in NEWER: imported, or read as module.name."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if NEWER.get(a.name) == {"*"}]
        elif isinstance(node, ast.ImportFrom) and node.module in NEWER:
            new = NEWER[node.module]
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names if "*" in new or a.name in new]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in NEWER:
            if node.attr in NEWER[node.value.id]:
                found.append((node.lineno, f"{node.value.id}.{node.attr}"))
    return found


def test_parses_as_python_310_and_uses_no_newer_stdlib_name():
    problems = []
    for path in SOURCES:
        rel = path.relative_to(ROOT)
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path), feature_version=(3, 10))
        except SyntaxError as e:
            problems.append(f"{rel}:{e.lineno}: not Python 3.10 syntax ({e.msg})")
            continue
        problems += [f"{rel}:{line}: {name} is newer than Python 3.10" for line, name in newer_names(tree)]
    assert len(SOURCES) > 50 and problems == []


def test_the_checks_can_fail():
    with pytest.raises(SyntaxError):
        ast.parse("try:\n    pass\nexcept* ValueError:\n    pass\n", feature_version=(3, 10))
    src = "import tomllib\nfrom enum import StrEnum\nimport typing\nx: typing.Self\nfrom itertools import chain\n"
    assert newer_names(ast.parse(src)) == [(1, "tomllib"), (2, "enum.StrEnum"), (4, "typing.Self")]
