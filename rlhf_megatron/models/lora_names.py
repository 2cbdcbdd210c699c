"""Where a LoRA adapter of the Megatron model lands on the HF model: shared by the refit
(refit/export.py, adapter mode) and the checkpoint exports (checkpoint_tools/lora_adapters.py).

An adapter's Megatron name is `decoder.layers.<i>.<linear>.lora.<a|b>.<part>` (models/lora.py);
its part is one HF projection of the fused linear (q, k, v of linear_qkv; gate, up of a gated
linear_fc1), or the linear's only one."""

from __future__ import annotations

import re
from typing import Any

ADAPTER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.+)\.lora\.([ab])\.(\w+)$")
PEFT_PREFIX = "base_model.model."


def peft_adapter_name(hf_weight: str, matrix: str) -> str:
    """PEFT's name of one adapter matrix ('A' or 'B') of the HF weight `hf_weight`
    (base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight)."""
    return f"{PEFT_PREFIX}{hf_weight.removesuffix('.weight')}.lora_{matrix}.weight"


def is_adapter_tensor(name: str) -> bool:
    return name.startswith(PEFT_PREFIX) and ".lora_" in name


def adapted_hf_weight(table: Any, layer: str, linear: str, part: str) -> str:
    """The HF weight (model.layers.<i>.self_attn.q_proj.weight, ...) that the adapter `part` of
    `decoder.layers.<layer>.<linear>` adapts, by the architecture's mapping `table`. Raises
    ValueError when the table has no such weight."""
    base = f"decoder.layers.{layer}.{linear}.weight"
    resolved = table.resolve(base)
    if resolved is None:
        raise ValueError(f"adapted weight {base!r} has no mapping in the architecture's table")
    names = resolved.hf_names
    if part in names:
        return names[part]
    if len(names) == 1:
        return next(iter(names.values()))
    raise ValueError(f"adapter part {part!r} of {base} is none of {sorted(names)}")
