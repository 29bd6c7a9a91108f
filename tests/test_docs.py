"""The docs name only things that exist: paths, links, `nemo-dapo` subcommands and their options, recipes.

These check commands and paths, never sentences of prose. The README stays a front door (about 150 lines) with
exactly the two set-up commands at its top.
"""
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "tests" / "README.md", ROOT / "benchmarks" / "README.md",
        *sorted((ROOT / "docs").glob("*.md"))]
TOP = ("nemo_dapo", "conf", "examples", "containers", "tests", "benchmarks", "scripts", "docs", "requirements")
RECIPES = {p.stem for p in (ROOT / "conf" / "recipes").glob("*.yaml")}


def _code_spans(text: str) -> list:
    fenced = re.findall(r"```(?:bash)?\n(.*?)```", text, flags=re.S)
    inline = re.findall(r"(?<!`)`([^`\n]+)`(?!`)", re.sub(r"```.*?```", "", text, flags=re.S))
    return fenced + inline


def _repo_paths(text: str) -> set:
    spans = "\n".join(_code_spans(text))
    found = set(re.findall(r"(?<![\w./-])((?:%s)/[\w./*-]*[\w*/])" % "|".join(TOP), spans))
    return {p for p in found if "<" not in p and "*" not in p}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repo_path_and_link_exists(doc):
    text = doc.read_text()
    missing = sorted(p for p in _repo_paths(text) if not (ROOT / p.rstrip("/")).exists())
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"
    for target in re.findall(r"\]\(([^)#\s]+)\)", text):
        if "://" not in target:
            assert (doc.parent / target).exists(), f"{doc.name} links to a missing file: {target}"


def _nemo_dapo_commands(text: str) -> list:
    out = []
    for span in _code_spans(text):
        for line in span.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0]
            for m in re.finditer(r"(?:^|[\s/&;(])nemo-dapo ([^&|;#]*)", line):
                try:
                    out.append(shlex.split(m.group(1)))
                except ValueError:
                    continue
    return out


def test_every_nemo_dapo_command_in_the_docs_parses():
    from nemo_dapo.cli import build_parser

    parser = build_parser()
    seen = 0
    for doc in DOCS:
        for argv in _nemo_dapo_commands(doc.read_text()):
            if not argv or argv[0].startswith("<") or any("..." in a or a.startswith("<") for a in argv):
                continue
            argv = [a for a in argv if "=" not in a or a.startswith("-")]  # key=value overrides are the job's
            if len(argv) == 1:  # a subcommand named in prose: it must exist
                assert argv[0] in parser._subparsers._group_actions[0].choices, f"{doc.name}: nemo-dapo {argv[0]}"
                continue
            try:
                parser.parse_known_args(argv)
            except SystemExit as e:
                pytest.fail(f"{doc.name}: `nemo-dapo {' '.join(argv)}` does not parse (exit {e.code})")
            seen += 1
    assert seen >= 5  # the check can fail: the docs do show commands


def test_recipes_named_in_the_docs_exist():
    for doc in DOCS:
        text = "\n".join(_code_spans(doc.read_text()))
        names = re.findall(r"--config-name[ =]([a-z][\w.-]*)", text)
        for name in names + re.findall(r"nemo-dapo plan ([a-z][\w./-]*)", text):
            if "/" in name:  # a recipe given as a file
                assert (ROOT / name).is_file(), f"{doc.name} plans a missing file {name}"
                continue
            assert name in RECIPES, f"{doc.name} names recipe {name!r}; conf/recipes has {sorted(RECIPES)}"


def test_readme_is_a_front_door_with_the_two_commands_first():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 170
    first = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1).strip().splitlines()
    assert len(first) == 2
    assert first[0].startswith("bash scripts/install.sh .venv core && .venv/bin/nemo-dapo train")
    assert first[1].startswith("bash scripts/test.sh")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_unfilled_slot(doc):
    assert "@@" not in doc.read_text()
