"""Lint of the launch files: containers/Dockerfile, containers/dapo.sbatch, the README (docker/Slurm not needed).

The sbatch script is executed with a stand-in `srun` that records its arguments, and the command it would run in the
container is composed with the recipe and validated, so a broken override in the script fails here, not on the
cluster.
"""
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from nemo_dapo.aligner import config_validate as cv

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "containers" / "Dockerfile"
SBATCH = ROOT / "containers" / "dapo.sbatch"
DOCS = ROOT / "README.md"  # its "Run on a cluster" section


def instructions(text: str) -> list:
    """Dockerfile instructions as (KEYWORD, argument) with line continuations joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#")))
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln.strip() else "")
            for ln in joined.splitlines() if ln.strip()]


def test_dockerfile_builds_from_the_nemo_container_and_installs_without_deps():
    ins = instructions(DOCKERFILE.read_text())
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for k, a in ins if k == "ARG" and "=" in a}
    assert args["BASE_IMAGE"] == "nvcr.io/nvidia/nemo:25.02"
    assert ins[[k for k, _ in ins].index("FROM")][1] == "${BASE_IMAGE}"
    runs = " ".join(a for k, a in ins if k == "RUN")
    assert re.search(r"pip install .*--no-deps", runs)
    assert "nemo_aligner" in runs and "EXPECT_ALIGNER" in runs  # the build checks the shipped Aligner version
    assert ("COPY", ". /opt/nemo_dapo") in ins


def test_dockerfile_comment_states_the_tag_evidence():
    text = DOCKERFILE.read_text()
    assert "35b71c8a" in text and "3cbacd84" in text


def test_docker_ignore_keeps_virtualenvs_out_of_the_context():
    ignored = (ROOT / "containers" / "Dockerfile.dockerignore").read_text().split()
    assert ".venv*" in ignored and ".git" in ignored


def test_sbatch_script_parses_and_has_the_cluster_pieces():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    text = SBATCH.read_text()
    for piece in ("#SBATCH --ntasks-per-node=8", "srun --mpi=pmix", "--container-image=", "--container-mounts=",
                  "--no-container-mount-home", "NCCL_ALGO=${NCCL_ALGO-Tree}", "export CUDA_DEVICE_MAX_CONNECTIONS=1",
                  "examples/train_gpt_dapo.py --config-name recipes/"):
        assert piece in text, piece


@pytest.fixture
def fake_srun(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    srun = bindir / "srun"
    srun.write_text('#!/bin/bash\nfor a in "$@"; do printf "%s\\0" "$a"; done > "$SRUN_LOG"\n'
                    'echo "NCCL_ALGO=${NCCL_ALGO-unset}" '
                    '"CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS-unset}" > "$SRUN_LOG.env"\n')
    srun.chmod(0o755)
    return bindir


def run_sbatch(fake_srun, tmp_path, *overrides, **env_over):
    log = tmp_path / "srun.args"
    clean = {k: v for k, v in os.environ.items() if k not in ("NCCL_ALGO", "CUDA_DEVICE_MAX_CONNECTIONS")}
    env = dict(clean, PATH=f"{fake_srun}:{os.environ['PATH']}", SRUN_LOG=str(log), SLURM_JOB_NUM_NODES="16",
               CONTAINER="nemo-dapo.sqsh", CHECKPOINT="/ckpt/qwen/model.nemo", TRAIN_DATA="/data/train.parquet",
               VAL_DATA="/eval/aime-2024.parquet", RESULTS=str(tmp_path / "results"), **env_over)
    subprocess.run(["bash", str(SBATCH), *overrides], check=True, env=env, cwd=ROOT, capture_output=True)
    return log.read_text().split("\0")[:-1]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_sbatch_command_composes_with_the_recipe_and_validates(fake_srun, tmp_path):
    args = run_sbatch(fake_srun, tmp_path, "trainer.dapo.max_steps=2", RECIPE="qwen2.5-32b_h20")
    assert args[:2] == ["--mpi=pmix", "--ntasks-per-node=8"]
    env_seen = (tmp_path / "srun.args.env").read_text().split()
    assert env_seen == ["NCCL_ALGO=Tree", "CUDA_DEVICE_MAX_CONNECTIONS=1"]
    mounts = next(a for a in args if a.startswith("--container-mounts="))
    assert "/ckpt/qwen:/ckpt/qwen:ro" in mounts and f"{tmp_path}/results:/results" in mounts
    assert args[-2] == "-c"
    _, _, python_cmd = args[-1].partition("&&")
    argv = shlex.split(python_cmd)
    assert argv[:4] == ["python", "-u", "examples/train_gpt_dapo.py", "--config-name"]
    recipe = argv[4].split("/", 1)[1]
    cfg = cv.load_config(recipe, argv[5:])
    assert cv.check_config(cfg) == []
    assert cfg.trainer.num_nodes == 16 and cfg.trainer.dapo.max_steps == 2
    assert OmegaConf.to_container(cfg.model.data.data_prefix) == {"train": ["/data/train.parquet"],
                                                                  "validation": ["/eval/aime-2024.parquet"]}
    assert cfg.exp_manager.explicit_log_dir == "/results"


def test_sbatch_lets_the_user_drop_nccl_algo(fake_srun, tmp_path):
    run_sbatch(fake_srun, tmp_path, NCCL_ALGO="")
    assert (tmp_path / "srun.args.env").read_text().split()[0] == "NCCL_ALGO=unset"


def test_sbatch_refuses_to_run_without_its_inputs(fake_srun, tmp_path):
    env = dict(os.environ, PATH=f"{fake_srun}:{os.environ['PATH']}", SRUN_LOG=str(tmp_path / "log"))
    for key in ("CONTAINER", "CHECKPOINT", "TRAIN_DATA", "VAL_DATA", "RESULTS"):
        env.pop(key, None)
    out = subprocess.run(["bash", str(SBATCH)], env=env, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode != 0 and "set CONTAINER" in out.stderr


def test_cluster_docs_show_the_commands_and_name_existing_files():
    text = DOCS.read_text()
    assert "\n## Run on a cluster\n" in text
    text = text[text.index("\n## Run on a cluster\n"):]
    for cmd in ("docker build -f containers/Dockerfile", "sbatch --nodes=16", "containers/dapo.sbatch",
                "nemo-dapo plan", "srun --mpi=pmix", "--no-container-mount-home", "NCCL_ALGO=Tree",
                "CUDA_DEVICE_MAX_CONNECTIONS=1"):
        assert cmd in text, cmd
    for recipe in set(re.findall(r"\b((?:qwen2\.5-32b|moe-235b-a22b)_h(?:100|20))\b", text)):
        assert (ROOT / "conf" / "recipes" / f"{recipe}.yaml").is_file(), recipe
    for path in set(re.findall(r"`((?:containers|conf|examples|nemo_dapo)/[\w./-]+)`", text)):
        assert (ROOT / path).exists(), path


def test_dockerfile_version_check_accepts_the_stack_and_rejects_another(tmp_path):
    """Runs the image's own check (the RUN line that reads the installed versions) in this environment."""
    from importlib import metadata

    try:
        installed = metadata.version("nemo_aligner")
        metadata.version("nemo_toolkit"), metadata.version("megatron_core")
    except metadata.PackageNotFoundError:
        pytest.skip("needs the NeMo stack installed (scripts/install.sh full)")
    check = next(a for k, a in instructions(DOCKERFILE.read_text()) if k == "RUN" and "EXPECT_ALIGNER" in a)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    wrapper = bindir / "python"  # `python` in the RUN line = this interpreter (a symlink would lose the venv)
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}")
    ok = subprocess.run(["bash", "-c", check], env=dict(env, EXPECT_ALIGNER=installed), capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "registered: nemo_dapo.aligner.trainer:DAPOTrainer" in ok.stdout
    bad = subprocess.run(["bash", "-c", check], env=dict(env, EXPECT_ALIGNER="9.9.9"), capture_output=True, text=True)
    assert bad.returncode != 0 and "!= 9.9.9" in bad.stderr
