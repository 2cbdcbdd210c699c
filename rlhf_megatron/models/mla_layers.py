"""Multi-latent attention (DeepSeek-V3) on Megatron-Core 0.16 without sequence parallelism at TP > 1.

Megatron's MLA with the local spec computes the kv down-projection column-parallel, all-gathers it
and splits it into the latent (which goes on through the kv norm and the column-parallel up
projection) and the one RoPE key that every head shares. The backward of that all-gather keeps each
rank's own columns of the gradient, which is right for the latent (its consumer all-reduces, so
every rank holds the whole gradient) but not for the RoPE key: each rank's gradient of it comes from
that rank's heads only. Without sequence parallelism nothing sums them, and every weight upstream
of the attention gets a wrong gradient at TP > 1 (the forward is exact; found by
tests/integration/models/test_moe_parity.py: the embedding gradient 0.011 off TP1 at TP2).

`MlaKvDownProjection` is the same column-parallel layer with the same parameter; it does the
all-gather itself (so Megatron's is skipped: the output already has the full width) with a
backward that first sums the RoPE key's slice of the gradient over the TP group.

A second TP > 1 defect, of the same kind: `finalize_model_grads` sums over TP the gradient of every
parameter whose name holds "q_layernorm" when `qk_layernorm` is set, which is right for per-head
q/k norms (each rank's heads) and doubles MLA's q latent norm, whose gradient every rank already
holds whole (measured: exactly 2.0x TP1's at TP2). Those parameters are marked to be averaged over
TP instead (`average_gradients_across_tp_domain`, which Megatron checks first): the mean of equal
gradients is the gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import ColumnParallelLinear


class _GatherSummingRopeGrad(torch.autograd.Function):
    """[..., n / tp] -> [..., n] all-gathered over `group`; backward: the columns from `latent`
    on (the shared RoPE key) all-reduced, then this rank's columns."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, latent: int, group: Any) -> torch.Tensor:
        ctx.latent, ctx.group = latent, group
        ctx.rank, ctx.width = dist.get_rank(group), local.shape[-1]
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        rope = grad[..., ctx.latent:].contiguous()
        dist.all_reduce(rope, group=ctx.group)
        full = torch.cat([grad[..., :ctx.latent], rope], dim=-1)
        start = ctx.rank * ctx.width
        return full[..., start:start + ctx.width].contiguous(), None, None


class MlaKvDownProjection(ColumnParallelLinear):
    """Megatron's column-parallel kv down-projection whose output is gathered here, with the RoPE
    key's gradient summed over TP (module docstring). `latent` is kv_lora_rank."""

    latent: int = 0

    def forward(self, input_: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        output, bias = super().forward(input_, *args, **kwargs)
        if self.tp_group.size() > 1:
            output = _GatherSummingRopeGrad.apply(output, self.latent, self.tp_group)
        return output, bias


def fix_mla_tp_gradients(model: Any) -> int:
    """For every MLA layer of `model` at TP > 1 without sequence parallelism: swap its kv
    down-projection (Megatron's column-parallel one) for `MlaKvDownProjection`, and mark its q
    latent norm's parameters to be averaged over TP, not summed. Returns the layers fixed."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    fixed = 0
    for module in model.modules():
        if not isinstance(module, MLASelfAttention) or module.config.sequence_parallel:
            continue
        projection = module.linear_kv_down_proj
        if type(projection) is not ColumnParallelLinear or projection.tp_group.size() == 1:
            continue
        projection.__class__ = MlaKvDownProjection
        projection.latent = module.config.kv_lora_rank
        for param in getattr(module, "q_layernorm", torch.nn.Identity()).parameters():
            param.average_gradients_across_tp_domain = True
        fixed += 1
    return fixed
