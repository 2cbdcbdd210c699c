"""The adapters stored in a LoRA actor's checkpoint, located and merged (used by
checkpoint_tools/mcore_to_hf.py's --merge-lora and checkpoint_tools/lora_export.py).

The trainer's checkpoint of a LoRA run holds the frozen base weights and, beside each adapted
linear, its adapters (`decoder.layers.<i>.<linear>.lora.a.<part>` / `.lora.b.<part>`,
layer-stacked like the base); its metadata records the settings (`lora`: rank, alpha, ...).

Why a rename is enough: models/lora.py keeps one adapter per HF projection (q, k, v of the fused
linear_qkv; gate and up of a gated linear_fc1) and shards B by rows (column-parallel layers) or A
by columns (row-parallel) as the base weight is, and the checkpoint stores the global tensors.
The global B of part q is [q rows of group 0; of group 1; ...], which is the HF q_proj's row order
(head h belongs to group h // heads_per_group), k and v likewise; gate and up are the HF gate_proj
and up_proj rows. So each stored A and B is PEFT's lora_A and lora_B of the HF module the
architecture's mapping table names for that part, and W + (alpha / rank) B A is the merged HF
weight.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from rlhf_megatron.errors import CheckpointError
from rlhf_megatron.models.lora_names import ADAPTER_NAME, adapted_hf_weight


def is_lora_name(megatron_name: str) -> bool:
    return ".lora." in megatron_name


@dataclass(frozen=True)
class Adapter:
    """The adapter of one HF projection: `hf_weight` (e.g. model.layers.3.self_attn.q_proj.weight)
    and the stored A [r, in] and B [out, r] sources (mcore_to_hf.SourceTensor)."""

    hf_weight: str
    a: Any
    b: Any

    @property
    def hf_module(self) -> str:
        return self.hf_weight.removesuffix(".weight")


def find_adapters(sources: list[Any], table: Any) -> dict[str, Adapter]:
    """HF weight name -> its Adapter, for every adapter source among `sources` (the
    checkpoint's tensors, layers unstacked); empty when the checkpoint has none."""
    pairs: dict[tuple[str, str, str], dict[str, Any]] = {}
    for source in sources:
        match = ADAPTER_NAME.match(source.megatron_name)
        if match is None:
            if is_lora_name(source.megatron_name):
                raise CheckpointError(f"unexpected adapter tensor {source.megatron_name!r}")
            continue
        layer, linear, matrix, part = match.groups()
        pairs.setdefault((layer, linear, part), {})[matrix] = source
    adapters = {}
    for (layer, linear, part), matrices in sorted(pairs.items()):
        missing = sorted({"a", "b"} - set(matrices))
        if missing:
            raise CheckpointError(f"adapter {part!r} of decoder.layers.{layer}.{linear}.weight "
                                  f"has no lora.{missing[0]} tensor")
        try:
            hf_weight = adapted_hf_weight(table, layer, linear, part)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
        adapters[hf_weight] = Adapter(hf_weight, matrices["a"], matrices["b"])
    return adapters


def lora_scale(settings: dict[str, Any], adapters: dict[str, Adapter]) -> float:
    """alpha / rank, with the rank checked against the stored A's rows."""
    rank = int(settings["rank"])
    for adapter in adapters.values():
        if adapter.a.shape[-2] != rank or adapter.b.shape[-1] != rank:
            raise CheckpointError(f"adapter of {adapter.hf_weight} has rank "
                                  f"{adapter.a.shape[-2]}, the metadata says {rank}")
    return float(settings["alpha"]) / rank


def merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """W + scale * B A in fp32, cast once to `dtype`."""
    return (weight.float() + scale * (b.float() @ a.float())).to(dtype)


def target_modules_regex(adapters: dict[str, Adapter]) -> str:
    """PEFT's `target_modules` as a full-match regex of exactly the adapted modules: each
    module path with its layer index generalised. A list of leaf names (q_proj, ...) would also
    match modules the trainer leaves alone, such as MoE experts' gate_proj."""
    patterns = sorted({re.sub(r"\\\.layers\\\.\d+\\\.", r"\\.layers\\.\\d+\\.",
                              re.escape(adapter.hf_module)) for adapter in adapters.values()})
    return "^(?:" + "|".join(patterns) + ")$"
