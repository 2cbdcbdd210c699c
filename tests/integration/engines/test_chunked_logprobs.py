"""The chunked read-out of log-probs and entropy (engines/chunked_logprobs.py) against the
unchunked one, in fp32 on CPU, in one 2-rank gloo job:

1. the function alone at TP1 and TP2 (a padded vocabulary split over the ranks), with a
   temperature and top-k/top-p truncation on some positions: log-probs and entropy within 1e-6,
   and the gradients of hidden states and output weight of a loss that weighs both within 1e-6
   of their norm;
2. the actor engine with `logits_chunk_tokens` 5 against 0 at TP1 (DP2), TP2 dense with sampled
   rows (temperature 0.7, top-p 0.9), TP2 packed, PP2 with tied embeddings and
   CP2 packed with tied embeddings: `compute_logprobs` within 1e-6, and one policy update with
   an entropy bonus and a KL term moves every weight the same within 1e-6 of the largest move;
   and bf16 at TP2 with tied embeddings (Megatron hands the last stage's output back in fp32),
   within bf16 rounding.
   TP2 dense is the case that found Megatron's all-reduce of a non-contiguous gradient
   (chunked_logprobs._ContiguousGradient).

Each micro-batch holds several chunks of 5 positions and a partial last one, so a chunk boundary
off by one (a position scored twice or never) or a normaliser taken per chunk instead of per
position changes values the test compares.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_megatron.testing.batches import padded_prompt_batch
from rlhf_megatron.testing.layouts import Layout
from rlhf_megatron.testing.multirank import run_on_ranks
from rlhf_megatron.testing.tiny_models import write_tiny_hf_checkpoint

CHUNK = 5
VALUE_TOLERANCE = {"fp32": 1e-6}  # log-probs and entropy: |chunked - unchunked|
GRAD_TOLERANCE = {"fp32": 1e-6}  # gradients and weight moves: relative to the largest
# bf16: the same bf16 matmul per position, but a chunk of 5 rows may take another kernel (another
# fp32 accumulation order) than 26 rows, so a logit may round to the neighbouring bf16 value:
# 2^-8 x |logit| (~1 here), up to twice that in a log-prob (measured: 0). The weights are
# compared as exported, in bf16, and at lr 1000 they are about their own move: 2 bf16 ulps of the
# largest (measured: 0.0055 of the largest move, at the tied embedding).
VALUE_TOLERANCE["bf16"] = 2 * 2**-8
GRAD_TOLERANCE["bf16"] = 2 * 2**-8
# (layout, packing, sampled rows, tied embeddings, dtype) of the engine comparison
ENGINE_CASES = (
    (Layout(), False, False, False, "fp32"),
    (Layout(tp=2), False, True, False, "fp32"),
    (Layout(tp=2), True, False, False, "fp32"),
    (Layout(pp=2), False, False, True, "fp32"),
    (Layout(cp=2), True, False, True, "fp32"),
    (Layout(tp=2), False, False, True, "bf16"),
)
LR = 1000.0  # SGD: the move is lr x grad, far above the weights' own rounding


def _function_case(tp: int) -> dict[str, float]:
    """Chunked vs unchunked vocab-parallel read-out of random states on this layout."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from rlhf_megatron.data.sampling import SampledDistribution
    from rlhf_megatron.engines.chunked_logprobs import HiddenStates, score_positions
    from rlhf_megatron.parallel import ParallelDims, destroy_layout, initialize_layout

    initialize_layout(ParallelDims(dist.get_world_size(), tp=tp))
    rank = parallel_state.get_tensor_model_parallel_rank()
    vocab, padded, rows, seq, width = 75, 80, 3, 9, 16  # 27 positions: 5 chunks and 2 left
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(rows, seq, width, generator=g)
    weight = torch.randn(padded, width, generator=g) * 0.5
    targets = torch.randint(0, vocab, (rows, seq), generator=g)
    upstream = (torch.randn(rows, seq, generator=g), torch.randn(rows, seq, generator=g))
    # Row 0 untruncated at T = 1, row 1 tempered, row 2 tempered with top-k then top-p.
    sampling = SampledDistribution(torch.tensor([[1.0], [0.7], [1.3]]),
                                   torch.tensor([[1.0], [1.0], [0.9]]),
                                   torch.tensor([[-1], [-1], [20]]))
    local = weight.chunk(tp)[rank]
    out: dict[str, float] = {}
    grads = {}
    for chunk in (0, CHUNK):
        h = hidden.clone().requires_grad_()
        w = local.clone().requires_grad_()
        if chunk:
            output = HiddenStates(h, w, chunk)
        else:
            output = torch.nn.functional.linear(h, w)
        lp, ent = score_positions(output, targets, vocab_size=vocab, compute_entropy=True,
                                  sampling=sampling)
        ((lp * upstream[0]).sum() + (ent * upstream[1]).sum()).backward()
        grads[chunk] = (lp.detach(), ent.detach(), h.grad, w.grad)
    (lp0, ent0, h0, w0), (lp1, ent1, h1, w1) = grads[0], grads[CHUNK]
    assert torch.isfinite(lp0).all() and bool((lp0 < 0).all())
    out["logprobs"] = (lp1 - lp0).abs().max().item()
    out["entropy"] = (ent1 - ent0).abs().max().item()
    out["hidden_grad"] = ((h1 - h0).abs().max() / h0.abs().max()).item()
    out["weight_grad"] = ((w1 - w0).abs().max() / w0.abs().max()).item()
    destroy_layout()
    return out


