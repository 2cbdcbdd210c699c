"""LoRA on the actor (issue 29) on the device: the frozen base gets no optimizer state (on CUDA:
bf16 weights, Megatron's distributed optimizer over the adapters alone, no fp32 main copy of the
base), updates move the adapters only, and the adapters-off reference stays the base model.

On CPU (--small) the same runs in fp32 with the non-distributed optimizer; the distributed
optimizer is then noted, not tested (it needs CUDA).
"""

from __future__ import annotations

import math

import torch

from gpu_checks.child import CheckContext
from gpu_checks.common import (
    build_actor,
    main_params,
    make_batch,
    model_dir,
    policy_step,
    vocab_of,
)
from rlhf_megatron.engines.optimizer_state import megatron_optimizers
from rlhf_megatron.models.lora_settings import LoraSettings

RANK, ALPHA = 8, 16.0


def check_lora_update(ctx: CheckContext) -> None:
    """Three PPO updates of a rank-8 LoRA actor on one batch with +1 advantages."""
    device = "cuda" if ctx.cuda else "cpu"
    hf_dir = model_dir(ctx.work_dir, "tiny" if ctx.small else "mid", device=device)
    dtype = "bf16" if ctx.cuda else "fp32"
    rows, seq = (4, 32) if ctx.small else (8, 512)
    ctx.metric("model", f"{hf_dir.name} ({dtype}), LoRA rank {RANK}")
    batch = make_batch(rows, seq, vocab_of(hf_dir), seed=2, advantages="positive")
    with ctx.part("lora updates"):
        engine = build_actor(hf_dir, dtype=dtype, micro_batch_size=rows // 2, lr=1e-3,
                             lora=LoraSettings(rank=RANK, alpha=ALPHA))
        kinds = [type(o).__name__ for o in megatron_optimizers(engine.optimizer)]
        ctx.metric("optimizer", kinds)
        if ctx.cuda:
            ctx.require("distributed optimizer in use", kinds and all(
                k == "DistributedOptimizer" for k in kinds), kinds)
        else:
            ctx.note(f"the distributed optimizer needs cuda (ran {kinds})")
        adapters = engine.named_adapters()
        adapter_numel = sum(t.numel() for _, t in adapters)
        base = [(n, t.detach().clone()) for n, t in engine.named_weights(merged=False)]
        stepped = sum(p.numel() for p in main_params(engine))
        ctx.metric("adapter_params", adapter_numel, summary=True)
        ctx.metric("optimizer_params", stepped, summary=True)
        ctx.metric("base_params", sum(t.numel() for _, t in base))
        # The optimizer steps the adapters and nothing else: no main copy, no state of the base.
        ctx.require("optimizer params = adapter params", stepped == adapter_numel,
                    (stepped, adapter_numel))
        ctx.require("base weights keep the engine's dtype",
                    all(t.dtype == (torch.bfloat16 if ctx.cuda else torch.float32)
                        for _, t in base), {t.dtype for _, t in base})
        before = engine.compute_logprobs(batch)["logprobs"]
        norms = [policy_step(engine, batch)["grad_norm"] for _ in range(3)]
        ctx.metric("grad_norms", [round(n, 5) for n in norms], summary=True)
        ctx.require("grad norms finite, the first > 0",
                    all(math.isfinite(n) for n in norms) and norms[0] > 0, norms)
        after = engine.compute_logprobs(batch)["logprobs"]
        moved = (after - before).abs().max().item()
        ctx.metric("policy_moved_max", moved, summary=True)
        ctx.require("the adapters moved the policy", moved > 1e-3, moved)
        now = dict(engine.named_weights(merged=False))
        unchanged = all(torch.equal(t, now[n]) for n, t in base)
        ctx.require("base weights bit-unchanged", unchanged)
        reference = engine.adapters_off().compute_logprobs(batch)["logprobs"]
        ctx.require("adapters off = the base before any update, bit for bit",
                    torch.equal(reference, before), (reference - before).abs().max().item())
