"""The algorithm registry and its `nemo_aligner.algorithms` entry point (needs `pip install -e .`, not NeMo)."""
import argparse
from importlib import metadata
from pathlib import Path

import pytest

from nemo_dapo.cluster import registry as R

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def clean_registry():
    saved = dict(R._REGISTRY)
    yield
    R._REGISTRY.clear()
    R._REGISTRY.update(saved)


def test_entry_point_is_discoverable_after_install():
    eps = {ep.name: ep for ep in metadata.entry_points(group=R.ENTRY_POINT_GROUP)}
    assert "dapo" in eps, "run `pip install -e .`: setup.py declares the nemo_aligner.algorithms entry point"
    assert eps["dapo"].value == "nemo_dapo.cluster.registry:DAPO_ALGORITHM"
    assert eps["dapo"].load() is R.DAPO_ALGORITHM


def test_console_script_is_installed():
    scripts = {ep.name: ep.value for ep in metadata.entry_points(group="console_scripts")}
    assert scripts.get("nemo-dapo") == "nemo_dapo.cli:main"


def test_dapo_record_points_at_the_runtime_and_files_in_the_repo():
    a = R.get("dapo")
    assert a.trainer == "nemo_dapo.aligner.trainer:DAPOTrainer"
    assert a.actor == "nemo_dapo.aligner.actor:MegatronGPTDAPOActorModel"
    assert a.config_path().is_file() and a.example_path().is_file()
    assert a.config_path() == ROOT / "conf" / "gpt_dapo_actor.yaml"


def test_list_includes_dapo_and_is_sorted():
    names = [a.name for a in R.list_algorithms()]
    assert "dapo" in names and names == sorted(names)


def test_register_refuses_a_silent_replacement(clean_registry):
    other = R.Algorithm(name="dapo", trainer="x.y:T", actor="x.y:A", config="c.yaml", example="e.py")
    with pytest.raises(ValueError, match="already registered"):
        R.register(other)
    R.register(other, replace=True)
    assert R.get("dapo") is other
    R.register(other)  # the same record again is fine


def test_unknown_algorithm_names_the_registered_ones():
    with pytest.raises(KeyError, match="dapo"):
        R.get("grpo-typo")


@pytest.mark.parametrize("kw", [dict(name=""), dict(name="a b"), dict(trainer="no_colon"), dict(actor="m:")])
def test_malformed_records_are_rejected(kw):
    fields = dict(name="x", trainer="m:T", actor="m:A", config="c.yaml", example="e.py") | kw
    with pytest.raises(ValueError):
        R.Algorithm(**fields)


def test_class_paths_resolve_lazily():
    a = R.Algorithm(name="demo", trainer="json:JSONDecoder", actor="json:JSONEncoder", config="c", example="e")
    import json

    assert a.load_trainer() is json.JSONDecoder and a.load_actor() is json.JSONEncoder
    with pytest.raises(ImportError, match="no attribute"):
        R.Algorithm(name="bad", trainer="json:Nope", actor="json:Nope", config="c", example="e").load_trainer()


class FakeEntryPoint:
    def __init__(self, name, value, obj=None, error=None):
        self.name, self.value, self._obj, self._error = name, value, obj, error

    def load(self):
        if self._error:
            raise self._error
        return self._obj


def test_discovery_registers_plugins_and_survives_broken_ones(clean_registry, monkeypatch, capsys):
    good = R.Algorithm(name="other", trainer="p.t:T", actor="p.a:A", config="c.yaml", example="e.py")
    fakes = [FakeEntryPoint("broken", "p.x:ALG", error=ImportError("no module p")),
             FakeEntryPoint("wrong", "p.y:ALG", obj=object()),
             FakeEntryPoint("other", "p.z:ALG", obj=good)]
    monkeypatch.setattr(R.metadata, "entry_points", lambda group: fakes if group == R.ENTRY_POINT_GROUP else [])
    names = [a.name for a in R.list_algorithms()]
    assert names == ["dapo", "other"]
    err = capsys.readouterr().err
    assert "broken=p.x:ALG failed to load" in err and "wrong=p.y:ALG is not an Algorithm" in err


