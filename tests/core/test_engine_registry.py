"""nemo_dapo.core.engine_registry: one row per engine, read by every place that names engines. A new engine is one
row: registered here (a toy row, in this test only), the cluster validator, the option mapper, the engine server and
the planner take it with no other edit."""
import json
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from nemo_dapo.core import engine_registry as R

TOY = "toy_inflight"
RECIPE = "qwen2.5-32b_h100"


def toy_options(s: dict) -> dict:
    """The toy row's option mapper: takes the engine_server settings as the real mappers do."""
    return {"vocab": 64, "max_batch_size": s["max_batch_size"]}


TOY_ROW = R.EngineSpec(TOY, adapter="tests.engines.toy_engine:ToyEngine", options=f"{__name__}:toy_options",
                       plan="inflight", install="pip install toy-engine")


def cluster_cfg(engine: str) -> dict:
    from nemo_dapo.cluster import config_load as cl

    return OmegaConf.to_container(cl.load_config(RECIPE, [f"trainer.dapo.rollout_engine={engine}"]), resolve=True)


def seen_by_every_reader(cfg: dict, model_dir) -> dict:
    """What the validator, the option mapper, the server and the planner make of ``cfg``'s rollout engine."""
    from nemo_dapo.cluster import config_validate as cv
    from nemo_dapo.cluster.engine_options import EngineOptionsError, engine_options
    from nemo_dapo.cluster.plan import PlanError, make_plan
    from nemo_dapo.engines.server import StartError, make_engine

    engine = cfg["trainer"]["dapo"]["rollout_engine"]
    out = {"validator": [p for p in cv.check_config(cfg) if "rollout_engine" in p]}
    try:
        out["options"] = engine_options(cfg)
    except EngineOptionsError as e:
        out["options"] = str(e)
    try:
        out["adapter"] = make_engine(engine, str(model_dir), {"vocab": 64})
    except StartError as e:
        out["adapter"] = str(e)
    try:
        out["plan"] = make_plan(cfg)
    except PlanError as e:
        out["plan"] = str(e)
    return out


def test_a_new_engine_is_one_row(monkeypatch, tmp_path):
    from tests.engines.toy_engine import ToyEngine

    (tmp_path / "config.json").write_text("{}")
    cfg = cluster_cfg(TOY)
    before = seen_by_every_reader(cfg, tmp_path)
    assert before["validator"] == [f"trainer.dapo.rollout_engine={TOY!r} must be one of {R.rollout_engines()}"]
    assert "runs no engine server" in before["options"]
    assert f"--engine {TOY!r}: unknown" in before["adapter"]
    assert f"rollout_engine={TOY!r}: `nemo-dapo plan` models ['legacy', 'trtllm', 'vllm']" in before["plan"]

    monkeypatch.setitem(R.ENGINES, TOY, TOY_ROW)
    after = seen_by_every_reader(cfg, tmp_path)
    assert after["validator"] == []
    srv = cfg["trainer"]["dapo"]["engine_server"]
    gpus = srv["tensor_parallel_size"] * srv["pipeline_parallel_size"]
    assert after["options"] == {"engine": TOY, "engine_gpus": gpus,
                                "options": {"vocab": 64, "max_batch_size": srv["max_batch_size"]}}
    assert isinstance(after["adapter"], ToyEngine) and after["adapter"].vocab == 64
    plan = after["plan"]
    assert plan["gen"]["engine"] == TOY and plan["gen"]["server"]["tp"] == srv["tensor_parallel_size"]
    assert plan["time"]["generation"] == plan["time"]["gen"]["inflight"]  # the row's plan model is the one selected
    # the same layout as trtllm's, the engine that reads the same engine_server block with the same model; the row's
    # cuda_graphs (default True) is what differs: trtllm's row says False
    trtllm_cfg = cluster_cfg("trtllm")
    trtllm = seen_by_every_reader(trtllm_cfg, tmp_path)["plan"]
    assert plan["gen"]["graphs"] and not trtllm["gen"]["graphs"]
    assert plan["time"]["total"] < trtllm["time"]["total"]
    trtllm_cfg["plan"]["cuda_graphs"] = True
    trtllm = seen_by_every_reader(trtllm_cfg, tmp_path)["plan"]
    assert plan["time"]["total"] == pytest.approx(trtllm["time"]["total"])


def test_a_row_that_is_not_served_reaches_no_engine_server(monkeypatch, tmp_path):
    monkeypatch.setitem(R.ENGINES, TOY, R.EngineSpec(TOY, adapter=None, options=None, plan="static", install="-"))
    (tmp_path / "config.json").write_text("{}")
    seen = seen_by_every_reader(cluster_cfg(TOY), tmp_path)
    assert seen["validator"] == []
    assert "runs no engine server" in seen["options"] and f"--engine {TOY!r}: unknown" in seen["adapter"]
    assert "server" not in seen["plan"]["gen"]  # planned as NeMo-Aligner's static engine is
    assert seen["plan"]["time"]["generation"] == seen["plan"]["time"]["gen"]["static"]


def test_every_row_resolves_to_what_its_layer_runs():
    from nemo_dapo.cluster import plan_generation

    for spec in R.ENGINES.values():
        if spec.options is not None:
            assert callable(R.load(spec.options)), spec.name
        if spec.plan is not None:
            assert spec.plan in plan_generation.MODEL_LABELS
    assert R.served_engines() == ("trtllm", "vllm", "local")
    assert R.cpu_engines() == ("vllm", "local") and R.planned_engines() == ("legacy", "trtllm", "vllm")
    # the adapters themselves import their engine: checked in their own tests (tests/engines/test_*_engine.py)
    local = R.load(R.ENGINES["local"].adapter)
    assert local.__qualname__ == "LocalEngine.from_path"


@pytest.mark.parametrize("bad, match", [
    (dict(name="two words"), "must be an identifier"),
    (dict(adapter="no_colon"), "must look like 'package.module:attr'"),
    (dict(plan="fast"), "plan='fast' must be one of"),
    (dict(adapter=None), "an option mapper without an adapter"),
])
def test_a_malformed_row_is_refused(bad, match):
    row = dict(name="x", adapter="m:f", options="m:g", plan=None, install="-") | bad
    with pytest.raises(ValueError, match=match):
        R.EngineSpec(**row)


def test_the_registry_imports_nothing_but_the_standard_library():
    # the cluster tooling reads it on a login node without torch; the engine server in an engine's environment
    probe = ("import sys, json; base = set(sys.modules); import nemo_dapo.core.engine_registry; "
             "print(json.dumps(sorted(m for m in set(sys.modules) - base if not m.startswith('nemo_dapo'))))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    third_party = [m for m in json.loads(out.stdout) if m.split(".")[0] not in sys.stdlib_module_names]
    assert third_party == []


def test_a_cpu_row_is_a_rollout_engine_of_the_cpu_job(monkeypatch):
    """The CPU config reads the registry when it validates, not when it was imported: a row registered later counts."""
    import dataclasses

    from nemo_dapo.core.settings import ConfigError
    from nemo_dapo.local.config import load_config

    with pytest.raises(ConfigError, match=f"'rollout.engine' = '{TOY}' is not one of"):
        load_config(overrides=[f"rollout.engine={TOY}"])
    monkeypatch.setitem(R.ENGINES, TOY, dataclasses.replace(TOY_ROW, cpu=True))
    assert load_config(overrides=[f"rollout.engine={TOY}"]).rollout.engine == TOY
