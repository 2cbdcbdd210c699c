"""Metadata of this project's Megatron dist-checkpoints, shared by the engines (which read and
write it) and checkpoint_tools (the converter CLI): the metadata file next to a checkpoint, where
its HF assets live, and copying those assets."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlhf_megatron.errors import CheckpointError
from rlhf_megatron.models.weights_fingerprint import check_base

METADATA_FILE = "rlhf_megatron_checkpoint.json"
ASSETS_DIR = "hf_assets"  # config.json, generation_config.json, tokenizer files of the source
FORMAT_VERSION = 1
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
# Stored keys that are not model weights: an engine's training checkpoint also holds Megatron's
# optimizer state ("optimizer.state.exp_avg.<param key>", "optimizer.distributed...", and
# "chained_<i>.optimizer..." for a chained optimizer).
_OPTIMIZER_KEY = re.compile(r"^(chained_\d+\.)?optimizer\.")


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


def is_model_key(key: str) -> bool:
    """Whether a dist-checkpoint key holds a model weight (not optimizer state)."""
    return _OPTIMIZER_KEY.match(key) is None


def is_megatron_checkpoint(path: str | Path) -> bool:
    """A Megatron dist-checkpoint of this project (`hf-to-mcore` or an engine's save)."""
    return (Path(path) / METADATA_FILE).is_file()


def hf_assets_dir(path: str | Path) -> Path:
    """Where the HF config.json and tokenizer of `path` live: `path` itself for an HF directory,
    its `hf_assets/` for a Megatron dist-checkpoint."""
    path = Path(path)
    return path / ASSETS_DIR if is_megatron_checkpoint(path) else path


@dataclass(frozen=True)
class ConvertedMetadata:
    """The metadata file written next to a Megatron dist-checkpoint by `hf-to-mcore`.

    padded_vocab_size: embedding rows in the checkpoint; it fixes which TP sizes can load it.
    saved_tp / saved_pp: the layout it was written from (the torch_dist format is layout-free).
    export_dtypes: Megatron tensor name -> the dtype its HF tensor had, where Megatron stores it
        in another (a router's expert bias: Megatron keeps it fp32 whatever the checkpoint had),
        so that `mcore-to-hf` writes it back as it came.
    lora: a LoRA actor's settings (rank, alpha, dropout, target_modules) when the checkpoint
        holds adapters ("...lora.a.<part>" / "...lora.b.<part>" keys beside the base weights);
        `lora-to-peft` and `mcore-to-hf --merge-lora` read them. None: no adapters.
    base: {path, fingerprint} of the base model an adapter-only checkpoint was trained on (a LoRA
        actor saves its adapters and their optimizer state only; models/weights_fingerprint.py).
        None: the checkpoint holds every model weight.
    """

    architecture: str
    hf_config: dict[str, Any]
    dtype: str
    vocab_size: int
    padded_vocab_size: int
    asset_files: list[str]
    saved_tp: int = 1
    saved_pp: int = 1
    format_version: int = FORMAT_VERSION
    export_dtypes: dict[str, str] = field(default_factory=dict)
    lora: dict[str, Any] | None = None
    base: dict[str, str] | None = None

    @property
    def adapters_only(self) -> bool:
        return self.base is not None

    def write(self, ckpt_dir: Path) -> None:
        (ckpt_dir / METADATA_FILE).write_text(json.dumps(asdict(self), indent=2, sort_keys=True))

    @classmethod
    def read(cls, ckpt_dir: str | Path) -> ConvertedMetadata:
        path = Path(ckpt_dir) / METADATA_FILE
        if not path.is_file():
            raise CheckpointError(f"{ckpt_dir} is not a converted checkpoint: {METADATA_FILE} is missing")
        try:
            fields = json.loads(path.read_text())
            return cls(**fields)
        except (ValueError, TypeError) as exc:
            raise CheckpointError(f"corrupt {path}: {exc}") from None

    def hf_config_object(self) -> Any:
        import transformers

        fields = dict(self.hf_config)
        model_type = fields.pop("model_type", None)
        if model_type is None:
            raise CheckpointError(f"{METADATA_FILE}: hf_config has no model_type")
        return transformers.AutoConfig.for_model(model_type, **fields)


def recorded_base(path: str | Path) -> dict[str, str] | None:
    """The base an adapter-only LoRA checkpoint at `path` names ({path, fingerprint}); None for
    any other directory. Reads that one field, so a metadata file written before it existed
    (or a stand-in for one) is no adapter-only checkpoint."""
    metadata = Path(path) / METADATA_FILE
    if not metadata.is_file():
        return None
    try:
        return json.loads(metadata.read_text()).get("base")
    except ValueError as exc:
        raise CheckpointError(f"corrupt {metadata}: {exc}") from None


def base_weights_dir(path: str | Path) -> Path:
    """Where the base weights of a model directory are: the directory itself, or the base an
    adapter-only LoRA checkpoint names."""
    base = recorded_base(path)
    return Path(path) if base is None else Path(base["path"])


def adapters_only_refusal(path: str | Path) -> str:
    return (f"{path} holds LoRA adapters only: a run from it needs actor.engine.lora set; for "
            "anything else export the merged model (rlhf-convert mcore-to-hf --merge-lora)")


def check_adapters_base(ckpt_dir: str | Path, base_dir: str | Path) -> None:
    """Refuse an adapter-only checkpoint whose recorded base is not `base_dir`'s weights (a
    checkpoint that holds every weight passes)."""
    base = recorded_base(ckpt_dir)
    if base is not None:
        check_base(Path(ckpt_dir), base, Path(base_dir))


def copy_hf_assets(hf_dir: Path, dest: Path) -> list[str]:
    """Copy config, generation config and tokenizer files (every top-level non-weight file).
    From a Megatron dist-checkpoint, its own `hf_assets/` are copied (an engine built from one
    passes them on to its training checkpoints)."""
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    if is_megatron_checkpoint(hf_dir):
        for name in ConvertedMetadata.read(hf_dir).asset_files:
            if not (hf_dir / ASSETS_DIR / name).is_file():
                raise CheckpointError(f"asset {hf_dir / ASSETS_DIR / name} listed in the "
                                      "metadata is missing")
            shutil.copy2(hf_dir / ASSETS_DIR / name, dest / name)
            copied.append(name)
        return copied
    for path in sorted(hf_dir.iterdir()):
        if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES) \
                and path.name != "model.safetensors.index.json":
            shutil.copy2(path, dest / path.name)
            copied.append(path.name)
    return copied