def test_algorithms_subcommand_lists_dapo(capsys):
    ap = argparse.ArgumentParser()
    R.add_cli(ap.add_subparsers())
    args = ap.parse_args(["algorithms"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("dapo: ") and "nemo_dapo.aligner.trainer:DAPOTrainer" in out


def test_cli_entries_plug_into_the_nemo_dapo_command(capsys):
    """Both subcommands in the shape of nemo_dapo.cli.SUBCOMMANDS: (name, help, add_arguments, run)."""
    from nemo_dapo.cluster import plan

    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers()
    for name, help_text, add_arguments, run in (R.CLI, plan.CLI):
        p = sub.add_parser(name, help=help_text)
        add_arguments(p)
        p.set_defaults(run=run)
    args = ap.parse_args(["plan", "qwen2.5-32b_h100"])
    assert args.run(args) == 0 and "-> fits" in capsys.readouterr().out
    args = ap.parse_args(["algorithms"])
    assert args.run(args) == 0 and "dapo:" in capsys.readouterr().out


# ---- examples/train_gpt_dapo.py: a contract test against the runtime modules, without importing NeMo -------------
def _example_tree():
    import ast

    return ast.parse((ROOT / "examples" / "train_gpt_dapo.py").read_text())


def _signature_params(path: Path, cls: str, method: str = "__init__") -> set:
    import ast

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    a = item.args
                    return {x.arg for x in a.args + a.kwonlyargs} - {"self"}
    raise AssertionError(f"{cls}.{method} not found in {path}")


def test_example_uses_hydra_runner_on_the_base_config():
    import ast

    main = next(n for n in _example_tree().body if isinstance(n, ast.FunctionDef) and n.name == "main")
    deco = main.decorator_list[0]
    assert deco.func.id == "hydra_runner"
    kw = {k.arg: k.value.value for k in deco.keywords}
    assert kw == {"config_path": "../conf", "config_name": "gpt_dapo_actor"}
    assert (ROOT / "examples" / kw["config_path"] / f"{kw['config_name']}.yaml").is_file()


def _top_level_names(path: Path) -> set:
    import ast

    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def test_example_imports_exist_in_the_plugin():
    """Checked on the source (AST): several of these modules import NeMo, which takes minutes on a busy CPU."""
    import ast

    for node in ast.walk(_example_tree()):
        if isinstance(node, ast.ImportFrom) and node.module.startswith("nemo_dapo"):
            path = ROOT / (node.module.replace(".", "/") + ".py")
            defined = _top_level_names(path)
            for alias in node.names:
                assert alias.name in defined, f"{node.module}.{alias.name}"


def test_example_calls_the_trainer_with_its_constructor_arguments():
    import ast

    call = next(n for n in ast.walk(_example_tree()) if isinstance(n, ast.Call) and isinstance(n.func, ast.Call)
                and getattr(n.func.func, "attr", "") == "load_trainer")
    trainer_py = ROOT / "nemo_dapo" / "aligner" / "trainer.py"
    params = _signature_params(trainer_py, R.DAPO_ALGORITHM.trainer.split(":")[1])
    assert {k.arg for k in call.keywords} <= params
    assert _signature_params(ROOT / "nemo_dapo" / "aligner" / "actor.py", R.DAPO_ALGORITHM.actor.split(":")[1])


@pytest.mark.slow
@pytest.mark.nemo
def test_class_paths_and_example_import_with_the_nemo_stack():
    """The registry's class paths resolve and the launcher imports, with NeMo 2.1 / NeMo-Aligner 0.7.0 installed
    (TensorRT-LLM replaced by the test stand-in). In a subprocess: NeMo's import side effects stay out of this one."""
    import subprocess
    import sys

    pytest.importorskip("nemo_aligner")
    code = ("import importlib.util, tests.support.trtllm_stub\n"
            "from nemo_dapo.cluster.registry import get\n"
            "a = get('dapo')\n"
            "print(a.load_actor().__name__, a.load_trainer().__name__)\n"
            "spec = importlib.util.spec_from_file_location('train_gpt_dapo', 'examples/train_gpt_dapo.py')\n"
            "module = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(module)\n"
            "print(callable(module.main))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-3:] == ["MegatronGPTDAPOActorModel", "DAPOTrainer", "True"]
