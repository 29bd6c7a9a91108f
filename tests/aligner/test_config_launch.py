"""Lint of the launch files: containers/Dockerfile, containers/dapo.sbatch, the README (docker/Slurm not needed).

The sbatch script is executed with a stand-in `srun` that records its arguments, and the command it would run in the
container is composed with the recipe and validated, so a broken override in the script fails here, not on the
cluster.
"""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from nemo_dapo.cluster import config_load as cl
from nemo_dapo.cluster import config_validate as cv
from nemo_dapo.cluster.engine_options import engine_options

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "containers" / "Dockerfile"
SBATCH = ROOT / "containers" / "dapo.sbatch"
DOCS = ROOT / "docs" / "cluster.md"  # the cluster procedure (the README's quick start links to it)


def instructions(text: str) -> list:
    """Dockerfile instructions as (KEYWORD, argument) with line continuations joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#")))
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln.strip() else "")
            for ln in joined.splitlines() if ln.strip()]


def test_dockerfile_builds_on_nemo_aligners_own_image_and_installs_without_deps():
    ins = instructions(DOCKERFILE.read_text())
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for k, a in ins if k == "ARG" and "=" in a}
    assert args["BASE_IMAGE"] == "nemo-aligner:0.7.0"  # built from NeMo-Aligner v0.7.0's own Dockerfile
    assert args["STACK_CHECK"] == "strict"
    assert ins[[k for k, _ in ins].index("FROM")][1] == "${BASE_IMAGE}"
    runs = " ".join(a for k, a in ins if k == "RUN")
    assert re.search(r"pip install .*--no-deps", runs)
    assert "python -m nemo_dapo.aligner.compat --stack-check ${STACK_CHECK}" in runs  # the whole stack is checked
    assert ("COPY", ". /opt/nemo_dapo") in ins


def test_dockerfile_comment_states_the_evidence():
    text = DOCKERFILE.read_text()
    assert "35b71c8a" in text and "3cbacd84" in text  # NeMo-Aligner adapted to nemo:25.02
    assert "791b70e0" in text and "25.02.rc5" in text  # ...which is NeMo 2.2 + megatron-core 0.11 (very likely)
    assert "633cb602" in text and "d15cec53" in text and "ALIGNER_COMMIT=v0.7.0" in text  # the exact base


def test_docker_ignore_keeps_virtualenvs_out_of_the_context():
    ignored = (ROOT / "containers" / "Dockerfile.dockerignore").read_text().split()
    assert ".venv*" in ignored and ".git" in ignored


def test_sbatch_script_parses_and_has_the_cluster_pieces():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    text = SBATCH.read_text()
    for piece in ("#SBATCH --ntasks-per-node=8", "srun --overlap --kill-on-bad-exit=1 --mpi=\"${TRAINER_MPI:-pmix}\"",
                  "--container-image=",
                  "--container-mounts=", "--no-container-mount-home", "export CUDA_DEVICE_MAX_CONNECTIONS=1",
                  "examples/train_gpt_dapo.py --config-name recipes/", "trap cleanup EXIT INT TERM"):
        assert piece in text, piece
    assert not re.search(r"^\s*(export\s+)?NCCL_ALGO=", text, re.M)  # never set by default


FAKE_SRUN = """#!/bin/bash
# records every call (NUL-separated args, one call per file, numbered under a lock), the env it saw; the engine
# options call really runs (container paths mapped to the checkout and RESULTS); an engine server call records
# whether the options file exists and stays up; a health probe, like the real one, waits until a server is up
case "$*" in *nemo_dapo.engines.health*)
  for _ in $(seq 100); do [ -f "$SRUN_DIR/engine.pid" ] && break; sleep 0.1; done ;; esac
