"""Model shapes from an HF config.json, and parameter counts per rank of a Megatron layout.

The counts follow the tensors Megatron's GPTModel creates (docs/PLANNER.md, "Parameters"):
vocab-parallel embedding on the first pipeline stage; per layer two RMSNorm weights (replicated
over TP), a column-parallel fused QKV (with GQA, plus its bias for Qwen2), a row-parallel output
projection, a column-parallel fused gate/up and a row-parallel down projection; the final norm
and the vocab-parallel output layer on the last stage. The vocabulary is padded per Megatron-LM.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rlhf_megatron.errors import ConfigError
from rlhf_megatron.models import ARCHITECTURES, head_dim_of, pad_vocab_size


@dataclass(frozen=True)
class ModelShape:
    """The sizes that decide parameter, activation and KV-cache memory."""

    architecture: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    """SwiGLU intermediate size (gate and up are each `ffn` wide)."""
    vocab: int
    max_positions: int
    qkv_bias: bool
    qk_norm: bool
    tied_embeddings: bool

    @classmethod
    def from_hf(cls, hf: Any) -> ModelShape:
        spec = ARCHITECTURES.for_hf_config(hf)
        heads = hf.num_attention_heads
        return cls(
            architecture=spec.hf_architecture,
            hidden=hf.hidden_size,
            layers=hf.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=head_dim_of(hf),
            ffn=hf.intermediate_size,
            vocab=hf.vocab_size,
            max_positions=hf.max_position_embeddings,
            qkv_bias=spec.qkv_bias(hf),
            qk_norm=spec.qk_layernorm,
            tied_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        )

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Width of K (and of V): kv_heads * head_dim."""
        return self.kv_heads * self.head_dim

    def layer_params(self, tp: int = 1) -> int:
        """Parameters of one decoder layer on one TP rank."""
        qkv_out = self.q_width + 2 * self.kv_width
        sharded = self.hidden * qkv_out + self.q_width * self.hidden + 3 * self.hidden * self.ffn
        if self.qkv_bias:
            sharded += qkv_out
        replicated = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        return sharded // tp + replicated

    def total_params(self) -> int:
        """Parameters of the HF model (unpadded vocabulary; a tied output counted once)."""
        embedding = self.vocab * self.hidden
        output = 0 if self.tied_embeddings else embedding
        return embedding + self.layers * self.layer_params() + self.hidden + output


@dataclass(frozen=True)
class StageParams:
    """Parameters held by one rank of one pipeline stage (all its virtual chunks)."""

    stage: int
    layers: int
    embedding: int
    decoder: int
    head: int
    """Final norm + output layer (LM head, or the critic's value head)."""

    @property
    def total(self) -> int:
        return self.embedding + self.decoder + self.head


def stage_params(shape: ModelShape, *, tp: int, pp: int, stage: int,
                 value_head: bool = False, vocab_divisor: int = 128) -> StageParams:
    """Parameters of one TP rank of pipeline stage `stage` (0-based).

    With VPP the stage's layers are spread over its chunks, but the first chunk of stage 0 still
    holds the embedding and the last chunk of stage pp-1 the output layer, so counts per rank are
    the same as without VPP. `value_head`: the critic's (1, hidden) head replaces the LM head.
    """
    layers = shape.layers // pp
    padded = pad_vocab_size(shape.vocab, tp, vocab_divisor)
    embedding = padded * shape.hidden // tp if stage == 0 else 0
    head = 0
    if stage == pp - 1:
        head = shape.hidden  # final RMSNorm
        if value_head:
            head += shape.hidden
        elif not (shape.tied_embeddings and pp == 1):
            # Tied embeddings with pp > 1: the last stage keeps its own copy of the embedding,
            # kept equal by an all-reduce of the grads, so it costs memory there too.
            head += padded * shape.hidden // tp
    return StageParams(stage, layers, embedding, layers * shape.layer_params(tp), head)


def read_shape(config_json: Path) -> ModelShape:
    """Shape from a config.json file (a *ForSequenceClassification config maps to its base)."""
    try:
        hf = SimpleNamespace(**json.loads(config_json.read_text()))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {config_json}: {exc}") from None
    names = list(getattr(hf, "architectures", None) or [])
    if len(names) == 1 and names[0] not in ARCHITECTURES.names():
        from rlhf_megatron.engines.critic import SEQUENCE_CLASSIFICATION_BASES

        if names[0] in SEQUENCE_CLASSIFICATION_BASES:
            hf.architectures = [SEQUENCE_CLASSIFICATION_BASES[names[0]]]
    return ModelShape.from_hf(hf)
