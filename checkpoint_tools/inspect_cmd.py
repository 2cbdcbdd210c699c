"""`inspect DIR`: architecture, parameter count, dtypes and layout of an HF directory or of a
converted Megatron checkpoint. Reads headers and metadata only, never the weights (for an
adapter-only LoRA checkpoint, the recorded base's sampled fingerprint blocks too)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from checkpoint_tools.common import METADATA_FILE, ConvertedMetadata
from rlhf_megatron.errors import CheckpointError
from rlhf_megatron.models.weights_fingerprint import fingerprint


def _model_lines(config: Any) -> list[str]:
    from rlhf_megatron.models import head_dim_of

    return [
        f"layers: {config.num_hidden_layers}  hidden: {config.hidden_size}  "
        f"ffn: {config.intermediate_size}  heads: {config.num_attention_heads}  "
        f"kv heads: {config.num_key_value_heads}  head_dim: {head_dim_of(config)}",
        f"vocab: {config.vocab_size}  tied embeddings: "
        f"{bool(getattr(config, 'tie_word_embeddings', False))}",
    ]


def _loadable_layouts(config: Any, padded_vocab: int, limit: int = 8) -> str:
    tps = [tp for tp in range(1, limit + 1)
           if config.num_attention_heads % tp == 0 and config.num_key_value_heads % tp == 0
           and config.intermediate_size % tp == 0 and padded_vocab % tp == 0]
    pps = [pp for pp in range(1, limit + 1) if config.num_hidden_layers % pp == 0]
    return f"loadable at tp in {tps}, pp in {pps} (up to {limit})"


def inspect_hf(path: Path) -> list[str]:
    from rlhf_megatron.models.hf_checkpoint import HFCheckpoint

    with HFCheckpoint(path, check_shapes=False) as ckpt:
        tensors = [ckpt.open(name) for name in ckpt.names()]
        config = ckpt.config
        files = sorted({t.file.name for t in tensors})
    params = sum(t.numel() for t in tensors)
    dtypes = Counter(str(t.dtype).removeprefix("torch.") for t in tensors)
    return [
        f"{path}: HF checkpoint",
        f"architecture: {', '.join(getattr(config, 'architectures', None) or ['?'])}",
        f"parameters: {params:,} in {len(tensors)} tensors",
        f"dtypes: {dict(dtypes)}",
        f"layout: safetensors, {len(files)} file(s)"
        + (", with index" if (path / "model.safetensors.index.json").is_file() else ""),
        *_model_lines(config),
    ]


def _base_line(recorded: dict[str, str]) -> str:
    """Where an adapter-only checkpoint's base is, and whether it is still the one trained on."""
    path = Path(recorded["path"])
    if not path.is_dir():
        state = "not found on this machine"
    elif (found := fingerprint(path)) == recorded["fingerprint"]:
        state = "present, fingerprint matches"
    else:
        state = f"present, but its fingerprint is now {found[:19]}: another base"
    return f"base (not stored): {path} ({recorded['fingerprint'][:19]}; {state})"


def _lora_lines(lora: dict[str, Any], base: dict[str, str] | None) -> list[str]:
    scale = lora["alpha"] / lora["rank"]
    lines = [f"LoRA: rank {lora['rank']}, alpha {lora['alpha']:g} (scale {scale:g}), dropout "
             f"{lora['dropout']:g}, on {', '.join(lora['target_modules'])}"]
    return lines + ([_base_line(base)] if base is not None else [])


def inspect_converted(path: Path) -> list[str]:
    from checkpoint_tools.mcore_to_hf import read_tensor_metadata

    metadata = ConvertedMetadata.read(path)
    config = metadata.hf_config_object()
    tensors = read_tensor_metadata(path)
    optimizer = len(read_tensor_metadata(path, model_only=False)) - len(tensors)
    params = sum(shape.numel() for shape, _ in tensors.values())
    if metadata.adapters_only:
        count = f"parameters: {params:,} adapter parameters in {len(tensors)} stored tensors"
    else:
        padding = (metadata.padded_vocab_size - metadata.vocab_size) * config.hidden_size
        padding *= 1 if getattr(config, "tie_word_embeddings", False) else 2
        count = (f"parameters: {params - padding:,} ({params:,} with vocabulary padding) "
                 f"in {len(tensors)} stored tensors")
    dtypes = Counter(str(dtype).removeprefix("torch.") for _, dtype in tensors.values())
    return [
        f"{path}: Megatron dist-checkpoint (torch_dist, layout-free)"
        + ("; LoRA adapters only" if metadata.adapters_only else ""),
        f"architecture: {metadata.architecture}",
        count,
        f"dtypes: {dict(dtypes)}",
        f"layout: saved at tp={metadata.saved_tp} pp={metadata.saved_pp}; padded vocab "
        f"{metadata.padded_vocab_size}; {_loadable_layouts(config, metadata.padded_vocab_size)}",
        *_model_lines(config),
        *(_lora_lines(metadata.lora, metadata.base) if metadata.lora is not None else []),
        f"assets: {', '.join(metadata.asset_files)}",
        f"optimizer state: {f'{optimizer} tensors (a training checkpoint)' if optimizer else 'none'}",
    ]


def inspect_dir(path: str | Path) -> list[str]:
    """Report lines for `path` (an HF directory or a converted checkpoint)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory")
    if (path / METADATA_FILE).is_file():
        return inspect_converted(path)
    if (path / "config.json").is_file():
        return inspect_hf(path)
    raise CheckpointError(f"{path} is neither an HF checkpoint (config.json) nor a converted "
                          f"checkpoint ({METADATA_FILE})")
