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

from rlhf_megatron.engines.critic import SEQUENCE_CLASSIFICATION_BASES
from rlhf_megatron.errors import ConfigError
from rlhf_megatron.models import ARCHITECTURES, head_dim_of, pad_vocab_size
from rlhf_megatron.models.gpt_oss import is_gpt_oss
from rlhf_megatron.models.moe_config import is_moe_config, moe_shape
from rlhf_megatron.models.registry import uses_mla


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
    experts: int = 0
    """Routed experts per MoE layer (0: dense model)."""
    expert_ffn: int = 0
    """Intermediate size of one expert (HF moe_intermediate_size; Mixtral intermediate_size)."""
    topk: int = 0
    """Experts per token."""
    sparse_layers: tuple[int, ...] = ()
    """0/1 per decoder layer, 1 = MoE layer (empty for a dense model)."""
    shared_expert_ffn: int = 0
    """The shared expert's FFN size; 0 when none."""
    shared_expert_gate: bool = True
    """Whether the shared expert has a (1, hidden) sigmoid gate (Qwen2-MoE; GLM-4.5 has none)."""
    kv_lora_rank: int = 0
    """Multi-latent attention's kv latent width (DeepSeek-V3); 0 for GQA. With it: q_lora_rank
    (0 = a full-rank q projection), the per-head nope / rope / value widths."""
    q_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    linear_biases: bool = False
    """Megatron's add_bias_linear (gpt-oss): besides the fused QKV's bias, the attention output
    projection, the router and each expert's fc1 and fc2 have one (models/gpt_oss.py)."""
    sinks: bool = False
    """One learnable softmax offset per attention head (gpt-oss's `sinks`), split over TP."""

    @classmethod
    def from_hf(cls, hf: Any) -> ModelShape:
        spec = ARCHITECTURES.for_hf_config(hf)
        heads = hf.num_attention_heads
        moe = _moe_fields(hf)
        mla = {}
        if uses_mla(hf):
            mla = {"kv_lora_rank": hf.kv_lora_rank, "q_lora_rank": hf.q_lora_rank or 0,
                   "qk_nope_dim": hf.qk_nope_head_dim, "qk_rope_dim": hf.qk_rope_head_dim,
                   "v_head_dim": hf.v_head_dim}
        biased = is_gpt_oss(hf)
        return cls(**moe, **mla,
            linear_biases=biased, sinks=biased,
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
            qk_norm=spec.qk_norm(hf),
            tied_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        )

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Width of K (and of V): kv_heads * head_dim."""
        return self.kv_heads * self.head_dim

    def is_sparse(self, layer: int) -> bool:
        return bool(self.sparse_layers) and bool(self.sparse_layers[layer])

    def layer_params(self, tp: int = 1, *, ep: int = 1, layer: int | None = None) -> int:
        """Parameters of one decoder layer on one TP (and EP) rank.

        MoE layers (`layer` given and sparse): a replicated (experts, hidden) router, experts / ep
        local experts whose SwiGLU FFNs are split over TP (expert-TP = TP), and the shared expert
        with its gate if any; dense layers a SwiGLU FFN of `ffn`.
        """
        if self.kv_lora_rank:
            sharded, replicated = self._mla_params()
        else:
            qkv_out = self.q_width + 2 * self.kv_width
            sharded = self.hidden * qkv_out + self.q_width * self.hidden
            replicated = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
            if self.qkv_bias:
                sharded += qkv_out
        sharded += self.heads if self.sinks else 0
        replicated += self.hidden if self.linear_biases else 0  # the row-parallel proj's bias
        if layer is not None and self.is_sparse(layer):
            replicated += self.experts * self.hidden  # the router
            replicated += self.experts if self.linear_biases else 0  # and its bias
            experts = self.experts // ep * self.expert_params(tp)
            if self.shared_expert_ffn:
                sharded += 3 * self.hidden * self.shared_expert_ffn
                replicated += self.hidden if self.shared_expert_gate else 0
            return sharded // tp + experts + replicated
        if self.linear_biases:  # fc1's (gate and up) split over TP, fc2's whole
            sharded += 2 * self.ffn
            replicated += self.hidden
        return (sharded + 3 * self.hidden * self.ffn) // tp + replicated

    def expert_params(self, tp: int = 1) -> int:
        """One routed expert's parameters on one TP rank: its SwiGLU FFN split over TP (expert-TP
        = TP), with add_bias_linear fc1's bias split likewise and fc2's whole."""
        params = 3 * self.hidden * self.expert_ffn // tp
        if self.linear_biases:
            params += 2 * self.expert_ffn // tp + self.hidden
        return params

    def mla_down_params(self) -> int:
        """One MLA layer's q and kv down-projections (hidden x latent widths)."""
        return self.hidden * (self.q_lora_rank + self.kv_lora_rank + self.qk_rope_dim)

    def _mla_params(self) -> tuple[int, int]:
        """(TP-sharded, whole) attention parameters and norms of one MLA layer, as Megatron's local
        spec builds them (MLA runs on it on GPU too: models/config_translation.py): the down-,
        up- and output projections split over TP (the down-projections by output rows, gathered
        before their norms), the two latent norms whole on every rank."""
        q_head = self.qk_nope_dim + self.qk_rope_dim
        q_in = self.q_lora_rank or self.hidden
        sharded = (q_in * self.heads * q_head
                   + self.kv_lora_rank * self.heads * (self.qk_nope_dim + self.v_head_dim)
                   + self.heads * self.v_head_dim * self.hidden + self.mla_down_params())
        whole = 2 * self.hidden + self.q_lora_rank + self.kv_lora_rank
        return sharded, whole

    def total_params(self) -> int:
        """Parameters of the HF model (unpadded vocabulary; a tied output counted once)."""
        embedding = self.vocab * self.hidden
        output = 0 if self.tied_embeddings else embedding
        decoder = sum(self.layer_params(layer=i) for i in range(self.layers))
        return embedding + decoder + self.hidden + output

    def active_params(self) -> int:
        """Parameters one token passes through (top-k of the experts); = total for dense models."""
        if not self.experts:
            return self.total_params()
        idle = (self.experts - self.topk) * self.expert_params()
        return self.total_params() - idle * sum(self.sparse_layers)

    @property
    def activation_ffn(self) -> int:
        """FFN width one token's activations see: topk experts (+ shared) in MoE layers, `ffn` in
        dense ones (the wider of the two, for a per-layer activation bound)."""
        if not self.experts:
            return self.ffn
        return max(self.topk * self.expert_ffn + self.shared_expert_ffn,
                   self.ffn if not all(self.sparse_layers) else 0)


