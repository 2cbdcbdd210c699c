"""Package import, platform choice and the `rlhf-megatron version` command."""

import subprocess
import sys

import pytest
import torch

import rlhf_megatron
from rlhf_megatron.platform import Platform, current_platform
from rlhf_megatron.platform.device import current_platform as detect


def test_version_is_exposed_without_heavy_imports():
    code = (
        "import sys, rlhf_megatron; print(rlhf_megatron.__version__); "
        "print(any(m.split('.')[0] in ('megatron', 'vllm', 'ray') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [rlhf_megatron.__version__, "False"]


def test_this_machine_is_cpu_with_gloo():
    platform = current_platform()
    assert platform == Platform("cpu", "gloo")
    assert platform.device() == torch.device("cpu")
    assert not platform.supports_distributed_optimizer
    assert not platform.supports_context_parallel


def test_cuda_platform_maps_local_rank_to_its_gpu():
    platform = Platform("cuda", "nccl")
    assert platform.device(3) == torch.device("cuda", 3)
    assert platform.supports_distributed_optimizer


def test_forcing_cuda_without_a_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("RLHF_MEGATRON_DEVICE", "cuda")
    detect.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="torch sees no CUDA device"):
            detect()
        monkeypatch.setenv("RLHF_MEGATRON_DEVICE", "tpu")
        detect.cache_clear()
        with pytest.raises(ValueError, match="expected 'cpu' or 'cuda'"):
            detect()
    finally:
        monkeypatch.delenv("RLHF_MEGATRON_DEVICE")
        detect.cache_clear()


def test_version_command_prints_the_stack():
    out = subprocess.run(
        [sys.executable, "-m", "rlhf_megatron.cli", "version"],
        capture_output=True, text=True, check=True,
    )
    assert out.stdout.startswith(f"rlhf_megatron {rlhf_megatron.__version__}")
    assert "megatron-core" in out.stdout and "device         cpu (gloo)" in out.stdout
