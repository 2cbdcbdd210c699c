"""The trainable engine on the device: updates with the distributed optimizer and SGD (defect A),
offload that gives memory back (B), and save / fresh engine / load / resume (C, D).

On CUDA the engine runs bf16 with Megatron's distributed optimizer (the default there); on CPU
fp32 with the non-distributed one (the distributed optimizer needs CUDA), which these checks then
note rather than test.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from gpu_checks.child import CheckContext
from gpu_checks.common import (
    build_actor,
    free_memory,
    main_params,
    make_batch,
    model_dir,
    policy_step,
    sync,
    vocab_of,
)
from rlhf_megatron.engines.optimizer_state import megatron_optimizers


def _setup(ctx: CheckContext, shape_small: str = "tiny") -> tuple[Path, str, int, int, float]:
    """(hf_dir, dtype, rows, seq, lr) of this mode."""
    device = "cuda" if ctx.cuda else "cpu"
    hf_dir = model_dir(ctx.work_dir, shape_small if ctx.small else "mid", device=device)
    dtype = "bf16" if ctx.cuda else "fp32"
    rows, seq = (4, 32) if ctx.small else (8, 512)
    lr = 2e-4 if ctx.small else 1e-4
    ctx.metric("model", f"{hf_dir.name} ({dtype})")
    return hf_dir, dtype, rows, seq, lr


def _optimizer_kinds(engine: Any) -> list[str]:
    return [type(o).__name__ for o in megatron_optimizers(engine.optimizer)]


def _require_distributed(ctx: CheckContext, engine: Any, what: str) -> None:
    kinds = _optimizer_kinds(engine)
    ctx.metric(f"{what}_optimizer", kinds)
    if ctx.cuda:
        ctx.require(f"{what}: distributed optimizer in use",
                    kinds and all(k == "DistributedOptimizer" for k in kinds), kinds)
    else:
        ctx.note(f"{what}: the distributed optimizer needs cuda (ran {kinds})")


def check_update(ctx: CheckContext) -> None:
    """Five PPO updates on one batch with fixed old log-probs and +1 advantages: as the ratio
    passes the clip the gradient of those tokens vanishes, so loss and grad norm fall."""
    from rlhf_megatron.engines import PolicyUpdateSettings

    hf_dir, dtype, rows, seq, lr = _setup(ctx)
    batch = make_batch(rows, seq, vocab_of(hf_dir), seed=1, advantages="positive")
    with ctx.part("adam updates"):
        engine = build_actor(hf_dir, dtype=dtype, micro_batch_size=rows // 2, lr=lr)
        _require_distributed(ctx, engine, "adam")
        old = engine.compute_logprobs(batch)["logprobs"]
        norms, losses = [], []
        for _ in range(5):
            metrics = engine.update_policy(batch.with_fields(old_logprobs=old),
                                           PolicyUpdateSettings())
            norms.append(metrics["grad_norm"])
            losses.append(metrics["pg_loss"])
        ctx.metric("grad_norms", [round(n, 5) for n in norms], summary=True)
        ctx.metric("pg_losses", [round(x, 5) for x in losses])
        ctx.require("grad norms finite, the first > 0",
                    all(math.isfinite(n) for n in norms) and norms[0] > 0, norms)
        ctx.require("grad norm falls (last < first)", norms[-1] < norms[0], norms)
        ctx.require("loss falls (last < first)", losses[-1] < losses[0], losses)
        engine = None
        free_memory()
    _check_sgd(ctx, hf_dir, dtype, batch, lr)


def _check_sgd(ctx: CheckContext, hf_dir: Path, dtype: str, batch: Any, lr: float) -> None:
    """Defect A: SGD with the default settings (use_distributed_optimizer=True) must either build
    without the distributed optimizer or be refused with a one-line ConfigError; either way an
    SGD engine without the distributed optimizer must build and update."""
    from rlhf_megatron.errors import ConfigError

    engine = None
    with ctx.part("sgd with default settings builds or is refused cleanly"):
        try:
            engine = build_actor(hf_dir, dtype=dtype, micro_batch_size=2, name="sgd", lr=lr)
        except ConfigError as exc:
            ctx.metric("sgd_default", f"refused: {exc}", summary=True)
            ctx.require("sgd refusal is one line", "\n" not in str(exc).strip(), exc)
        else:
            kinds = _optimizer_kinds(engine)
            ctx.metric("sgd_default", f"built: {kinds}", summary=True)
            ctx.require("sgd default: not the distributed optimizer",
                        "DistributedOptimizer" not in kinds, kinds)
            if "DistributedOptimizer" in kinds:
                engine = None
    with ctx.part("sgd without the distributed optimizer updates"):
        if engine is None:  # refused above: ask for the plain optimizer explicitly
            engine = build_actor(hf_dir, dtype=dtype, micro_batch_size=2, name="sgd", lr=lr,
                                 use_distributed_optimizer=False)
        grad_norm = policy_step(engine, batch)["grad_norm"]
        ctx.metric("sgd_grad_norm", grad_norm)
        ctx.require("sgd update finite", math.isfinite(grad_norm) and grad_norm > 0, grad_norm)


def _state_copies(engine: Any) -> list[torch.Tensor]:
    """CPU copies of params, fp32 main params and optimizer state, in a fixed order."""
    out = [p.detach().cpu().clone() for _, p in engine.named_parameters()]
    out += [p.cpu() for p in main_params(engine)]
    for optimizer in megatron_optimizers(engine.optimizer):
        for state in optimizer.optimizer.state.values():
            out += [v.detach().cpu().clone() for _, v in sorted(state.items())
                    if isinstance(v, torch.Tensor)]
    return out


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def check_offload(ctx: CheckContext) -> None:
    """Defect B: after engine.offload() (nothing else called) the device's free memory rises by
    >= 90% of the bytes offloaded (CPU: RSS drops by >= 50%); onload restores every byte."""
    from rlhf_megatron.platform import current_platform

    resident_bytes = current_platform().resident_bytes

    hf_dir, dtype, rows, seq, lr = _setup(ctx, "tiny_wide")
    batch = make_batch(rows, seq, vocab_of(hf_dir), seed=2)
    engine = build_actor(hf_dir, dtype=dtype, micro_batch_size=rows // 2, lr=lr)
    policy_step(engine, batch)  # the optimizer now holds state
    before = _state_copies(engine)
    ctx.metric("state_tensors", len(before))
    sync()
    # What the worker reports (allocated device memory on GPU, trimmed RSS on CPU), read first.
    resident_before = resident_bytes()
    if ctx.cuda:
        free_before = torch.cuda.mem_get_info()[0]
        allocated_before = torch.cuda.memory_allocated()
        freed = engine.offload()
        free_after = torch.cuda.mem_get_info()[0]
        gained = free_after - free_before
        ctx.metric("allocated_drop_gib", (allocated_before - torch.cuda.memory_allocated()) / 2**30)
        ctx.metric("reserved_after_gib", torch.cuda.memory_reserved() / 2**30)
        criterion = "device free memory rises >= 90% of the bytes offloaded"
        ratio_needed = 0.9
    else:
        rss_before = _rss()
        freed = engine.offload()
        gained = rss_before - _rss()
        criterion = "RSS drops >= 50% of the bytes offloaded"
        ratio_needed = 0.5
    ctx.metric("offloaded_gib", freed / 2**30, summary=True)
    ctx.metric("worker_resident_drop_gib", (resident_before - resident_bytes()) / 2**30)
    ctx.metric("freed_gib", gained / 2**30, summary=True)
    ctx.metric("freed_ratio", gained / freed if freed else 0.0, summary=True)
    ctx.require("offload moved bytes", freed > 0, freed)
    ctx.require(criterion, gained >= ratio_needed * freed,
                f"{gained / 2**30:.3f} GiB of {freed / 2**30:.3f} GiB")
    engine.onload()
    after = _state_copies(engine)
    ctx.require("onload restores params and optimizer state bitwise",
                len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(before, after)))
    grad_norm = policy_step(engine, batch)["grad_norm"]
    ctx.require("an update after onload is finite", math.isfinite(grad_norm), grad_norm)


def _sharding_type(ckpt: Path) -> list[str]:
    """The distributed optimizer's param_state_sharding_type values in a checkpoint's common
    state (empty for the non-distributed optimizer)."""
    from megatron.core import dist_checkpointing

    found: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                if key == "param_state_sharding_type":
                    found.append(str(item))
                walk(item)
        elif isinstance(value, list | tuple):
            for item in value:
                walk(item)

    walk(dist_checkpointing.load_common_state_dict(str(ckpt)))
    return found


def check_checkpoint_resume(ctx: CheckContext) -> None:
    """Defects C, D: update, save, update (the continued run); build a FRESH engine, load, update
    (the resumed run). The resumed update must equal the continued one."""
    hf_dir, dtype, rows, seq, lr = _setup(ctx)
    vocab = vocab_of(hf_dir)
    first, second = (make_batch(rows, seq, vocab, seed=s) for s in (3, 4))
    ckpt = ctx.work_dir / "checkpoint_resume"
    engine = build_actor(hf_dir, dtype=dtype, micro_batch_size=rows // 2, lr=lr)
    _require_distributed(ctx, engine, "checkpoint")
    policy_step(engine, first)
    with ctx.part("save"):
        engine.save_checkpoint(ckpt, step=1)
    saved = main_params(engine)
    policy_step(engine, second)
    continued = main_params(engine)
    engine = None
    free_memory()
    if ctx.cuda:
        with ctx.part("fully reshardable format"):
            kinds = _sharding_type(ckpt)
            ctx.metric("optimizer_sharding_type", kinds, summary=True)
            ctx.require("distributed optimizer saved as fully_reshardable",
                        kinds and all(k == "fully_reshardable" for k in kinds), kinds)
    with ctx.part("fresh engine loads and resumes"):
        fresh = build_actor(hf_dir, dtype=dtype, micro_batch_size=rows // 2, lr=lr)
        step = fresh.load_checkpoint(ckpt)
        loaded = main_params(fresh)
        ctx.require("load returns the saved step", step == 1, step)
        ctx.require("loaded main params equal the saved ones bitwise",
                    len(loaded) == len(saved) and all(torch.equal(a, b)
                                                      for a, b in zip(saved, loaded)))
        policy_step(fresh, second)
        resumed = main_params(fresh)
        step_size = max((c - s).abs().max().item() for c, s in zip(continued, saved))
        diff = max((c - r).abs().max().item() for c, r in zip(continued, resumed))
        bitwise = all(torch.equal(c, r) for c, r in zip(continued, resumed))
        ctx.metric("update_max", step_size)
        ctx.metric("resumed_vs_continued_max", diff, summary=True)
        ctx.metric("bitwise", bitwise, summary=True)
        ctx.require("the update moved the weights", step_size > 0, step_size)
        # Bitwise is expected (same kernels, same state); allow 0.1% of the step for kernels
        # that are not run-to-run deterministic on a GPU.
        ctx.require("resumed update equals the continued one (<= 1e-3 of the step)",
                    diff <= 1e-3 * step_size, f"{diff:.3g} vs step {step_size:.3g}")
