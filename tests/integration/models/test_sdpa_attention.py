"""The local spec without TE (SDPA core attention, SwiGLU MLP, lean linears) == Megatron's stock
local spec (unfused DotProductAttention, its MLP and linears), fp32 1e-5, logits and gradients.

One 2-rank gloo job walks TP2, PP2 (1F1B, 2 micro-batches) and TP1 x DP2. At each layout it
builds the engine twice, once with the default local spec and once with Megatron's stock one
(selected by RLHF_MEGATRON_LOCAL_SPEC=megatron), loads the same HF weights, and runs one
forward/backward through the engine's own micro-batching and Megatron's schedule on right-padded
rows of different lengths, unpacked and packed. Packed, the SDPA engine passes cu_seqlens (thd)
and the stock one the block-diagonal mask. Each rank compares its own logits shard (last stage)
and its own gradient shards (every stage), and the logits of a forward-only pass (no autograd:
the log-prob path, which at TP1 computes fc1 in two halves). At TP1 it also checks that
attention dropout (0 in every config) is applied in training only, and at TP2 that the
vocab-parallel log-probs drop the padded vocabulary columns right (a rank holding only padding
included).
"""

from __future__ import annotations

import os

import pytest
import torch

from rlhf_megatron.testing.layouts import SDPA
from rlhf_megatron.testing.multirank import run_on_ranks
from rlhf_megatron.testing.tiny_models import write_tiny_hf_checkpoint

TOLERANCE = 1e-5
ROWS, SEQ = 4, 24


def _batch():
    from rlhf_megatron.data.batch import TokenBatch

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 300, (ROWS, SEQ), generator=g)
    lengths = torch.tensor([SEQ, 9, 17, 4])  # right padding of different widths
    attn = (torch.arange(SEQ) < lengths[:, None]).long()
    return TokenBatch(ids * attn, attn, attn.clone())


def _forward_backward(hf_dir: str, dims, local_spec: str, packing: bool) -> dict:
    """Logits (this rank's vocab shard, last stage) and main grads of one fwd/bwd pass, and the
    logits of one forward-only pass (no autograd: the log-prob path)."""
    from rlhf_megatron.engines import EngineConfig, OptimizerSettings
    from rlhf_megatron.engines.base import MegatronEngine
    from rlhf_megatron.engines.checkpoint import unwrap
    from rlhf_megatron.models.builder import LOCAL_SPEC_ENV

    os.environ[LOCAL_SPEC_ENV] = local_spec
    try:
        config = EngineConfig(micro_batch_size=ROWS // 2, use_packing=packing,
                              optimizer=OptimizerSettings(name="sgd"))
        engine = MegatronEngine(config, hf_dir=hf_dir, dims=dims, trainable=True)
        micro_batches = engine.make_micro_batches(_batch())
    finally:
        del os.environ[LOCAL_SPEC_ENV]
    layer = unwrap(engine.chunks[0]).decoder.layers[0]
    used = tuple(type(m).__name__ for m in (
        layer.self_attention.core_attention, layer.mlp, layer.mlp.linear_fc1))
    thd = [m.packed_seq_params is not None for m in micro_batches]
    logits = []

    def loss_fn(micro, output):
        from megatron.core import tensor_parallel

        logits.append(output.detach().clone())
        # Next-token cross-entropy over the vocab-parallel logits (b, s, v / tp), real tokens
        # only (the padding would pile up gradient on the pad token's embedding row).
        targets = torch.roll(micro.tokens, -1, dims=1)
        real = torch.ones_like(targets) if micro.packed else micro.rows.attention_mask
        ce = tensor_parallel.vocab_parallel_cross_entropy(output.float(), targets)
        return (ce * real).sum() / real.sum(), {}

    engine.run_micro_batches(micro_batches, loss_fn, forward_only=False)
    grads = {name: p.main_grad.detach().clone() for name, p in engine.named_parameters()}
    no_grad_logits = []

    def record(micro, output):
        no_grad_logits.append(output.detach().clone())
        return output.new_zeros(()), {}

    engine.run_micro_batches(micro_batches, record, forward_only=True)
    return {"logits": logits, "no_grad_logits": no_grad_logits, "grads": grads, "module": used,
            "thd": thd}


def _compare(reference: dict, candidate: dict) -> dict:
    logit_err = max([(a - b).abs().max().item()
                     for kind in ("logits", "no_grad_logits")
                     for a, b in zip(reference[kind], candidate[kind])], default=0.0)
    grad_err = max((reference["grads"][n] - g).abs().max().item()
                   for n, g in candidate["grads"].items())
    grad_size = max(g.abs().max().item() for g in reference["grads"].values())
    return {"logits": logit_err, "grads": grad_err, "grad_size": grad_size,
            "micro_batches_seen": len(candidate["logits"]),
            "no_grad_micro_batches_seen": len(candidate["no_grad_logits"]),
            "modules": (reference["module"], candidate["module"]),
            "thd": (reference["thd"], candidate["thd"])}


