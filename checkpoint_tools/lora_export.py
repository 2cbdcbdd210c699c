"""`lora-to-peft` (issue 29 item 4): a LoRA actor's training checkpoint -> a PEFT adapter
directory (`adapter_config.json`, `adapter_model.safetensors`) that
`peft.PeftModel.from_pretrained(hf_base, DIR)` loads onto the HF base model. Where the stored
adapters map to (checkpoint_tools/lora_adapters.py): each stored A and B is PEFT's lora_A and
lora_B of one HF projection, renamed. `mcore-to-hf --merge-lora` writes the merged HF model
instead.

The adapters are gathered in memory before the one file is written: 0.6% of the model's bytes
at rank 32 on a 70B Llama (1.7 GB in fp32).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from checkpoint_tools.common import DTYPES, ConvertedMetadata, atomic_output_dir
from checkpoint_tools.dcp_reader import DcpReader
from checkpoint_tools.lora_adapters import Adapter, find_adapters, lora_scale, target_modules_regex
from checkpoint_tools.mcore_to_hf import read_adapter, read_dcp_metadata, source_tensors
from rlhf_megatron.errors import CheckpointError
from rlhf_megatron.models.lora_names import peft_adapter_name

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_config(settings: dict[str, Any], adapters: dict[str, Adapter],
                base: str | None) -> dict[str, Any]:
    """adapter_config.json: PEFT's LoraConfig fields for these adapters (the scale alpha / rank,
    not rsLoRA's; no bias; Linear weights stored as [out, in], so no fan_in_fan_out)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(settings["rank"]),
            "lora_alpha": float(settings["alpha"]), "lora_dropout": float(settings["dropout"]),
            "target_modules": target_modules_regex(adapters), "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "inference_mode": True,
            "base_model_name_or_path": base}


def convert_lora_to_peft(ckpt_dir: str | Path, out: str | Path, *, dtype: str | None = None,
                         base: str | None = None, force: bool = False,
                         progress: bool = True) -> dict[str, Any]:
    """Write the adapters of a LoRA training checkpoint as a PEFT adapter directory at `out`.
    `dtype` (fp32 / bf16 / fp16): of the adapter weights (default: as stored). `base`: recorded
    as base_model_name_or_path. Returns a small stats dict."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    from rlhf_megatron.models import ARCHITECTURES

    ckpt_dir, out = Path(ckpt_dir), Path(out)
    start = time.perf_counter()
    metadata = ConvertedMetadata.read(ckpt_dir)
    if metadata.lora is None:
        raise CheckpointError(f"{ckpt_dir} holds no LoRA adapters (its metadata has no lora "
                              "settings): export it with mcore-to-hf")
    config = metadata.hf_config_object()
    table = ARCHITECTURES.get(metadata.architecture).mapping_table_for(config)
    dcp_metadata = read_dcp_metadata(ckpt_dir)
    adapters = find_adapters(source_tensors(ckpt_dir, config.num_hidden_layers, dcp_metadata),
                             table)
    if not adapters:
        raise CheckpointError(f"{ckpt_dir}: the metadata names LoRA settings but no adapter "
                              "tensor is stored")
    lora_scale(metadata.lora, adapters)
    tensors = {}
    reader = DcpReader(ckpt_dir, dcp_metadata)
    try:
        for adapter in tqdm(adapters.values(), desc="lora -> peft", unit="adapter",
                            disable=not progress):
            a, b = read_adapter(reader, adapter)
            out_dtype = DTYPES[dtype] if dtype else a.dtype
            tensors[peft_adapter_name(adapter.hf_weight, "A")] = a.to(out_dtype)
            tensors[peft_adapter_name(adapter.hf_weight, "B")] = b.to(out_dtype)
    finally:
        reader.close()
    with atomic_output_dir(out, force=force) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / ADAPTER_WEIGHTS),
                  metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(
            json.dumps(peft_config(metadata.lora, adapters, base), indent=2, sort_keys=True)
            + "\n")
    return {"adapters": len(adapters), "tensors": len(tensors),
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "seconds": time.perf_counter() - start}
