"""Core attention on `torch.nn.functional.scaled_dot_product_attention` for the local layer spec.

Megatron-Core's local spec (no Transformer Engine) computes attention unfused: it materialises the
[b, np, s, s] score matrix, applies a -10000 mask fill and runs the softmax in fp32. This module is
a drop-in replacement for its `DotProductAttention` (same constructor arguments, same forward
signature and output layout) that hands the whole softmax(QK^T * scale) V to SDPA:

- CUDA: torch's default dispatch picks FlashAttention-2 (fp16/bf16) or the memory-efficient kernel
  (fp32, or an explicit mask), both O(s) in memory; cuDNN where torch prefers it.
- CPU: the fused flash kernel (`_scaled_dot_product_flash_attention_for_cpu`).
- Causal attention uses `is_causal=True`; no T x T mask is built.
- Packed rows (`packed_seq_params.qkv_format == "thd"`, cu_seqlens) run one causal SDPA call per
  row, so no T x T block-diagonal mask is materialised on any platform and the cross-row blocks are
  never computed. An explicit bool mask (Megatron's convention: True = masked) is still accepted
  and passed to SDPA inverted (SDPA's convention: True = attend).
- Context parallelism (cp > 1): each rank all-gathers its CP group's K/V and attends with its
  own two query chunks (models/sdpa_cp.py), dense or packed; causal attention only.
- GQA: K/V keep their `ng` heads and SDPA broadcasts them (`enable_gqa=True`) where its kernel
  supports that (CPU flash; CUDA flash in fp16/bf16). Elsewhere (CUDA fp32 or masked, which run the
  memory-efficient kernel) K/V are repeated first, as Megatron does.

- Attention sinks (`softmax_type="learnable"`, gpt-oss): one learnable logit per head joins
  every query's softmax and carries no value: p = softmax([q k_j * scale ..., sink_h]) without
  the last column. SDPA is given one more key per head whose score is that logit: q gets an
  extra coordinate 1, the real keys 0 and the sink key sink_h / scale (its value is zero), so
  the sink's gradient comes from SDPA's own backward. K/V are repeated to the query heads.
- Sliding windows (`window_size=(w, 0)` on the layers `window_attn_skip_freq` marks, gpt-oss's
  alternating layers): query i sees keys i - w .. i (Megatron's convention; HF's
  `sliding_window` is w + 1). Both run with an explicit (sq, sk) bool mask per call (per packed
  row), O(s^2) bytes; context parallelism with either is refused.

Scale: `softmax_scale` (default 1/sqrt(head_dim)). `apply_query_key_layer_scaling` does not change
it: Megatron divides the scores by the layer number and multiplies them back inside its fp32
softmax, which only changes rounding.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from rlhf_megatron.errors import ConfigError
from rlhf_megatron.models.sdpa_cp import cp_attention

# enable_gqa exists from torch 2.5 on (the pinned CPU build is 2.13, the H200 has 2.11).
_SDPA_HAS_GQA = torch.torch_version.TorchVersion(torch.__version__) >= (2, 5)
_HALF_DTYPES = (torch.float16, torch.bfloat16)


def _sdpa_broadcasts_kv(device: torch.device, dtype: torch.dtype, masked: bool) -> bool:
    """Whether SDPA's kernel for this call takes K/V with fewer heads than Q without a copy."""
    if not _SDPA_HAS_GQA:
        return False
    if device.type == "cuda":
        # Flash (half precision, no mask) supports GQA; the memory-efficient kernel, which fp32
        # and masked calls reach, does not and would drop to the unfused math kernel.
        return dtype in _HALF_DTYPES and not masked
    return True


def _sdpa(
    query: Tensor, key: Tensor, value: Tensor, *, scale: float, causal: bool,
    allowed: Tensor | None = None, dropout_p: float = 0.0,
) -> Tensor:
    """SDPA on [b, np, sq, hn] queries and [b, ng, sk, hn] keys/values -> [b, np, sq, hn].

    allowed: bool, broadcastable to [b, np, sq, sk], True = may attend (SDPA's convention).
    """
    groups = query.shape[1] // key.shape[1]
    gqa = groups > 1 and _sdpa_broadcasts_kv(query.device, query.dtype, allowed is not None)
    if groups > 1 and not gqa:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    extra = {"enable_gqa": True} if gqa else {}
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=allowed, dropout_p=dropout_p,
        is_causal=causal and allowed is None, scale=scale, **extra,
    )


