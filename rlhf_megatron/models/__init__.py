"""Architecture registry, HF -> Megatron config translation and the GPTModel builder."""

from rlhf_megatron.models import (
    decoders,  # noqa: F401  (registers the supported families)
    moe_decoders,  # noqa: F401  (and the mixture-of-experts ones)
)
from rlhf_megatron.models.builder import build_gpt_model, build_layer_spec, build_model_chunks
from rlhf_megatron.models.config_translation import (
    MegatronModelArgs,
    head_dim_of,
    hf_to_megatron_args,
    pad_vocab_size,
)
from rlhf_megatron.models.registry import ARCHITECTURES, ArchitectureSpec

__all__ = [
    "ARCHITECTURES",
    "ArchitectureSpec",
    "MegatronModelArgs",
    "build_gpt_model",
    "build_layer_spec",
    "build_model_chunks",
    "head_dim_of",
    "hf_to_megatron_args",
    "pad_vocab_size",
]
