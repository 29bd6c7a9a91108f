"""nemo_dapo: DAPO for NeMo-Aligner / megatron-core, with a CPU path that runs the same algorithm small."""
from setuptools import find_packages, setup

# The light core needs torch only; the CPU default job adds a few pure-Python packages.
# The NeMo stack (nemo-toolkit, nemo-aligner, megatron-core, TensorRT-LLM, NVIDIA apex, Transformer Engine) comes
# from the NeMo container at scale. NVIDIA apex is not on PyPI: the PyPI package named `apex` is an unrelated
# project and must never be listed here.
LOCAL = [
    "numpy",
    "transformers>=4.45",
    "tokenizers>=0.19",
    "safetensors",
    "omegaconf>=2.3",
    "hydra-core>=1.3",
    "tensorboard",
    "matplotlib",
    "pyarrow",
]

setup(
    name="nemo_dapo",
    version="0.1.0",
    description="DAPO (Decoupled Clip and Dynamic sAmpling Policy Optimization) as a NeMo-Aligner algorithm plugin",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["nemo_dapo", "nemo_dapo.*"]),
    package_data={"nemo_dapo": ["conf/*.yaml", "conf/algorithm/*.yaml", "conf/recipes/*.yaml", "engines/*.json"]},
    include_package_data=True,
    install_requires=["torch>=2.3"] + LOCAL,
    extras_require={
        "core": [],
        "megatron": ["megatron-core>=0.10.0"],
        # Outside the container: `bash scripts/install.sh VENV full` installs this stack for CPU tests.
        "nemo": ["megatron-core==0.10.0", "nemo-toolkit==2.1.0", "nemo-aligner==0.7.0"],
        "verify": ["math-verify>=0.7"],
        "test": ["pytest>=8", "hypothesis>=6.100"],
    },
    entry_points={
        "console_scripts": ["nemo-dapo=nemo_dapo.cli:main"],
        "nemo_aligner.algorithms": ["dapo=nemo_dapo.cluster.registry:DAPO_ALGORITHM"],
    },
)