def _sinks_and_window(
    query: Tensor, key: Tensor, value: Tensor, *, scale: float, causal: bool,
    allowed: Tensor | None, sinks: Tensor | None, window: int | None, dropout_p: float,
) -> Tensor:
    """SDPA with attention sinks and/or a left window (see the module docstring).

    query [b, np, sq, hn], key/value [b, ng, sk, hn] -> [b, np, sq, hn]; sinks (np,) logits;
    window: query i sees keys i - window .. i; allowed: bool, broadcastable to [b, np, sq, sk],
    True = may attend (it replaces the causal rule).
    """
    sq, sk = query.shape[2], key.shape[2]
    device = query.device
    if allowed is None:
        allowed = torch.ones(sq, sk, dtype=torch.bool, device=device)
        if causal:
            allowed = allowed.tril(sk - sq)
    if window is not None:
        rows = torch.arange(sk - sq, sk, device=device)[:, None]
        allowed = allowed & (rows - torch.arange(sk, device=device)[None, :] <= window)
    if sinks is None:
        return _sdpa(query, key, value, scale=scale, causal=False, allowed=allowed,
                     dropout_p=dropout_p)
    b, heads, _, hn = query.shape
    groups = heads // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    query = torch.cat([query, query.new_ones(b, heads, sq, 1)], dim=-1)
    sink_key = torch.cat([key.new_zeros(heads, hn), (sinks.to(key.dtype) / scale)[:, None]], -1)
    key = torch.cat([torch.cat([key, key.new_zeros(b, heads, sk, 1)], dim=-1),
                     sink_key[None, :, None, :].expand(b, -1, -1, -1)], dim=2)
    value = torch.cat([value, value.new_zeros(b, heads, 1, value.shape[-1])], dim=2)
    allowed = torch.cat([allowed, allowed.new_ones(*allowed.shape[:-1], 1)], dim=-1)
    return _sdpa(query, key, value, scale=scale, causal=False, allowed=allowed,
                 dropout_p=dropout_p)


def sdpa_core_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    scale: float,
    causal: bool,
    mask: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    dropout_p: float = 0.0,
    sinks: Tensor | None = None,
    window: int | None = None,
) -> Tensor:
    """softmax(Q K^T * scale [+ mask]) V in Megatron's layouts.

    Dense: query [sq, b, np, hn], key/value [sk, b, ng, hn] -> [sq, b, np * hn].
    Packed (cu_seqlens given): query [t, np, hn], key/value [t, ng, hn] -> [t, np * hn]; rows
        are the slices cu_seqlens[i]:cu_seqlens[i + 1] (int, (n + 1,)), each attending only to
        itself. Tokens past cu_seqlens[-1] (padding) get zeros.
    mask: bool, broadcastable to [b, np, sq, sk], True = masked (Megatron's convention); it
        replaces the causal rule, as in Megatron's local attention.
    sinks: (np,) attention-sink logits of this rank's heads; window: query i sees only keys
        i - window .. i (both: see the module docstring).
    """
    extra = {"sinks": sinks, "window": window}
    if cu_seqlens is not None:
        if mask is not None:
            raise ValueError("packed (thd) attention takes cu_seqlens or a mask, not both")
        return _packed_attention(query, key, value, scale, causal, cu_seqlens, dropout_p, **extra)
    if causal and mask is None and query.shape[0] != key.shape[0]:
        raise ValueError(
            f"causal attention needs as many queries as keys, got {query.shape[0]} and "
            f"{key.shape[0]}"
        )
    # [s, b, heads, hn] -> [b, heads, s, hn]: a view; SDPA reads the strides.
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    allowed = None if mask is None else ~mask.to(torch.bool)
    if sinks is None and window is None:
        out = _sdpa(q, k, v, scale=scale, causal=causal, allowed=allowed, dropout_p=dropout_p)
    else:
        out = _sinks_and_window(q, k, v, scale=scale, causal=causal, allowed=allowed,
                                dropout_p=dropout_p, **extra)
    sq, b = query.shape[0], query.shape[1]
    return out.permute(2, 0, 1, 3).reshape(sq, b, -1)


