"""Actor engine: log-probs/entropy equal HF transformers' at TP2, PP2 and DP2 (with and without
packing), and one update step gives the same new weights at every layout (global normaliser)."""

from __future__ import annotations

import pytest
import torch

from rlhf_megatron.testing.batches import padded_prompt_batch
from rlhf_megatron.testing.hf_reference import hf_batch_logprobs, hf_model
from rlhf_megatron.testing.layouts import ENGINE, ENGINE_VPP
from rlhf_megatron.testing.multirank import run_on_ranks
from rlhf_megatron.testing.tiny_models import write_tiny_hf_checkpoint

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return str(write_tiny_hf_checkpoint(tmp_path_factory.mktemp("actor") / "hf",
                                        ENGINE.architectures[0]))


def _batch(rows: int = 8, seq: int = 14):
    return padded_prompt_batch(torch.Generator().manual_seed(3), rows, seq)


def _hf_token_values(hf_dir: str, batch):
    return hf_batch_logprobs(hf_model(hf_dir), batch, entropy=True)


def _dp_share(batch, dims):
    from megatron.core import parallel_state

    return batch.chunk(dims.dp)[parallel_state.get_data_parallel_rank()]


def _logprob_parity_job(hf_dir: str) -> dict:
    import torch.distributed as dist

    from rlhf_megatron.engines import ActorEngine, EngineConfig
    from rlhf_megatron.parallel import destroy_layout, initialize_layout

    diffs = {}
    for layout in ENGINE_VPP.layouts:
        tp, pp, vpp = layout.tp, layout.pp, layout.vpp
        dims = layout.dims(dist.get_world_size())
        initialize_layout(dims)
        for packing in (False, True):
            # Packed runs also cut micro-batches by a token budget instead of by rows (except
            # with VPP, whose interleaved schedule needs a multiple of pp micro-batches).
            by_budget = packing and vpp is None
            budget = {"max_tokens_per_micro_batch": 30} if by_budget else {"micro_batch_size": 2}
            engine = ActorEngine(EngineConfig(use_packing=packing, **budget),
                                 hf_dir=hf_dir, dims=dims)
            batch = _dp_share(_batch(), dims)
            out = engine.compute_logprobs(batch, with_entropy=True)
            ref_lp, ref_ent = _hf_token_values(hf_dir, batch)
            diffs[f"tp{tp}pp{pp}vpp{vpp or 1}dp{dims.dp}-pack{int(packing)}"] = (
                (out["logprobs"] - ref_lp).abs().max().item(),
                (out["entropy"] - ref_ent).abs().max().item(),
                int(batch.loss_mask.sum()),
            )
        destroy_layout()
    return diffs


@pytest.mark.multirank
def test_logprobs_and_entropy_match_hf_at_tp2_pp2_dp2(hf_dir):
    per_rank = run_on_ranks(_logprob_parity_job, 2, (hf_dir,), timeout_s=600)
    for diffs in per_rank:
        assert len(diffs) == 2 * len(ENGINE_VPP.layouts)
        for case, (lp, ent, scored) in diffs.items():
            assert scored > 0, case
            assert lp < TOLERANCE, f"{case}: logprobs differ by {lp}"
            assert ent < TOLERANCE, f"{case}: entropy differs by {ent}"


def _update_inputs(hf_dir: str, batch):
    """old_logprobs = HF log-probs perturbed (so the ratio clips), advantages random."""
    lp, _ = _hf_token_values(hf_dir, batch)
    g = torch.Generator().manual_seed(5)
    noise = 0.3 * torch.randn(lp.shape, generator=g)
    advantages = torch.randn(lp.shape, generator=g) * batch.loss_mask
    return batch.with_fields(old_logprobs=(lp + noise) * batch.loss_mask, advantages=advantages)


