"""Context parallelism on several GPUs: CP2 log-probs, entropy and one update against CP1.

Two ranks (one per GPU, NCCL) walk two layouts of the same engine settings: DP2 (CP1, the
reference) and CP2. With Transformer Engine the model is the TE spec and CP runs through TE's own
attention (cp_comm_type 'p2p' and 'all_gather', dense and packed THD rows padded to multiples of
2*cp); without TE through the SDPA all-gather-KV attention (models/sdpa_cp.py). TE's fused
attention needs half precision, so the TE runs are bf16 and compared with a bf16 tolerance; the
SDPA runs are fp32 with TF32 off.

Needs >= 2 CUDA devices (skipped otherwise). As of this writing it has never run: the project's
device machine has one GPU.
"""

from __future__ import annotations

import dataclasses

import torch

from gpu_checks.child import CheckContext, NeedsCuda
from gpu_checks.common import make_batch, model_dir, vocab_of

# CPU/gloo measures ~1e-6 (tests/integration/engines/test_context_parallel.py)
FP32_TOLERANCE = 1e-4
BF16_MEAN_TOLERANCE = 2e-2  # bf16 kernels split differently at CP2: rounding, mean |diff|
WEIGHT_FP32_TOLERANCE = 1e-5


def _layout_values(hf_dir: str, cp: int, dtype: str, comm: str, rows: int, seq: int) -> dict:
    """Log-probs (dense, packed) and the weights after one SGD step, at DP2/CP1 or CP2."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from rlhf_megatron.engines import ActorEngine, EngineConfig, OptimizerSettings
    from rlhf_megatron.engines.actor import PolicyUpdateSettings
    from rlhf_megatron.engines.base import unwrap
    from rlhf_megatron.parallel import ParallelDims, destroy_layout, initialize_layout

    dims = ParallelDims(dist.get_world_size(), cp=cp)
    initialize_layout(dims, seed=3)
    config = EngineConfig(micro_batch_size=2, dtype=dtype, cp_comm_type=comm,
                          optimizer=OptimizerSettings(name="sgd", lr=0.1, clip_grad=0.0))
    engine = ActorEngine(config, hf_dir=hf_dir, dims=dims)
    batch = make_batch(rows, seq, vocab_of(hf_dir), seed=5)
    out = {"backend": str(getattr(unwrap(engine.chunks[0]), "attention_backend", "?"))}
    for packing in (False, True):
        engine.config = dataclasses.replace(engine.config, use_packing=packing)
        lp = engine.compute_logprobs(batch, with_entropy=True)
        out[f"logprobs{int(packing)}"] = lp["logprobs"]
        out[f"entropy{int(packing)}"] = lp["entropy"]
    share = batch.with_fields(old_logprobs=out["logprobs0"]).chunk(dims.dp)
    engine.config = dataclasses.replace(engine.config, use_packing=True)
    engine.update_policy(share[parallel_state.get_data_parallel_rank()], PolicyUpdateSettings())
    out["weights"] = {n: p.detach().float().cpu() for n, p in engine.named_parameters()}
    out["mask"] = batch.loss_mask
    destroy_layout()
    return out


def _cp_job(hf_dir: str, dtype: str, comms: tuple[str, ...], rows: int, seq: int) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    reference = _layout_values(hf_dir, 1, dtype, "p2p", rows, seq)
    result = {"backend": reference["backend"], "runs": {}}
    mask = reference["mask"].bool()
    for comm in comms:
        values = _layout_values(hf_dir, 2, dtype, comm, rows, seq)
        run = {"backend": values["backend"]}
        for name in ("logprobs0", "entropy0", "logprobs1", "entropy1"):
            diff = (values[name] - reference[name]).abs()[mask]
            run[f"{name}_max"], run[f"{name}_mean"] = diff.max().item(), diff.mean().item()
        run["weights_max"] = max((values["weights"][n] - reference["weights"][n]).abs().max().item()
                                 for n in values["weights"])
        result["runs"][comm] = run
    return result


def check_context_parallel(ctx: CheckContext) -> None:
    ctx.needs_cuda("context parallelism across GPUs")
    devices = torch.cuda.device_count()
    ctx.metric("cuda_devices", devices)
    if devices < 2:
        raise NeedsCuda(f"context parallelism needs >= 2 CUDA devices; this machine has {devices}")
    from rlhf_megatron.platform import transformer_engine_available
    from rlhf_megatron.testing.multirank import run_on_ranks

    te = transformer_engine_available()
    dtype = "bf16" if te else "fp32"
    comms = ("p2p", "all_gather") if te else ("all_gather",)
    hf_dir = model_dir(ctx.work_dir, "tiny" if ctx.small else "mid", device="cuda")
    rows, seq = (4, 61) if ctx.small else (4, 2047)  # not multiples of 2*cp: padding is exercised
    ctx.metric("model", hf_dir.name)
    ctx.metric("dtype", dtype)
    ctx.metric("batch", f"{rows} x {seq}")
    result = run_on_ranks(_cp_job, 2, (str(hf_dir), dtype, comms, rows, seq),
                          timeout_s=240)[0]
    ctx.metric("attention_backend", result["backend"], summary=True)
    for comm, run in result["runs"].items():
        for name, value in run.items():
            if name != "backend":
                ctx.metric(f"{comm}_{name}", value, summary=name.endswith("_max"))
        for name in ("logprobs0", "entropy0", "logprobs1", "entropy1"):
            if te:
                ok = run[f"{name}_mean"] <= BF16_MEAN_TOLERANCE
                ctx.require(f"{comm} {name}: mean |CP2 - CP1| <= {BF16_MEAN_TOLERANCE:g} (bf16)",
                            ok, run[f"{name}_mean"])
            else:
                ok = run[f"{name}_max"] <= FP32_TOLERANCE
                ctx.require(f"{comm} {name}: max |CP2 - CP1| <= {FP32_TOLERANCE:g} (fp32)",
                            ok, run[f"{name}_max"])
        if not te:
            ctx.require(f"{comm} weights after one step within {WEIGHT_FP32_TOLERANCE:g}",
                        run["weights_max"] <= WEIGHT_FP32_TOLERANCE, run["weights_max"])
