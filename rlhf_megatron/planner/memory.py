"""Per-GPU memory formulas: model state, activations, vLLM KV cache (docs/PLANNER.md).

Pure functions of shapes and sizes; every result is in bytes. The sources:

- Model state: Megatron mixed precision keeps bf16 params, fp32 main grads (our engines set
  grad_reduce_in_fp32) and fp32 master params + Adam moments; the distributed optimizer shards the
  fp32 master params and moments over the data-parallel ranks (ZeRO stage 1-2, Rajbhandari et al.
  2020, arXiv:1910.02054; Megatron-Core docs, "Distributed Optimizer": 18 bytes/param without,
  6 + 12/d with it).
- Activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models" (arXiv:2205.05198), eq. (1)-(2) and sec. 4.2.3, re-derived for SwiGLU, GQA, no dropout
  and flash attention.
- KV cache: 2 (K and V) * layers * kv_heads * head_dim * bytes per token, split over the
  rollout's TP ranks (PagedAttention, Kwon et al. 2023, arXiv:2309.06180).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_megatron.planner.shapes import ModelShape

GIB = 2**30

_TRAIN_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_ROLLOUT_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "auto": 2, "float32": 4,
                        "float": 4}


def train_dtype_bytes(dtype: str) -> int:
    return _TRAIN_DTYPE_BYTES[dtype]


def rollout_dtype_bytes(dtype: str) -> int:
    return _ROLLOUT_DTYPE_BYTES.get(dtype, 2)


@dataclass(frozen=True)
class StateBytes:
    """Bytes of model state on one rank."""

    weights: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer


def model_state_bytes(params: int, *, dtype: str, trainable: bool, optimizer: str = "adam",
                      sgd_momentum: float = 0.0, optimizer_shards: int = 1) -> StateBytes:
    """Weights, gradient buffer and optimizer state of `params` parameters on one rank.

    bf16/fp16: 2-byte weights, 4-byte main grads, and the optimizer keeps 4-byte master weights
    plus its moments (Adam: 2 x 4 bytes; SGD: momentum, 4 bytes, when used).
    fp32: 4-byte weights and grads; no separate master copy.
    `optimizer_shards`: dp * cp with the distributed optimizer (it shards master weights and
    moments, never the bf16 weights nor the grad buffer), else 1.
    """
    weight_bytes = train_dtype_bytes(dtype)
    if not trainable:
        return StateBytes(params * weight_bytes, 0.0, 0.0)
    moments = 8 if optimizer == "adam" else (4 if sgd_momentum else 0)
    master = 4 if weight_bytes == 2 else 0
    return StateBytes(params * weight_bytes, params * 4.0,
                      params * (moments + master) / optimizer_shards)


def layer_activation_bytes(shape: ModelShape, tokens: float, *, tp: int,
                           sequence_parallel: bool, act_bytes: int,
                           flash_attention: bool = True, seq_len: int = 0, cp: int = 1) -> float:
    """Activations one decoder layer keeps for its backward pass, on one TP rank.

    Per token (act_bytes each): the inputs of both RMSNorms and of the QKV and fc1 GEMMs, 4h,
    replicated over TP unless sequence parallelism splits them; Q, K, V and the attention output,
    2(a*d) + 2(g*d), and the fused SwiGLU's input (2F) and output (F), all split over TP.
    Korthikanti et al.'s 34*s*b*h (GPT, 4h GELU MLP, dropout) becomes this for Llama-like layers;
    their 5*a*s/h term (the s x s softmax) vanishes with flash attention, which keeps only the
    row statistics. Without flash attention one (a/tp, s, s) softmax output is added.
    With context parallelism `tokens` are this CP rank's share and the attention also keeps the
    K and V its CP group gathered for it (models/sdpa_cp.py; TE's p2p ring keeps the same):
    (cp - 1) * 2(g*d)/tp more per local token.
    """
    replicated = 4 * shape.hidden / (tp if sequence_parallel else 1)
    # MoE layers: each token's top-k expert FFNs (activation_ffn), and the dispatcher's permuted
    # copies of its input and of the experts' output, topk rows of `hidden` each.
    replicated += 2 * shape.topk * shape.hidden
    sharded = (2 * shape.q_width + 2 * shape.kv_width + 3 * shape.activation_ffn) / tp
    per_token = act_bytes * (replicated + sharded + (cp - 1) * 2 * shape.kv_width / tp)
    if not flash_attention:
        per_token += act_bytes * shape.heads * seq_len / tp
    return tokens * per_token


def in_flight_micro_batches(*, pp: int, vpp: int | None, stage: int,
                            micro_batches: int | None) -> float:
    """Micro-batches whose activations stage `stage` holds at the peak of 1F1B.

    1F1B: stage i runs pp - i forwards before its first backward (Narayanan et al. 2021,
    arXiv:2104.04473); never more than the micro-batches there are. The interleaved schedule
    holds (1 + (pp-1)/(pp*vpp)) times more (Korthikanti et al. 2022, sec. 4.2.3).
    `micro_batches=None` (token-budget micro-batching): assume at least pp of them.
    """
    count = float(pp - stage)
    if micro_batches is not None:
        count = min(count, float(micro_batches))
    if vpp and vpp > 1:
        count *= 1 + (pp - 1) / (pp * vpp)
    return count


def training_activation_bytes(shape: ModelShape, *, tokens: float, tp: int, pp: int,
                              vpp: int | None, stage: int, micro_batches: int | None,
                              recompute: bool, sequence_parallel: bool, act_bytes: int,
                              logits_columns: int, cp: int = 1,
                              logits_tokens: float | None = None) -> float:
    """Peak activations of one rank of pipeline stage `stage` during a training step.

    Without recompute every layer of the stage keeps `layer_activation_bytes` per in-flight
    micro-batch. With full recompute a layer keeps only its input (h per token) and one layer at
    a time is recomputed in full. The last stage adds the logits: bf16 output, its fp32 copy and
    fp32 gradient (act_bytes + 8 bytes per vocabulary column of this TP rank).
    `logits_columns`: padded vocabulary / tp (0 for a value head). `logits_tokens`: positions
    whose logits exist at once, `logits_chunk_tokens` when the read-out is chunked
    (engines/chunked_logprobs.py: one chunk at a time, recomputed in backward), all `tokens`
    otherwise (the default).
    """
    layers = shape.layers // pp
    in_flight = in_flight_micro_batches(pp=pp, vpp=vpp, stage=stage, micro_batches=micro_batches)
    full = layer_activation_bytes(shape, tokens, tp=tp, sequence_parallel=sequence_parallel,
                                  act_bytes=act_bytes, cp=cp)
    if recompute:
        checkpoint = tokens * shape.hidden * act_bytes / (tp if sequence_parallel else 1)
        stored = in_flight * layers * checkpoint + full
    else:
        stored = in_flight * layers * full
    if stage == pp - 1:
        stored += (tokens if logits_tokens is None else logits_tokens) * logits_columns * (
            act_bytes + 8)
    return stored


def forward_activation_bytes(shape: ModelShape, *, tokens: float, tp: int,
                             sequence_parallel: bool, act_bytes: int,
                             logits_columns: int, cp: int = 1,
                             logits_tokens: float | None = None) -> float:
    """Peak of a forward-only pass (log-probs, values, scores): one layer's working set plus the
    logits and their fp32 copy (nothing is kept for a backward pass); `logits_tokens` as in
    training_activation_bytes."""
    layer = layer_activation_bytes(shape, tokens, tp=tp, sequence_parallel=sequence_parallel,
                                   act_bytes=act_bytes, cp=cp)
    return layer + (tokens if logits_tokens is None else logits_tokens) * logits_columns * (
        act_bytes + 4)


def kv_cache_bytes_per_token(shape: ModelShape, *, tp: int, kv_bytes: int) -> float:
    """KV cache per token on one rollout GPU. With tp > kv_heads vLLM replicates KV heads, so
    each GPU keeps at least one. Multi-latent attention caches one latent per token and layer
    instead, the compressed kv (kv_lora_rank) and the shared RoPE key (qk_rope_head_dim), whole on
    every TP rank (vLLM's MLA backends: one KV head of kv_lora_rank + qk_rope_head_dim, 576 for
    DeepSeek-V3)."""
    if shape.kv_lora_rank:
        return shape.layers * (shape.kv_lora_rank + shape.qk_rope_dim) * kv_bytes
    kv_heads_per_gpu = max(1, shape.kv_heads // tp)
    return 2 * shape.layers * kv_heads_per_gpu * shape.head_dim * kv_bytes


def rollout_weight_bytes(shape: ModelShape, *, tp: int, weight_bytes: int) -> float:
    """vLLM's weights on one GPU: everything split over its TP ranks (norms are negligible)."""
    return shape.total_params() * weight_bytes / tp


def largest_tensor_bytes(shape: ModelShape, *, weight_bytes: int) -> float:
    """The biggest full (TP-gathered) tensor the refit materialises: the embedding / LM head,
    the fused gate/up or the fused QKV."""
    qkv = (shape.q_width + 2 * shape.kv_width) * shape.hidden
    return max(shape.vocab * shape.hidden, 2 * shape.ffn * shape.hidden, qkv) * weight_bytes