def _one_update(
    hf_dir: str, tp: int, pp: int, aggregation: str, packing: bool, recompute: bool = False
):
    import torch.distributed as dist

    from rlhf_megatron.engines import (
        ActorEngine,
        EngineConfig,
        OptimizerSettings,
        PolicyUpdateSettings,
    )
    from rlhf_megatron.parallel import ParallelDims, destroy_layout, initialize_layout

    dims = ParallelDims(dist.get_world_size(), tp=tp, pp=pp)
    initialize_layout(dims)
    # SGD keeps the update linear in the gradient, so 1e-5 on weights checks the gradient itself
    # (Adam's first step is ~lr * sign(g) and would amplify round-off near zero).
    optimizer = OptimizerSettings(name="sgd", lr=0.5, clip_grad=0.0)
    config = EngineConfig(micro_batch_size=2, use_packing=packing, optimizer=optimizer,
                          recompute_activations=recompute)
    engine = ActorEngine(config, hf_dir=hf_dir, dims=dims)
    before = {name: p.detach().clone() for name, p in engine.named_parameters()}
    batch = _dp_share(_update_inputs(hf_dir, _batch()), dims)
    metrics = engine.update_policy(batch, PolicyUpdateSettings(aggregation=aggregation))
    weights = {name: p.detach().clone() for name, p in engine.named_parameters()}
    metrics["moved"] = max((weights[n] - before[n]).abs().max().item() for n in weights)
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    padded = engine.args.padded_vocab_size
    destroy_layout()
    return weights, metrics, tp_rank, padded


def _reference_update_job(hf_dir: str, aggregation: str) -> dict:
    weights, metrics, _, _ = _one_update(hf_dir, 1, 1, aggregation, packing=False)
    return {"weights": weights, "metrics": metrics}


def _layout_update_job(hf_dir: str, aggregation: str, reference: dict) -> dict:
    from rlhf_megatron.models.megatron_layout import resize_vocab_rows

    worst = {}
    # Packing at TP2 and DP2; full activation recompute at PP2.
    for layout, packing, recompute in zip(ENGINE.layouts, (True, False, True), (False, True, False)):
        tp, pp = layout.tp, layout.pp
        weights, metrics, tp_rank, padded = _one_update(
            hf_dir, tp, pp, aggregation, packing, recompute
        )
        diff = 0.0
        for name, shard in weights.items():
            full = reference["weights"][name]
            if "word_embeddings" in name or "output_layer" in name:
                full = resize_vocab_rows(full, padded)
            expected = _shard_like(full, shard, name, tp, tp_rank)
            diff = max(diff, (shard - expected).abs().max().item())
        worst[f"tp{tp}pp{pp}"] = {"weights": diff, "pg_loss": metrics["pg_loss"]}
    return worst


def _shard_like(full: torch.Tensor, shard: torch.Tensor, name: str, tp: int, rank: int):
    from rlhf_megatron.models.megatron_layout import tp_chunk, tp_chunk_gated

    if full.shape == shard.shape:
        return full
    if name.endswith("linear_fc1.weight"):
        return tp_chunk_gated(full, tp=tp, rank=rank)
    dim = next(d for d in range(full.dim()) if full.shape[d] != shard.shape[d])
    return tp_chunk(full, tp=tp, rank=rank, dim=dim)


@pytest.mark.multirank
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_one_update_gives_the_same_weights_at_every_layout(hf_dir, aggregation):
    (reference,) = run_on_ranks(_reference_update_job, 1, (hf_dir, aggregation), timeout_s=300)
    per_rank = run_on_ranks(
        _layout_update_job, 2, (hf_dir, aggregation, reference), timeout_s=600
    )
    expected_loss = reference["metrics"]["pg_loss"]
    for worst in per_rank:
        for layout, result in worst.items():
            assert result["weights"] < TOLERANCE, f"{aggregation} {layout}: {result}"
            assert abs(result["pg_loss"] - expected_loss) < TOLERANCE, f"{layout}: {result}"
    # The step really changed the weights (a no-op update would pass trivially otherwise).
    assert reference["metrics"]["moved"] > 1e-3
    assert reference["metrics"]["pg_clipfrac"] > 0  # and the clipped branch was exercised
