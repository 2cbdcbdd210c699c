"""Megatron's column/row-parallel linear layers for the local spec, with a plain path at TP=1.

At tensor-parallel size 1 every collective in Megatron-Core's ColumnParallelLinear /
RowParallelLinear is an identity, but each call still goes through two identity autograd
functions (copy-to / reduce-from the TP region) and Megatron's own linear autograd function,
with their argument plumbing: measured on CPU, about 60 us of Python per call against ~5 us for
`torch.nn.functional.linear`, i.e. ~1 ms per forward of a 4-layer model, which is several
percent of a small model's step on 2 cores and matters on a GPU too when kernels are short.

These subclasses compute `F.linear` directly when the TP group has one rank and none of
Megatron's extra machinery is switched on (sequence parallelism, expert communication, grad
accumulation fusion, deferred embedding wgrad, CPU activation offloading, a caller-supplied
weight or a runtime output gather). Same math (x W^T [+ b]); autograd then produces the same
weight gradients into `param.grad`, which Megatron DDP's hooks move into `main_grad` as before.
Anything else, and every TP > 1 layout, runs Megatron's own forward. Parameters, names,
initialisation and sharded state dicts are Megatron's.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from torch import Tensor


def plain_path_possible(layer: Any) -> bool:
    """TP size 1 and no Megatron feature that does more than x W^T + b."""
    config = layer.config
    return (
        layer.tp_group.size() == 1
        and not layer.sequence_parallel
        and not layer.explicit_expert_comm
        and not layer.gradient_accumulation_fusion
        and not config.defer_embedding_wgrad_compute
        and config._cpu_offloading_context is None
    )


class LeanColumnParallelLinear(ColumnParallelLinear):
    """ColumnParallelLinear with the plain path at TP=1 (see the module docstring)."""

    def forward(
        self, input_: Tensor, weight: Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """[s, b, in] -> ([s, b, out / tp], bias when skip_bias_add else None)."""
        if weight is not None or runtime_gather_output or not plain_path_possible(self):
            return super().forward(input_, weight, runtime_gather_output)
        if self.skip_bias_add:
            return F.linear(input_, self.weight), self.bias
        return F.linear(input_, self.weight, self.bias), None


class LeanRowParallelLinear(RowParallelLinear):
    """RowParallelLinear with the plain path at TP=1 (see the module docstring)."""

    def forward(self, input_: Tensor) -> tuple[Tensor, Tensor | None]:
        """[s, b, in / tp] -> ([s, b, out], bias when skip_bias_add else None)."""
        if not plain_path_possible(self):
            return super().forward(input_)
        if self.skip_bias_add:
            return F.linear(input_, self.weight), self.bias
        return F.linear(input_, self.weight, self.bias), None