exec 9>"$SRUN_DIR/lock"; flock 9
n=$(ls "$SRUN_DIR" | grep -c '^call' || true)
for a in "$@"; do printf "%s\\0" "$a"; done > "$SRUN_DIR/call$n"
echo "NCCL_ALGO=${NCCL_ALGO-unset}" "CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS-unset}" > "$SRUN_DIR/env$n"
flock -u 9; exec 9>&-
case "$*" in
  *nemo_dapo.cluster.engine_options*) cmd="${@: -1}"; cmd="${cmd//"/opt/nemo_dapo"/"$REPO_ROOT"}"
                                      exec bash -c "${cmd//"/results/"/"$RESULTS/"}" ;;
  *nemo_dapo.engines.server*) cp "$RESULTS/engine_options.json" "$SRUN_DIR/options_at_server_start.json"
                              echo $$ > "$SRUN_DIR/engine.pid.tmp"; mv "$SRUN_DIR/engine.pid.tmp" "$SRUN_DIR/engine.pid"
                              exec sleep 300 ;;
  *train_gpt_dapo.py*) exit "${TRAINER_RC:-0}" ;;
esac
"""


@pytest.fixture
def fake_srun(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    srun = bindir / "srun"
    srun.write_text(FAKE_SRUN)
    srun.chmod(0o755)
    python = bindir / "python"  # the container's `python` for the engine options call (a link would lose the venv)
    python.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    python.chmod(0o755)
    return bindir


def run_sbatch(fake_srun, tmp_path, *overrides, check=True, **env_over):
    """Run the script with the fake srun; returns (exit code, [argv of each srun call in order])."""
    calls = tmp_path / "calls"
    calls.mkdir(exist_ok=True)
    clean = {k: v for k, v in os.environ.items() if k not in ("NCCL_ALGO", "CUDA_DEVICE_MAX_CONNECTIONS")}
    env = dict(clean, PATH=f"{fake_srun}:{os.environ['PATH']}", SRUN_DIR=str(calls), SLURM_JOB_NUM_NODES="16",
               SLURM_JOB_ID="77", CONTAINER="nemo-dapo.sqsh", ENGINE_CONTAINER="nemo-dapo-engine.sqsh",
               CHECKPOINT="/ckpt/qwen/model.nemo", TOKENIZER="/hf/Qwen2.5-32B", HF_MODEL="/hf/Qwen2.5-32B",
               TRAIN_DATA="/data/train.parquet", VAL_DATA="/eval/aime-2024.parquet",
               RESULTS=str(tmp_path / "results"), REPO_ROOT=str(ROOT), OMP_NUM_THREADS="1")
    env.update(env_over)
    out = subprocess.run(["bash", str(SBATCH), *overrides], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    if check:
        assert out.returncode == 0, out.stderr
    n = len(list(calls.glob("call*")))
    return out.returncode, [(calls / f"call{i}").read_text().split("\0")[:-1] for i in range(n)]


def kinds(calls):
    return ["options" if any("nemo_dapo.cluster.engine_options" in a for a in c) else
            "server" if any("nemo_dapo.engines.server" in a for a in c) else
            "health" if any("nemo_dapo.engines.health" in a for a in c) else
            "trainer" if any("train_gpt_dapo.py" in a for a in c) else "?" for c in calls]


def trainer_call(calls):
    return next(c for c in calls if any("train_gpt_dapo.py" in a for a in c))


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_sbatch_command_composes_with_the_recipe_and_validates(fake_srun, tmp_path):
    _, calls = run_sbatch(fake_srun, tmp_path, "trainer.dapo.max_steps=2", RECIPE="qwen2.5-32b_h20")
    args = trainer_call(calls)
    assert args[:5] == ["--overlap", "--kill-on-bad-exit=1", "--mpi=pmix", "--nodes=16", "--ntasks-per-node=8"]
    mounts = next(a for a in args if a.startswith("--container-mounts="))
    assert "/ckpt/qwen:/ckpt/qwen:ro" in mounts and f"{tmp_path}/results:/results" in mounts
    assert "/hf/Qwen2.5-32B:/tokenizer:ro" in mounts  # the converter's tokenizer path does not exist in the job
    assert args[-2] == "-c"
    _, _, python_cmd = args[-1].partition("&&")
    argv = shlex.split(python_cmd)
    assert argv[:4] == ["python", "-u", "examples/train_gpt_dapo.py", "--config-name"]
    assert "++model.tokenizer.type=/tokenizer" in argv and "++model.tokenizer.library=huggingface" in argv
    recipe = argv[4].split("/", 1)[1]
    cfg = cl.load_config(recipe, argv[5:])
    assert cv.check_config(cfg) == []
    assert cfg.trainer.num_nodes == 16 and cfg.trainer.dapo.max_steps == 2
    assert cfg.trainer.dapo.rollout_engine == "trtllm" and cfg.trainer.dapo.engine_server.tensor_parallel_size == 8
    assert cfg.trainer.dapo.engine_server.hf_model_dir == "/hf/Qwen2.5-32B"
    assert OmegaConf.to_container(cfg.model.data.data_prefix) == {"train": ["/data/train.parquet"],
                                                                  "validation": ["/eval/aime-2024.parquet"]}
    assert cfg.exp_manager.explicit_log_dir == "/results"


def test_sbatch_starts_servers_then_waits_for_health_then_trains(fake_srun, tmp_path):
    _, calls = run_sbatch(fake_srun, tmp_path)
    assert kinds(calls) == ["options", "server", "health", "trainer"]
    options, server, health = calls[0], calls[1], calls[2]
    assert "--container-image=nemo-dapo.sqsh" in options and "--ntasks=1" in options  # the trainer's image, once
    assert "--ntasks-per-node=1" in server and "--nodes=16" in server  # engine TP8 (recipe): one engine per node
    assert "--container-image=nemo-dapo-engine.sqsh" in server
    assert f"{tmp_path}/results:/results:ro" in next(a for a in server if a.startswith("--container-mounts="))
    assert "--options-file /results/engine_options.json" in server[-1] and "--option " not in server[-1]
    probe = shlex.split(health[-1])
    assert probe[:3] == ["python", "-m", "nemo_dapo.engines.health"]
    assert probe[-1] == "unix:/tmp/nemo-dapo-77/engine-0.sock"


def test_sbatch_engines_get_their_options_and_gpus_from_the_config(fake_srun, tmp_path):
    """The options file is written before the servers start, from the recipe plus the job's overrides."""
    es = "trainer.dapo.engine_server"
    _, calls = run_sbatch(fake_srun, tmp_path, f"{es}.tensor_parallel_size=2", f"{es}.max_batch_size=64")
    seen = json.loads((tmp_path / "calls" / "options_at_server_start.json").read_text())
    cfg = cl.load_config("qwen2.5-32b_h100", [f"{es}.tensor_parallel_size=2", f"{es}.max_batch_size=64"])
    assert seen == engine_options(OmegaConf.to_container(cfg, resolve=True))
    assert seen["engine_gpus"] == 2 and seen["options"]["max_batch_size"] == 64
    assert seen["options"]["capacity_scheduler"] == "max_utilization"
    server, health = calls[1], calls[2]
    assert "--ntasks-per-node=4" in server  # 8 GPUs / engines of 2
    assert "$((i * 2))" in server[-1] and "$((i * 2 + 2 - 1))" in server[-1]  # CUDA_VISIBLE_DEVICES per engine
    assert [a for a in shlex.split(health[-1]) if a.startswith("unix:")] == [
        f"unix:/tmp/nemo-dapo-77/engine-{i}.sock" for i in range(4)]
    argv = shlex.split(trainer_call(calls)[-1].partition("&&")[2])
    assert cl.load_config(argv[4].split("/", 1)[1], argv[5:]).trainer.dapo.engine_server.tensor_parallel_size == 2
    sub = tmp_path / "envtp"
    sub.mkdir()
    rc, calls = run_sbatch(fake_srun, sub, check=False, ENGINE_TP="2")
    assert rc == 2 and calls == []  # the old env var is refused, not silently disagreeing with the config
    bad = tmp_path / "pp2"
    bad.mkdir()
    rc, calls = run_sbatch(fake_srun, bad, f"{es}.pipeline_parallel_size=2", check=False)
    assert rc != 0 and kinds(calls) == ["options"]  # TRT-LLM's adapter has no PP: no server is started


