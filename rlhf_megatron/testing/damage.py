"""Planted conversion errors for the `verify` tests: damages applied to an HF checkpoint's
tensors, and a damaged copy of a checkpoint folder.

A damage is `fn(weights)` that edits the dict of HF-named tensors in place. `conversion_damages`
gives the four errors of issue 25 part 3 (a scaled k_proj, two swapped query heads, gate and up
exchanged, a scaled norm in the last layer), which a correct `verify` must each fail.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch

Damage = Callable[[dict[str, torch.Tensor]], None]


def scale(name: str, factor: float) -> Damage:
    """Multiply one tensor by `factor`, computed in fp32 and stored in the tensor's own dtype."""
    def damage(weights: dict[str, torch.Tensor]) -> None:
        weights[name] = (weights[name].float() * factor).to(weights[name].dtype)
    return damage


def swap_query_heads(layer: int, head_dim: int) -> Damage:
    """Exchange the first two query heads (rows of q_proj) of one layer."""
    def damage(weights: dict[str, torch.Tensor]) -> None:
        q = weights[f"model.layers.{layer}.self_attn.q_proj.weight"]
        first, second = q[:head_dim].clone(), q[head_dim:2 * head_dim].clone()
        q[:head_dim], q[head_dim:2 * head_dim] = second, first
    return damage


def exchange_gate_up(layer: int) -> Damage:
    """Swap one layer's gate_proj and up_proj (a fused gate/up mapping read the wrong way)."""
    def damage(weights: dict[str, torch.Tensor]) -> None:
        gate, up = f"model.layers.{layer}.mlp.gate_proj.weight", f"model.layers.{layer}.mlp.up_proj.weight"
        weights[gate], weights[up] = weights[up], weights[gate]
    return damage


def conversion_damages(*, k_layer: int, mid_layer: int, layers: int,
                       head_dim: int) -> dict[str, Damage]:
    """The four planted errors of issue 25 part 3, by name."""
    return {
        "k_proj-x1.01": scale(f"model.layers.{k_layer}.self_attn.k_proj.weight", 1.01),
        "two-q-heads-swapped": swap_query_heads(mid_layer, head_dim),
        "gate-up-exchanged": exchange_gate_up(mid_layer),
        "last-layer-norm-x1.01": scale(
            f"model.layers.{layers - 1}.post_attention_layernorm.weight", 1.01),
    }


def damaged_copy(hf_dir: Path, out: Path, damage: Damage, *,
                 changed: tuple[int, ...] = (1, 2), dtype: torch.dtype | None = None) -> Path:
    """Copy `hf_dir` (one model.safetensors) to `out` with `damage` applied. Asserts that the
    number of tensors it changed is in `changed` and, with `dtype`, that they kept that dtype."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(hf_dir, out)
    weights = load_file(str(out / "model.safetensors"))
    before = {name: t.clone() for name, t in weights.items()}
    damage(weights)
    names = [name for name in weights if not torch.equal(weights[name], before[name])]
    assert len(names) in changed, names
    assert dtype is None or all(weights[name].dtype == dtype for name in names), names
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