def _engine_job(hf_dirs: dict[bool, str], batch) -> dict:
    import torch.distributed as dist

    from rlhf_megatron.engines import (
        ActorEngine,
        EngineConfig,
        OptimizerSettings,
        PolicyUpdateSettings,
    )
    from rlhf_megatron.parallel import destroy_layout, initialize_layout
    from rlhf_megatron.refit import iter_hf_tensors

    results: dict = {"function": {tp: _function_case(tp) for tp in (1, 2)}, "engine": {}}
    for layout, packing, sampled, tied, dtype in ENGINE_CASES:
        initialize_layout(layout.dims(dist.get_world_size()))
        rows = batch
        if sampled:
            count = batch.input_ids.shape[0]
            rows = batch.with_fields(temperature=torch.full((count,), 0.7),
                                     top_p=torch.full((count,), 0.9),
                                     top_k=torch.full((count,), -1, dtype=torch.long))
        settings = PolicyUpdateSettings(entropy_coeff=0.1, kl_loss_coeff=0.5,
                                        kl_loss_kind="low_var_kl")
        seen = {}
        for chunk in (0, CHUNK):
            config = EngineConfig(micro_batch_size=2, use_packing=packing, dtype=dtype,
                                  logits_chunk_tokens=chunk,
                                  optimizer=OptimizerSettings(name="sgd", lr=LR, clip_grad=0.0))
            engine = ActorEngine(config, hf_dir=hf_dirs[tied], dims=layout.dims(
                dist.get_world_size()))
            values = engine.compute_logprobs(rows, with_entropy=True)
            if chunk == 0:  # the update's inputs, from the unchunked engine
                mask = rows.loss_mask.float()
                g = torch.Generator().manual_seed(3)
                lp = values["logprobs"]
                rows = rows.with_fields(
                    old_logprobs=(lp + 0.1 * torch.randn(lp.shape, generator=g)) * mask,
                    ref_logprobs=(lp + 0.3 * torch.randn(lp.shape, generator=g)) * mask,
                    advantages=torch.randn(lp.shape, generator=g) * mask)
            before = {t.name: t.tensor.clone() for t in iter_hf_tensors(engine)}
            metrics = engine.update_policy(rows, settings)
            after = {t.name: t.tensor.clone() for t in iter_hf_tensors(engine)}
            seen[chunk] = (values, {n: after[n] - before[n] for n in after}, metrics)
            del engine
        (v0, d0, m0), (v1, d1, m1) = seen[0], seen[CHUNK]
        # Each stage's sender exports its own tensors (none on a DP replica): the test merges.
        results["engine"][(layout.name, packing, sampled, tied, dtype)] = {
            "logprobs": (v1["logprobs"] - v0["logprobs"]).abs().max().item(),
            "entropy": (v1["entropy"] - v0["entropy"]).abs().max().item(),
            "weight_diff": {n: (d1[n] - d0[n]).abs().max().item() for n in d0},
            "moved": {n: d0[n].abs().max().item() for n in d0},
            "entropy_metric": (m0["entropy"], m1["entropy"]),
        }
        destroy_layout()
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("chunked")
    hf_dirs = {tied: str(write_tiny_hf_checkpoint(root / f"hf_tied{int(tied)}",
                                                  "Qwen2ForCausalLM", tie_word_embeddings=tied))
               for tied in (False, True)}
    batch = padded_prompt_batch(torch.Generator().manual_seed(11), rows=4, seq=14)
    return run_on_ranks(_engine_job, 2, (hf_dirs, batch), timeout_s=600)


@pytest.mark.multirank
@pytest.mark.parametrize("tp", [1, 2])
def test_chunked_readout_equals_unchunked(results, tp):
    for rank in results:
        diffs = rank["function"][tp]
        print(f"tp{tp}: {diffs}")
        assert diffs["logprobs"] < VALUE_TOLERANCE["fp32"], diffs
        assert diffs["entropy"] < VALUE_TOLERANCE["fp32"], diffs
        assert diffs["hidden_grad"] < GRAD_TOLERANCE["fp32"], diffs
        assert diffs["weight_grad"] < GRAD_TOLERANCE["fp32"], diffs


@pytest.mark.multirank
@pytest.mark.parametrize("case", ENGINE_CASES,
                         ids=lambda c: f"{c[0].name}{'-packed' * c[1]}{'-sampled' * c[2]}"
                                       f"{'-tied' * c[3]}-{c[4]}")
def test_chunked_engine_logprobs_and_update_equal_unchunked(results, case):
    layout, packing, sampled, tied, dtype = case
    weight_diff, moved = {}, {}
    for rank in results:
        found = rank["engine"][(layout.name, packing, sampled, tied, dtype)]
        assert found["logprobs"] < VALUE_TOLERANCE[dtype], found
        assert found["entropy"] < VALUE_TOLERANCE[dtype], found
        weight_diff.update(found["weight_diff"])
        moved.update(found["moved"])
    largest = max(moved.values())
    worst = max(weight_diff.values()) / largest
    print(f"{layout.name} packed={packing} sampled={sampled} tied={tied} {dtype}: log-probs "
          f"{found['logprobs']:.2g}, entropy {found['entropy']:.2g}, weight moves {worst:.2g} of "
          f"the largest ({largest:.3g}), entropy metric {found['entropy_metric']}")
    assert largest > 1e-3  # the update moved the weights
    off = sorted(weight_diff, key=lambda n: -weight_diff[n] / max(moved[n], 1e-30))[:3]
    assert worst < GRAD_TOLERANCE[dtype], [(n, weight_diff[n], moved[n]) for n in off]
    # Every weight was compared, the output layer's among them (tied: the embedding).
    assert "lm_head.weight" in moved or tied
    assert "model.embed_tokens.weight" in moved