def _dropout_only_in_training(hf_dir: str, dims) -> dict:
    """An SDPAttention with attention_dropout=0.5 (the configs use 0) drops only in train()."""
    import dataclasses

    import transformers
    from megatron.core.transformer.enums import AttnMaskType

    from rlhf_megatron.models import ARCHITECTURES, hf_to_megatron_args
    from rlhf_megatron.models.sdpa_attention import SDPAttention

    hf_config = transformers.AutoConfig.from_pretrained(hf_dir)
    args = hf_to_megatron_args(hf_config, ARCHITECTURES.for_hf_config(hf_config), dims)
    config = dataclasses.replace(args.transformer_config, attention_dropout=0.5)
    module = SDPAttention(config, 1, AttnMaskType.causal, "self")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, 2, heads, 32, generator=g) for heads in (4, 2, 2))
    module.eval()
    evaluated = module(q, k, v, None)
    module.train()
    first, second = module(q, k, v, None), module(q, k, v, None)
    return {"eval_is_exact": bool(torch.equal(evaluated, module.eval()(q, k, v, None))),
            "train_drops": not torch.allclose(first, evaluated),
            "train_draws_differ": not torch.allclose(first, second)}


def _vocab_padding_check() -> dict:
    """vocab_parallel_logprobs at TP2 with vocab 100 in 2 x 128 columns: rank 0 drops its padded
    tail, rank 1 holds only padding. Log-probs, entropy and logit gradients against log_softmax
    over the real columns of the gathered logits."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from rlhf_megatron.engines.vocab_parallel import vocab_parallel_logprobs

    vocab, local = 100, 128
    g = torch.Generator().manual_seed(9)
    full = torch.randn(2, 5, 2 * local, generator=g)
    targets = torch.randint(0, vocab, (2, 5), generator=g)
    rank = parallel_state.get_tensor_model_parallel_rank()
    shard = full[..., rank * local:(rank + 1) * local].clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(shard, targets, vocab_size=vocab)
    (lp.sum() + ent.sum()).backward()
    reference = full.clone().requires_grad_(True)
    logp = torch.log_softmax(reference[..., :vocab], -1)
    ref_lp = logp.gather(-1, targets[..., None])[..., 0]
    ref_ent = -(logp.exp() * logp).sum(-1)
    (ref_lp.sum() + ref_ent.sum()).backward()
    grads = gather_from_tensor_model_parallel_region(shard.grad)
    return {"logprobs": (lp - ref_lp).abs().max().item(),
            "entropy": (ent - ref_ent).abs().max().item(),
            "grads": (grads - reference.grad).abs().max().item()}


def _parity_job(hf_dir: str) -> dict:
    from rlhf_megatron.parallel import destroy_layout, initialize_layout

    results = {}
    for layout in SDPA.layouts:
        tp, pp = layout.tp, layout.pp
        dims = layout.dims(2)
        initialize_layout(dims, seed=3)
        for packing in (False, True):
            stock = _forward_backward(hf_dir, dims, "megatron", packing)
            sdpa = _forward_backward(hf_dir, dims, "sdpa", packing)
            results[f"tp{tp}pp{pp}-{'packed' if packing else 'padded'}"] = _compare(stock, sdpa)
        if (tp, pp) == (1, 1):
            results["dropout"] = _dropout_only_in_training(hf_dir, dims)
        if tp == 2:
            results["vocab_padding"] = _vocab_padding_check()
        destroy_layout()
    return results


@pytest.mark.multirank
def test_sdpa_local_spec_matches_megatron_stock_spec(tmp_path):
    # Llama with GQA (4 query heads over 2 KV heads, 1 of each per rank at TP2).
    hf_dir = write_tiny_hf_checkpoint(tmp_path / "hf", SDPA.architectures[0], num_layers=2)
    per_rank = run_on_ranks(_parity_job, 2, (str(hf_dir),), timeout_s=600)
    for rank, results in enumerate(per_rank):
        assert results.pop("dropout") == {"eval_is_exact": True, "train_drops": True,
                                          "train_draws_differ": True}, rank
        padding = results.pop("vocab_padding")
        assert max(padding.values()) < TOLERANCE, (rank, padding)
        assert len(results) == 2 * len(SDPA.layouts)
        for case, r in results.items():
            where = f"rank {rank} {case}: {r}"
            stock = ("DotProductAttention", "MLP", "ColumnParallelLinear")
            ours = ("SDPAttention", "SwiGLUMLP", "LeanColumnParallelLinear")
            assert r["modules"] == (stock, ours), where
            packed = case.endswith("packed")
            # Packed: the stock engine used the T x T mask, the SDPA engine cu_seqlens.
            assert r["thd"] == ([False] * 2, [packed] * 2), where
            assert r["logits"] < TOLERANCE and r["grads"] < TOLERANCE, where
            assert r["grad_size"] > 1e-3, where  # the gradients compared are not all ~0
    # Every layout's last stage saw both micro-batches.
    for case in per_rank[0]:
        for seen in ("micro_batches_seen", "no_grad_micro_batches_seen"):
            assert max(rank[case][seen] for rank in per_rank) == 2, (case, seen)