def _moe_fields(hf: Any) -> dict[str, Any]:
    """ModelShape's MoE fields of an HF config ({} for a dense one)."""
    if not is_moe_config(hf):
        return {}
    moe = moe_shape(hf)
    return {"experts": moe.num_experts, "expert_ffn": moe.expert_ffn, "topk": moe.topk,
            "sparse_layers": moe.sparse_layers, "shared_expert_ffn": moe.shared_expert_ffn,
            "shared_expert_gate": moe.shared_expert_gate}


@dataclass(frozen=True)
class StageParams:
    """Parameters held by one rank of one pipeline stage (all its virtual chunks)."""

    stage: int
    layers: int
    embedding: int
    decoder: int
    head: int
    """Final norm + output layer (LM head, or the critic's value head)."""
    experts: int = 0
    """The part of `decoder` that is this rank's routed experts (sharded over expert-DP by the
    distributed optimizer, not DP)."""

    @property
    def total(self) -> int:
        return self.embedding + self.decoder + self.head


def stage_params(shape: ModelShape, *, tp: int, pp: int, stage: int,
                 value_head: bool = False, vocab_divisor: int = 128, ep: int = 1,
                 vpp: int | None = None) -> StageParams:
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
    indices = stage_layer_indices(shape.layers, pp, stage, vpp)
    experts = sum(shape.is_sparse(i) for i in indices) * (
        shape.experts // ep * shape.expert_params(tp))
    return StageParams(stage, layers, embedding,
                       sum(shape.layer_params(tp, ep=ep, layer=i) for i in indices), head, experts)


def stage_layer_indices(layers: int, pp: int, stage: int, vpp: int | None = None) -> list[int]:
    """Global indices of the decoder layers pipeline stage `stage` holds (Megatron's even split;
    with VPP, chunk c of stage s holds block c * pp + s of layers / (pp * vpp))."""
    chunks = vpp or 1
    per_chunk = layers // (pp * chunks)
    return [(c * pp + stage) * per_chunk + i for c in range(chunks) for i in range(per_chunk)]


def read_shape(config_json: Path) -> ModelShape:
    """Shape from a config.json file (a *ForSequenceClassification config maps to its base)."""
    try:
        hf = SimpleNamespace(**json.loads(config_json.read_text()))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {config_json}: {exc}") from None
    names = list(getattr(hf, "architectures", None) or [])
    if len(names) == 1 and names[0] not in ARCHITECTURES.names():
        if names[0] in SEQUENCE_CLASSIFICATION_BASES:
            hf.architectures = [SEQUENCE_CLASSIFICATION_BASES[names[0]]]
    return ModelShape.from_hf(hf)


def lora_stage_params(shape: ModelShape, lora: Any, *, tp: int, layers: list[int]) -> int:
    """Adapter parameters on one rank of a stage holding decoder `layers` (models/lora.py): for
    each target linear, A [r, in] and B [out, r], the one that the base weight splits over TP
    split likewise (B of qkv / fc1 by rows, A of proj / fc2 by columns), the other whole. The
    fused qkv has one adapter per projection (q, k, v), the gated fc1 one for gate and one for up.
    The MLP adapters sit on dense layers only (MoE experts get none)."""
    r, h = lora.rank, shape.hidden
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    attention = {"linear_qkv": 3 * r * h + (q + 2 * kv) // tp * r,
                 "linear_proj": r * (q // tp) + h * r}
    mlp = {"linear_fc1": 2 * r * h + 2 * (shape.ffn // tp) * r,
           "linear_fc2": r * (shape.ffn // tp) + h * r}
    dense = sum(1 for index in layers
                if not (shape.sparse_layers and shape.sparse_layers[index]))
    targets = set(lora.target_modules)
    return (len(layers) * sum(n for name, n in attention.items() if name in targets)
            + dense * sum(n for name, n in mlp.items() if name in targets))
