"""The chunked logits read-out on a GPU (issue 31): peak memory and time of one bf16 policy
update on one long row with a 152k vocabulary, chunked (`logits_chunk_tokens` 2048, the default)
against the whole row's logits (0), on one rank. The model is 2 layers of width 256, so the
output layer and its logits are most of the memory, as for long rows of real models.

Full mode: an 8192-token row (its bf16 logits alone are 2.3 GiB, their fp32 temporaries 4.6
GiB each); --small: 2048 tokens (one chunk: both paths are the same code there, so only the
figures are recorded).
"""

from __future__ import annotations

import torch

from gpu_checks.child import CheckContext
from gpu_checks.common import free_memory, init_single_rank, median_seconds, model_dir, sync

GIB = 1024**3
CHUNK = 2048
TIME_RATIO_LIMIT = 1.10  # the target where both paths fit


def _update_figures(hf_dir, tokens: int, chunk: int, repeats: int) -> tuple[float, float]:
    """(median seconds, peak allocated GiB) of one update at this chunk size."""
    from rlhf_megatron.data.batch import TokenBatch
    from rlhf_megatron.engines import (
        ActorEngine,
        EngineConfig,
        OptimizerSettings,
        PolicyUpdateSettings,
    )

    dims = init_single_rank()
    config = EngineConfig(micro_batch_size=1, dtype="bf16", logits_chunk_tokens=chunk,
                          optimizer=OptimizerSettings(name="sgd", lr=1e-6))
    engine = ActorEngine(config, hf_dir=hf_dir, dims=dims)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, engine.vocab_size, (1, tokens), generator=g)
    mask = torch.ones_like(ids)
    mask[:, :256] = 0
    batch = TokenBatch(ids, torch.ones_like(ids), mask, {
        "old_logprobs": -torch.rand(ids.shape, generator=g) * 12 * mask,
        "advantages": torch.randn(ids.shape, generator=g) * mask})
    settings = PolicyUpdateSettings(entropy_coeff=0.01)
    engine.update_policy(batch, settings)  # warm-up (allocator, kernels)
    sync()
    torch.cuda.reset_peak_memory_stats()
    seconds = median_seconds(lambda: engine.update_policy(batch, settings), repeats, warmup=0)
    peak = torch.cuda.max_memory_allocated() / GIB
    engine = None
    free_memory()
    return seconds, peak


def check_chunked_logits(ctx: CheckContext) -> None:
    ctx.needs_cuda("peak GPU memory of the chunked read-out")
    tokens = 2048 if ctx.small else 8192
    hf_dir = model_dir(ctx.work_dir, "vocab152k", dtype=torch.bfloat16, device="cuda")
    ctx.metric("row_tokens", tokens)
    figures = {}
    for label, chunk in (("unchunked", 0), ("chunked", CHUNK)):
        seconds, peak = _update_figures(hf_dir, tokens, chunk, repeats=3)
        figures[label] = (seconds, peak)
        ctx.metric(f"{label}_update_s", seconds, summary=True)
        ctx.metric(f"{label}_peak_gib", peak, summary=True)
    ratio = figures["chunked"][0] / figures["unchunked"][0]
    ctx.metric("time_ratio", ratio, summary=True)
    if tokens > CHUNK:
        ctx.require("chunked peak memory below unchunked",
                    figures["chunked"][1] < figures["unchunked"][1], figures)
        ctx.require(f"chunked time <= {TIME_RATIO_LIMIT}x unchunked", ratio <= TIME_RATIO_LIMIT,
                    f"{ratio:.2f}")
