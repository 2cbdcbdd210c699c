"""The SDPA core-attention math against Megatron's unfused attention math, in one process (fp32).

The model-level parity (TP2, PP2, DP2, packed and not, logits and gradients) is in
tests/integration/models/test_sdpa_attention.py; these pin the pure functions it is built on.
"""

from __future__ import annotations

import math

import torch

from rlhf_megatron.models.sdpa_attention import (
    _block_causal,
    attention_self_check,
    sdpa_core_attention,
    unfused_reference_attention,
)

TOLERANCE = 1e-5


def test_self_check_dense_and_packed_with_gqa_match_unfused_on_cpu():
    # 6 query heads over 2 KV heads (groups of 3), rows of uneven lengths incl. a 1-token row.
    report = attention_self_check("cpu", torch.float32, heads=6, kv_heads=2, head_dim=16,
                                  lengths=(13, 1, 7))
    for key in ("dense_out_err", "dense_grad_err", "packed_out_err", "packed_grad_err"):
        assert report[key] < TOLERANCE, report


def test_megatron_bool_mask_is_inverted_for_sdpa():
    """A Megatron mask (True = masked) gives what the cu_seqlens path and the reference give."""
    g = torch.Generator().manual_seed(1)
    lengths = [5, 3, 8]
    total, scale = sum(lengths), 1.0 / math.sqrt(8)
    q, k, v = (torch.randn(total, 1, heads, 8, generator=g) for heads in (4, 2, 2))
    mask = _block_causal(lengths, torch.device("cpu"))
    masked = sdpa_core_attention(q, k, v, scale=scale, causal=True, mask=mask)
    reference = unfused_reference_attention(q, k, v, scale=scale, mask=mask)
    cu = torch.tensor([0, 5, 8, 16], dtype=torch.int32)
    packed = sdpa_core_attention(q[:, 0], k[:, 0], v[:, 0], scale=scale, causal=True,
                                 cu_seqlens=cu)
    assert masked.shape == (total, 1, 4 * 8)
    assert (masked - reference).abs().max() < TOLERANCE
    assert (packed - masked[:, 0]).abs().max() < TOLERANCE


def test_padding_after_the_last_packed_row_gets_zeros():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(10, 2, 8, generator=g) for _ in range(3))
    out = sdpa_core_attention(q, k, v, scale=0.3, causal=True,
                              cu_seqlens=torch.tensor([0, 4, 7], dtype=torch.int32))
    assert out.shape == (10, 16)
    assert torch.equal(out[7:], torch.zeros(3, 16))
    alone = sdpa_core_attention(q[4:7, None], k[4:7, None], v[4:7, None], scale=0.3, causal=True)
    assert (out[4:7] - alone[:, 0]).abs().max() < TOLERANCE  # row 2 sees only itself


def _eager_sink_attention(q, k, v, sinks, scale, window):
    """HF gpt-oss's eager attention: [s, b, heads, hn] -> [s, b, heads * hn]. Scores of the
    visible keys (causal, and within `window` + 1 keys when given), the sink logit appended,
    softmax, the sink column dropped."""
    groups = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) * scale
    s = scores.shape[-1]
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    visible = (j <= i) & ((i - j <= window) if window is not None else True)
    scores = scores.masked_fill(~visible, float("-inf"))
    sink = sinks.reshape(1, -1, 1, 1).expand(scores.shape[0], -1, s, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    out = probs @ v
    return out.permute(2, 0, 1, 3).reshape(s, q.shape[0], -1)


def test_attention_sinks_and_sliding_window_equal_hf_eager_with_grads():
    """gpt-oss's attention (sinks, a left window of 3): dense and packed rows, outputs and the
    gradients of q, k, v and the sinks, against HF's eager formula (fp32)."""
    g = torch.Generator().manual_seed(3)
    scale = 1.0 / math.sqrt(8)
    for window in (None, 3):
        q, k, v = (torch.randn(9, 2, heads, 8, generator=g) for heads in (4, 2, 2))
        sinks = torch.randn(4, generator=g)
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
        ref_leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
        out = sdpa_core_attention(*leaves[:3], scale=scale, causal=True, sinks=leaves[3],
                                  window=window)
        ref = _eager_sink_attention(*ref_leaves, scale, window)
        grad = torch.randn(ref.shape, generator=g)
        out.backward(grad)
        ref.backward(grad)
        assert (out - ref).abs().max() < TOLERANCE
        for a, b in zip(leaves, ref_leaves):
            assert (a.grad - b.grad).abs().max() < TOLERANCE
        # Packed: two rows of 5 and 4 tokens, each on its own.
        cu = torch.tensor([0, 5, 9], dtype=torch.int32)
        packed = sdpa_core_attention(q[:, 0], k[:, 0], v[:, 0], scale=scale, causal=True,
                                     cu_seqlens=cu, sinks=sinks, window=window)
        for start, end in ((0, 5), (5, 9)):
            row = _eager_sink_attention(q[start:end, :1], k[start:end, :1], v[start:end, :1],
                                        sinks, scale, window)
            assert (packed[start:end] - row[:, 0]).abs().max() < TOLERANCE
