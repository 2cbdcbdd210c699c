"""The layer spec swap behind attention_backend "sdpa" (models/builder.py): Megatron's local
spec with our core attention, SwiGLU MLP and plain-path linears, for dense and MoE layers."""

from __future__ import annotations

from typing import Any


def use_lean_local_modules(spec: Any) -> None:
    """Swap the local spec's core attention, MLP and linear layers for ours (same parameters):
    SDPA attention, the SwiGLU MLP, and linears with a plain path at TP=1."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP

    from rlhf_megatron.models.lean_linear import LeanColumnParallelLinear, LeanRowParallelLinear
    from rlhf_megatron.models.sdpa_attention import SDPAttention
    from rlhf_megatron.models.swiglu_mlp import SwiGLUMLP

    lean = {ColumnParallelLinear: LeanColumnParallelLinear, RowParallelLinear: LeanRowParallelLinear}
    # The spec is built fresh by each call, so changing it here affects nobody else.
    layer = spec.submodules
    attention = layer.self_attention.submodules
    attention.core_attention = SDPAttention
    if hasattr(attention, "linear_qkv"):  # multi-latent attention keeps Megatron's projections
        attention.linear_qkv = lean.get(attention.linear_qkv, attention.linear_qkv)
    attention.linear_proj = lean.get(attention.linear_proj, attention.linear_proj)
    if layer.mlp.module is MLP:  # dense models (an MoE layer keeps its own modules)
        layer.mlp.module = SwiGLUMLP
        mlp = layer.mlp.submodules
        mlp.linear_fc1 = lean.get(mlp.linear_fc1, mlp.linear_fc1)
        mlp.linear_fc2 = lean.get(mlp.linear_fc2, mlp.linear_fc2)