def test_sbatch_tears_the_servers_down_when_training_fails(fake_srun, tmp_path):
    rc, calls = run_sbatch(fake_srun, tmp_path, check=False, TRAINER_RC="3")
    assert rc == 3 and kinds(calls) == ["options", "server", "health", "trainer"]
    pid = int((tmp_path / "calls" / "engine.pid").read_text())
    with pytest.raises(ProcessLookupError):  # the trap killed the engine server step
        os.kill(pid, 0)


def test_sbatch_legacy_engine_runs_the_trainer_only(fake_srun, tmp_path):
    _, calls = run_sbatch(fake_srun, tmp_path, ROLLOUT_ENGINE="legacy", ENGINE_CONTAINER="", HF_MODEL="")
    assert len(calls) == 1 and "trainer.dapo.rollout_engine" not in calls[0][-1]


def test_sbatch_exports_no_nccl_algo_unless_asked(fake_srun, tmp_path):
    run_sbatch(fake_srun, tmp_path)
    env_files = sorted((tmp_path / "calls").glob("env*"))
    # CUDA_DEVICE_MAX_CONNECTIONS is set inside the trainer's command only (tests/aligner/test_sbatch_steps.py)
    assert env_files and all(f.read_text().split() == ["NCCL_ALGO=unset", "CUDA_DEVICE_MAX_CONNECTIONS=unset"]
                             for f in env_files)
    other = tmp_path / "asked"
    other.mkdir()
    run_sbatch(fake_srun, other, NCCL_ALGO="Ring")
    assert (other / "calls" / "env0").read_text().split()[0] == "NCCL_ALGO=Ring"


