"""Forward-only logits through Megatron's pipeline schedule (parity checks, `checkpoint_tools
verify`). Training and log-prob computation live in `engines/`; this is the minimal read-out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def forward_logits(
    chunks: Sequence[Any], tokens: torch.Tensor, *, vocab_size: int, micro_batch_size: int = 1
) -> torch.Tensor | None:
    """Full-vocabulary logits of `tokens` at the current layout, on the last pipeline stage.

    tokens: (batch, seq) int64, the same on every rank of a TP/PP group.
    Returns (batch, seq, vocab_size) float logits, gathered over TP and with vocabulary padding
    removed, on the last pipeline stage; None on the other stages.
    """
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batch, seq = tokens.shape
    micro_batches = list(tokens.split(micro_batch_size))
    seen: list[torch.Tensor] = []

    def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
        micro = next(data_iterator)
        positions = torch.arange(seq).expand(micro.shape[0], -1)
        output = model(micro, positions, None)

        def collect(logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
            full = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
            seen.append(full.detach()[..., :vocab_size])
            return full.new_zeros(()), {}

        return output, collect

    # The interleaved (VPP) schedule wants one iterator per model chunk.
    data: Any = iter(micro_batches)
    if len(chunks) > 1:
        data = [iter(micro_batches) for _ in chunks]
    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=data,
            model=list(chunks),
            num_microbatches=len(micro_batches),
            seq_length=seq,
            micro_batch_size=micro_batch_size,
            forward_only=True,
        )
    return torch.cat(seen) if seen else None
