"""The checks of benchmarks/gpu_check.py, in the order they run (the defects first, so a run cut
short by its budget still answers them). Each is `module:function` taking a CheckContext; the
parent never imports them, so it stays light and never touches the GPU."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CheckSpec:
    name: str
    target: str
    """'module:function' inside this package."""
    cuda_only: bool
    full_timeout_s: float
    small_timeout_s: float
    doc: str

    def timeout_s(self, small: bool) -> float:
        return self.small_timeout_s if small else self.full_timeout_s


CHECKS = (
    CheckSpec("environment", "environment:check_environment", False, 60, 60,
              "versions, GPU, memory, TE/apex; bf16 matmul TFLOP/s and copy GB/s on CUDA"),
    CheckSpec("update", "training:check_update", False, 120, 90,
              "5 Adam updates (CUDA: bf16, distributed optimizer) with finite, falling grad "
              "norms; SGD builds without the distributed optimizer (defect A)"),
    CheckSpec("offload", "training:check_offload", False, 120, 90,
              "offload frees device memory: mem_get_info free rises >= 90% of the bytes "
              "(defect B; CPU: RSS); onload is bitwise"),
    CheckSpec("checkpoint_resume", "training:check_checkpoint_resume", False, 150, 120,
              "save, fresh engine, load, next update equals the continued one (defects C, D; "
              "CUDA: distributed optimizer, fully reshardable)"),
    CheckSpec("lora_update", "lora:check_lora_update", False, 120, 90,
              "LoRA rank 8 (CUDA: bf16 base, distributed optimizer over the adapters only): "
              "optimizer params = adapter params, base bit-unchanged, adapters off = the base"),
    CheckSpec("parity_fp32", "parity:check_parity_fp32", False, 120, 90,
              "fp32 actor log-probs and entropy vs HF transformers (TF32 off), +- packing"),
    CheckSpec("parity_bf16", "parity:check_parity_bf16", True, 120, 90,
              "bf16 actor log-probs vs HF fp32, against HF-bf16 vs HF-fp32"),
    CheckSpec("attention", "parity:check_attention", True, 60, 60,
              "SDPA core attention vs Megatron's unfused math (fp32, bf16), fused kernels "
              "used, time and peak memory of one long call"),
    CheckSpec("throughput_1b", "throughput:check_throughput", True, 240, 120,
              "update and log-prob tok/s, MFU and peak memory at ~1B vs HF transformers (SDPA)"),
    CheckSpec("cuda_ipc", "transfer:check_cuda_ipc", True, 90, 60,
              "CUDA IPC transport between two processes: bit-equal buckets, GB/s vs a copy"),
    CheckSpec("refit_hf", "transfer:check_refit_hf", False, 150, 120,
              "refit into an HF stand-in in another process: every weight bitwise equal, GB/s"),
    CheckSpec("context_parallel", "context_parallel:check_context_parallel", True, 240, 120,
              "CP2 vs CP1 on 2 GPUs (TE attention, p2p and all_gather, bf16; without TE the "
              "SDPA all-gather-KV path, fp32): log-probs/entropy dense and packed, one update; "
              "skipped below 2 GPUs"),
    CheckSpec("chunked_logits", "chunked_logits:check_chunked_logits", True, 180, 90,
              "one bf16 update on an 8k-token row, 152k vocabulary: peak memory and time, "
              "logits read out in 2048-token chunks vs the whole row's (issue 31)"),
)

__all__ = ["CHECKS", "CheckSpec"]