def test_sbatch_restores_a_checkpoint_directory_through_a_writable_view(fake_srun, tmp_path):
    ckpt = tmp_path / "ckpt-dir"
    (ckpt / "context").mkdir(parents=True)
    (ckpt / "weights").mkdir()
    _, calls = run_sbatch(fake_srun, tmp_path, CHECKPOINT=str(ckpt))
    view = tmp_path / "results" / "checkpoint_view"
    assert (view / "context").is_symlink() and os.readlink(view / "context") == str(ckpt / "context")
    args = trainer_call(calls)
    assert "pretrained_checkpoint.restore_from_path=/results/checkpoint_view" in args[-1]
    assert f"{ckpt}:{ckpt}:ro" in next(a for a in args if a.startswith("--container-mounts="))


def test_sbatch_refuses_to_run_without_its_inputs(fake_srun, tmp_path):
    env = dict(os.environ, PATH=f"{fake_srun}:{os.environ['PATH']}", SRUN_DIR=str(tmp_path))
    for key in ("CONTAINER", "CHECKPOINT", "TRAIN_DATA", "VAL_DATA", "RESULTS", "TOKENIZER"):
        env.pop(key, None)
    out = subprocess.run(["bash", str(SBATCH)], env=env, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode != 0 and "set CONTAINER" in out.stderr


def test_cluster_docs_show_the_commands_and_name_existing_files():
    text = DOCS.read_text()
    for cmd in ("docker build -f containers/Dockerfile ", "docker build -f containers/Dockerfile.engine",
                "sbatch --nodes=16", "containers/dapo.sbatch", "nemo-dapo plan", "srun --mpi=pmix",
                "--no-container-mount-home", "CUDA_DEVICE_MAX_CONNECTIONS=1", "ENGINE_CONTAINER=", "TOKENIZER=",
                "HF_MODEL="):
        assert cmd in text, cmd
    assert "NCCL_ALGO" in text and "NCCL_ALGO=Tree" not in text  # the launch's choice is documented, not the old one
    recipes = set(re.findall(r"\b((?:qwen2\.5-32b|moe-[\w.-]+?)_h(?:100|20))\b", text))
    assert {"qwen2.5-32b_h100", "moe-mixtral-8x22b_h100"} <= recipes
    for recipe in recipes:
        assert (ROOT / "conf" / "recipes" / f"{recipe}.yaml").is_file(), recipe
    for path in set(re.findall(r"`((?:containers|conf|examples|nemo_dapo)/[\w./-]+)`", text)):
        assert (ROOT / path).exists(), path


def test_dockerfile_stack_check_accepts_the_stack_and_rejects_another(tmp_path):
    """Runs the image's own check (its RUN line) here, on the CPU stack, then with another NeMo installed in front
    of it (a distribution's metadata is found first on sys.path): the build fails naming it, unless told to warn."""
    from importlib import metadata

    try:
        metadata.version("nemo_aligner"), metadata.version("nemo_toolkit"), metadata.version("megatron_core")
    except metadata.PackageNotFoundError:
        pytest.skip("needs the NeMo stack installed (scripts/install.sh full)")
    check = next(a for k, a in instructions(DOCKERFILE.read_text()) if k == "RUN" and "aligner.compat" in a)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    wrapper = bindir / "python"  # `python` in the RUN line = this interpreter (a symlink would lose the venv)
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", PYTHONPATH=str(ROOT), STACK_CHECK="strict")
    ok = subprocess.run(["bash", "-c", check], env=env, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "stack: nemo-aligner==0.7.0, nemo-toolkit==2.1.0, megatron-core==0.10.0" in ok.stdout
    assert "the trainer state round-trips through a weights-only load: True" in ok.stdout
    assert "registered: nemo_dapo.aligner.trainer:DAPOTrainer" in ok.stdout
    other = tmp_path / "site"  # what nemo:25.02 very likely ships
    (other / "nemo_toolkit-2.2.0.dist-info").mkdir(parents=True)
    (other / "nemo_toolkit-2.2.0.dist-info" / "METADATA").write_text("Name: nemo_toolkit\nVersion: 2.2.0\n")
    env = dict(env, PYTHONPATH=f"{other}:{ROOT}")
    bad = subprocess.run(["bash", "-c", check], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "found nemo-toolkit==2.2.0" in bad.stderr and "STACK_CHECK=warn" in bad.stderr
    assert "registered" not in bad.stdout  # the build stops at the check
    warn = subprocess.run(["bash", "-c", check], env=dict(env, STACK_CHECK="warn"), capture_output=True, text=True)
    assert warn.returncode == 0 and "WARNING" in warn.stderr and "registered" in warn.stdout


def test_launch_files_name_no_old_algorithm_key():
    """The docs, the launcher and the example use the one block, model.dapo.algorithm.*; the lint can fail."""
    key = re.compile(r"\b(?:trainer|model)\.dapo\.[A-Za-z_][\w.]*")
    assert key.findall("`trainer.dapo.group_size=8`") == ["trainer.dapo.group_size"]
    assert cl.moved_key("trainer.dapo.group_size") == "model.dapo.algorithm.group_size"
    for path in (DOCS, SBATCH, ROOT / "examples" / "train_gpt_dapo.py"):
        text = path.read_text()
        if path.suffix == ".py":  # the example's comment quotes an old key on purpose: check code only
            text = "\n".join(ln.split("#", 1)[0] for ln in text.splitlines())
        old = [k for k in key.findall(text) if cl.moved_key(k.rstrip("."))]
        assert not old, f"{path.name} names old algorithm keys {old}"


def test_the_example_refuses_old_keys_before_hydra_parses_them():
    import ast

    tree = ast.parse((ROOT / "examples" / "train_gpt_dapo.py").read_text())
    main_block = next(n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test))
    calls = [ast.unparse(n.value.func) for n in main_block.body if isinstance(n, ast.Expr)
             and isinstance(n.value, ast.Call)]
    assert calls == ["reject_moved_overrides", "main"]