def _packed_attention(
    query: Tensor, key: Tensor, value: Tensor, scale: float, causal: bool,
    cu_seqlens: Tensor, dropout_p: float, *, sinks: Tensor | None = None,
    window: int | None = None,
) -> Tensor:
    """One SDPA call per packed row: [t, np, hn] x [t, ng, hn] -> [t, np * hn]."""
    bounds = [int(x) for x in cu_seqlens.tolist()]
    total = query.shape[0]
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        # [L, heads, hn] -> [1, heads, L, hn]
        q, k, v = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        if sinks is None and window is None:
            out = _sdpa(q, k, v, scale=scale, causal=causal, dropout_p=dropout_p)
        else:
            out = _sinks_and_window(q, k, v, scale=scale, causal=causal, allowed=None,
                                    sinks=sinks, window=window, dropout_p=dropout_p)
        pieces.append(out.squeeze(0).transpose(0, 1))  # [L, np, hn]
    if bounds[-1] < total:  # padding after the last row
        pieces.append(query.new_zeros(total - bounds[-1], query.shape[1], value.shape[-1]))
    return torch.cat(pieces).reshape(total, -1)


class SDPAttention(MegatronModule):
    """Megatron `DotProductAttention`'s interface on SDPA (see the module docstring).

    Built by SelfAttention with this rank's config: np = num_attention_heads / tp and
    ng = num_query_groups / tp heads per partition; the output holds np * hn channels.
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
    ) -> None:
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.utils import is_layer_window_attention
        from megatron.core.utils import divide

        super().__init__(config=config)
        # Query i of a sliding-window layer sees keys i - window .. i (None: every earlier key).
        self.window = _window_of(config, layer_number, is_layer_window_attention)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        # Context parallelism (models/sdpa_cp.py): this rank holds 2 of the 2*cp chunks of each
        # sequence and attends over the K/V its CP group gathers.
        self.cp_group = getattr(pg_collection, "cp", None)
        if self.cp_group is None and config.context_parallel_size > 1:
            from megatron.core import parallel_state

            self.cp_group = parallel_state.get_context_parallel_group()
        self.cp_size = config.context_parallel_size
        tp = self.tp_group.size()
        # Multi-latent attention gives Q/K and V different head sizes (k_channels, v_channels).
        head_dim = k_channels or config.kv_channels
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp)
        self.hidden_size_per_partition = (
            self.num_attention_heads_per_partition * (v_channels or config.kv_channels))
        self.softmax_scale = (
            1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        )
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        if config.softmax_type == "learnable":
            self._add_attention_sinks(config)
        else:
            self.softmax_offset = None

    def _add_attention_sinks(self, config: Any) -> None:
        """The learnable per-head sink logits of this rank's heads, (np / tp,): Megatron's name
        (`softmax_offset`), init and TP split (by head, as its unfused attention)."""
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        self.softmax_offset = torch.nn.Parameter(torch.empty(
            self.num_attention_heads_per_partition, dtype=config.params_dtype))
        if config.perform_initialization:
            config.init_method(self.softmax_offset)
        set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> Any:
        """The sink logits split by head over TP (Megatron's DotProductAttention's entry)."""
        from megatron.core.transformer.utils import (
            ensure_metadata_has_dp_cp_group,
            make_sharded_tensors_for_checkpoint,
        )

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        state = {} if self.softmax_offset is None else self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(
            state, prefix, {"softmax_offset": 0}, sharded_offsets, tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"])

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> Tensor:
        """query [sq, b, np, hn], key/value [sk, b, ng, hn] -> [sq, b, np * hn];
        with thd packed_seq_params: [t, np, hn] / [t, ng, hn] -> [t, np * hn]."""
        from megatron.core import tensor_parallel
        from megatron.core.transformer.enums import AttnMaskType

        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by the SDPA core attention")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        cu_seqlens = _cu_seqlens(packed_seq_params)
        if cu_seqlens is not None and query.dim() == 4:  # [t, 1, heads, hn]
            query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
        dropout_p = self.dropout_p if self.training else 0.0

        def call() -> Tensor:
            if self.cp_size > 1:
                return self._context_parallel(query, key, value, attention_mask, causal,
                                              cu_seqlens, dropout_p)
            return sdpa_core_attention(
                query, key, value, scale=self.softmax_scale, causal=causal, mask=attention_mask,
                cu_seqlens=cu_seqlens, dropout_p=dropout_p, sinks=self.softmax_offset,
                window=self.window,
            )

        if dropout_p > 0.0 and not self.config.sequence_parallel:
            # Heads differ per TP rank, so the dropout draws come from the model-parallel stream.
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return call()
        return call()


    def _context_parallel(
        self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, causal: bool,
        cu_seqlens: Tensor | None, dropout_p: float,
    ) -> Tensor:
        """This CP rank's queries over its group's K/V (models/sdpa_cp.py); causal only."""
        if mask is not None or not causal:
            raise ValueError("context-parallel SDPA attention supports causal attention without "
                             "an explicit mask only")
        if self.softmax_offset is not None or self.window is not None:
            raise ConfigError("context parallelism is unsupported with attention sinks or "
                              "sliding windows (gpt-oss) in the SDPA core attention")
        return cp_attention(query, key, value, scale=self.softmax_scale, group=self.cp_group,
                            sdpa=_sdpa, cu_seqlens_padded=cu_seqlens, dropout_p=dropout_p)


def _cu_seqlens(packed_seq_params: Any) -> Tensor | None:
    """The row offsets of thd packing (the padded ones when given), else None."""
    if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
        return None
    padded = packed_seq_params.cu_seqlens_q_padded
    return padded if padded is not None else packed_seq_params.cu_seqlens_q


def _window_of(config: Any, layer_number: int, is_window_layer: Any) -> int | None:
    """The left window of this layer (None: full causal attention); refuses in one line the
    attention variants SDPA does not express, naming the config field."""
    if config.softmax_type not in ("vanilla", "learnable"):
        raise ConfigError(f"softmax_type={config.softmax_type!r}: the SDPA core attention "
                          "supports 'vanilla' and 'learnable' (attention sinks) only")
    if not is_window_layer(config.window_size, config.window_attn_skip_freq, layer_number):
        return None
    left, right = config.window_size
    if right != 0 or left < 0:
        raise ConfigError(f"window_size={config.window_size}: the SDPA core attention supports "
                          "causal left windows (w, 0) with w >= 0 only")
    if config.context_parallel_size > 1:
        raise ConfigError("context parallelism is unsupported with sliding-window attention")
    return int(left)


# --------------------------------------------------------------------------- GPU check support


def unfused_reference_attention(
    query: Tensor, key: Tensor, value: Tensor, *, scale: float, mask: Tensor | None = None
) -> Tensor:
    """Megatron's unfused local attention math, for comparisons: [sq, b, np, hn] -> [sq, b, np*hn].

    Scores in fp32, causal unless `mask` (bool, True = masked) is given, masked scores set to
    -10000 (not -inf), softmax in fp32, probabilities cast back to the input dtype.
    """
    groups = query.shape[2] // key.shape[2]
    key, value = key.repeat_interleave(groups, 2), value.repeat_interleave(groups, 2)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is None:
        sq, sk = scores.shape[-2:]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=query.device).triu(1)
    probs = torch.softmax(scores.masked_fill(mask, -10000.0), dim=-1).to(query.dtype)
    out = torch.matmul(probs, v)
    return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)


def _block_causal(lengths: list[int], device: torch.device) -> Tensor:
    """(1, 1, T, T) bool, True = masked: causal within each row, nothing across rows."""
    row = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                  torch.tensor(lengths, device=device))
    allowed = (row[:, None] == row[None, :]) & torch.ones(
        len(row), len(row), dtype=torch.bool, device=device).tril()
    return ~allowed[None, None]


def _max_error_with_grads(
    fn: Any, reference: Any, tensors: tuple[Tensor, ...]
) -> tuple[float, float]:
    """(max |out - ref|, max |grad - ref grad|) over q, k, v for one random output gradient."""
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    ref_leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    out, ref = fn(*leaves), reference(*ref_leaves)
    grad_out = torch.randn_like(ref)
    out.backward(grad_out)
    ref.backward(grad_out)
    out_err = (out.float() - ref.float()).abs().max().item()
    grad_err = max((a.grad.float() - b.grad.float()).abs().max().item()
                   for a, b in zip(leaves, ref_leaves))
    return out_err, grad_err


def attention_self_check(
    device: str | torch.device = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    *,
    heads: int = 8,
    kv_heads: int = 2,
    head_dim: int = 64,
    lengths: tuple[int, ...] = (200, 56, 256),
    time_seq: int = 0,
) -> dict[str, Any]:
    """Check this module's math against Megatron's unfused attention on one device and dtype.

    Runs the dense causal path (batch of len(lengths) rows of max(lengths) tokens) and the packed
    path (the rows back to back, split by cu_seqlens) against `unfused_reference_attention`
    (dense: causal; packed: its block-diagonal mask), outputs and q/k/v gradients, with GQA
    (`heads` query heads over `kv_heads` K/V heads). On CUDA it also records which fused SDPA
    kernels accept these inputs, and with `time_seq > 0` the fwd+bwd time and peak memory of one
    [time_seq, 1, heads, head_dim] call for SDPA and for the unfused math.
    Returns plain floats/strings (errors are absolute max differences).
    """
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(0)
    scale = 1.0 / math.sqrt(head_dim)

    def rand(*shape: int) -> Tensor:
        values = torch.randn(*shape, generator=generator, device=device, dtype=torch.float32)
        return values.to(dtype)

    s, b = max(lengths), len(lengths)
    dense = (rand(s, b, heads, head_dim), rand(s, b, kv_heads, head_dim),
             rand(s, b, kv_heads, head_dim))
    report: dict[str, Any] = {"device": str(device), "dtype": str(dtype).replace("torch.", "")}
    report["dense_out_err"], report["dense_grad_err"] = _max_error_with_grads(
        lambda q, k, v: sdpa_core_attention(q, k, v, scale=scale, causal=True),
        lambda q, k, v: unfused_reference_attention(q, k, v, scale=scale), dense)
    total = sum(lengths)
    packed = (rand(total, heads, head_dim), rand(total, kv_heads, head_dim),
              rand(total, kv_heads, head_dim))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device=device)
    mask = _block_causal(list(lengths), device)
    report["packed_out_err"], report["packed_grad_err"] = _max_error_with_grads(
        lambda q, k, v: sdpa_core_attention(q, k, v, scale=scale, causal=True, cu_seqlens=cu),
        lambda q, k, v: unfused_reference_attention(
            q[:, None], k[:, None], v[:, None], scale=scale, mask=mask)[:, 0], packed)
    if device.type == "cuda":
        report.update(_cuda_kernels_usable(dense, scale))
        if time_seq:
            report.update(_cuda_timing(time_seq, heads, kv_heads, head_dim, dtype, device, scale))
    return report


def _cuda_kernels_usable(dense: tuple[Tensor, ...], scale: float) -> dict[str, Any]:
    """For each fused CUDA SDPA backend: does it run the dense causal GQA call on its own?"""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    result = {}
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
        backend = getattr(SDPBackend, name, None)
        if backend is None:
            result[f"kernel_{name.lower()}"] = "absent in this torch"
            continue
        try:
            with sdpa_kernel([backend]):
                sdpa_core_attention(*dense, scale=scale, causal=True)
            result[f"kernel_{name.lower()}"] = "ok"
        except RuntimeError as exc:  # "No available kernel": the backend refused these inputs
            result[f"kernel_{name.lower()}"] = f"refused: {str(exc).splitlines()[0][:120]}"
    return result


def _cuda_timing(
    seq: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
    device: torch.device, scale: float,
) -> dict[str, float]:
    """fwd+bwd milliseconds and peak GiB of one [seq, 1, heads, head_dim] call, SDPA vs unfused."""
    q = torch.randn(seq, 1, heads, head_dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(seq, 1, kv_heads, head_dim, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(seq, 1, kv_heads, head_dim, device=device, dtype=dtype, requires_grad=True)
    calls = {"sdpa": lambda: sdpa_core_attention(q, k, v, scale=scale, causal=True),
             "unfused": lambda: unfused_reference_attention(q, k, v, scale=scale)}
    result = {}
    for name, call in calls.items():
        call().sum().backward()  # warm-up
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        for _ in range(5):
            call().sum().backward()
        torch.cuda.synchronize(device)
        result[f"{name}_fwd_bwd_ms"] = (time.perf_counter() - start) / 5 * 1e3
        result[f"{name}_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return result
