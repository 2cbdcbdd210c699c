"""Context parallelism without TE on CPU/gloo: one 4-rank launch checks several things.

1. The all-gather-KV SDPA attention (models/sdpa_cp.py) at cp=4, dense and packed, equals full
   causal attention on the whole sequences: outputs and the q/k/v gradients (the backward
   reduce-scatters dK/dV).
2. The actor engine at TP1/CP2, TP2/CP2 and CP2 x PP2 gives the log-probs and entropy of TP1/CP1
   (1e-5, fp32), of each row's sampled distribution (temperatures 0.7/1.3/1.0/0.6, one row cut
   by top-p 0.9, one by top-k 20); so do the critic's values. Rows of 13, 9, 11 and 6 tokens (none a multiple of
   2*cp = 4) in five micro-batchings: dense one row per micro-batch (each row padded at its end
   to a multiple of 4), dense two rows (the longer row's width padded), packed one row, packed
   all four rows in one sequence (each packed row padded to a multiple of 4: 16+12+12+8), and
   packed by a token budget that counts the padded lengths.
3. Two update steps (packed seq-mean-token-mean, then dense token-mean; SGD, so the update is
   linear in the gradient) give the weights of CP1 (1e-6) and the same pg_loss.
4. Refit: exactly one rank of the CP group sends (one per pipeline stage); a checkpoint saved at
   CP2 loads at CP1.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlhf_megatron.testing.layouts import CONTEXT_PARALLEL
from rlhf_megatron.testing.multirank import run_on_ranks
from rlhf_megatron.testing.tiny_models import write_tiny_hf_checkpoint

WORLD = CONTEXT_PARALLEL.ranks
# World ranks that send at refit (TP rank 0, DP x CP rank 0, one per pipeline stage).
SENDERS = {1: [True, False, False, False], 2: [True, False, True, False]}
# (name, engine settings): how the rows are cut into micro-batches and laid out.
MICRO_BATCHINGS = (
    ("dense1", {"micro_batch_size": 1}),
    ("dense2", {"micro_batch_size": 2}),
    ("packed1", {"micro_batch_size": 1, "use_packing": True}),
    ("packed4", {"micro_batch_size": 4, "use_packing": True}),
    ("budget", {"max_tokens_per_micro_batch": 28, "use_packing": True}),
)
LOGPROB_TOLERANCE = 1e-5
WEIGHT_TOLERANCE = 1e-6
ROW_LENGTHS = (13, 9, 11, 6)  # none a multiple of 2*cp = 4


# Each row's sampling settings (data/sampling.py): every engine pass divides the logits by the
# row's temperature and replays its top-k/top-p cut; under CP the packed rows' per-position
# settings are this rank's share of them (engines/actor.position_sampling), so CP must match CP1
# with them too. TEMPERED_GAP: their effect on the log-probs must be seen (measured ~1.0 nats).
SAMPLING = {"temperature": (0.7, 1.3, 1.0, 0.6), "top_p": (1.0, 1.0, 0.9, 1.0),
            "top_k": (-1, -1, -1, 20)}
TEMPERED_GAP = 0.05


def _batch(sampled: bool = True):
    from rlhf_megatron.data.batch import TokenBatch

    g = torch.Generator().manual_seed(3)
    seq = max(ROW_LENGTHS)
    ids = torch.randint(3, 300, (len(ROW_LENGTHS), seq), generator=g)
    attn = (torch.arange(seq) < torch.tensor(ROW_LENGTHS)[:, None]).long()
    loss_mask = attn.clone()
    loss_mask[:, :3] = 0  # the prompt
    old = torch.randn(ids.shape, generator=g) * 0.3 - 5.0
    advantages = torch.randn(ids.shape, generator=g)
    batch = TokenBatch(ids * attn, attn, loss_mask).with_fields(
        old_logprobs=old * loss_mask, advantages=advantages * loss_mask)
    if not sampled:
        return batch
    return batch.with_fields(temperature=torch.tensor(SAMPLING["temperature"]),
                             top_p=torch.tensor(SAMPLING["top_p"]),
                             top_k=torch.tensor(SAMPLING["top_k"]))


# ----------------------------------------------------------------------- 1. attention alone
def _attention_errors() -> dict[str, float]:
    """cp_attention over the 4-rank world vs sdpa_core_attention on the whole input."""
    import torch.distributed as dist

    from rlhf_megatron.data.packing import cp_token_indices
    from rlhf_megatron.models.sdpa_attention import _sdpa, sdpa_core_attention
    from rlhf_megatron.models.sdpa_cp import cp_attention

    group, cp, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    scale = 0.3
    errors = {}
    for name, lengths, shape in (("dense", [24], (24, 2)), ("packed", [8, 24, 16], (48,))):
        q = torch.randn(*shape, 4, 8, generator=g, dtype=torch.float64)
        k, v = (torch.randn(*shape, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
        grad_out = torch.randn(*shape, 32, generator=g, dtype=torch.float64)
        full = [t.clone().requires_grad_(True) for t in (q, k, v)]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        ref = sdpa_core_attention(*full, scale=scale, causal=True,
                                  cu_seqlens=cu if name == "packed" else None)
        ref.backward(grad_out)
        index = cp_token_indices(lengths, cp, rank)
        local = [t[index].clone().requires_grad_(True) for t in (q, k, v)]
        out = cp_attention(*local, scale=scale, group=group, sdpa=_sdpa,
                           cu_seqlens_padded=cu if name == "packed" else None)
        out.backward(grad_out[index])
        errors[f"{name}_out"] = (out - ref[index]).abs().max().item()
        for label, mine, theirs in zip("qkv", local, full):
            errors[f"{name}_d{label}"] = (mine.grad - theirs.grad[index]).abs().max().item()
    return errors


# ----------------------------------------------------------------------- 2-4. engines
def _engine_config(packing: bool):
    from rlhf_megatron.engines import EngineConfig, OptimizerSettings

    optimizer = OptimizerSettings(name="sgd", lr=0.5, clip_grad=0.0)
    return EngineConfig(micro_batch_size=1, use_packing=packing, optimizer=optimizer)


def _values(engine, critic) -> dict[str, torch.Tensor]:
    """Log-probs, entropy and critic values of the whole batch in every MICRO_BATCHING."""
    out = {}
    plain = engine.config
    for name, settings in MICRO_BATCHINGS:
        for eng in (engine, critic):
            eng.config = dataclasses.replace(plain, **settings)
        lp = engine.compute_logprobs(_batch(), with_entropy=True)
        out[f"logprobs_{name}"], out[f"entropy_{name}"] = lp["logprobs"], lp["entropy"]
        out[f"values_{name}"] = critic.compute_values(_batch())
    for eng in (engine, critic):
        eng.config = plain
    return out


def _tempered_gap(engine, tempered: torch.Tensor) -> float:
    """Max |`tempered` log-probs (the rows' sampling settings) - those without the settings| over
    the responses, at the engine's plain config (one row per micro-batch, as `dense1`)."""
    plain = _batch(sampled=False)
    untempered = engine.compute_logprobs(plain)["logprobs"]
    return ((tempered - untempered) * plain.loss_mask).abs().max().item()


def _updates(engine, dims) -> tuple[list[dict], dict]:
    """Two steps on this DP rank's share: packed seq-mean-token-mean, then dense token-mean."""
    from megatron.core import parallel_state

    from rlhf_megatron.engines import PolicyUpdateSettings

    share = _batch().chunk(dims.dp)[parallel_state.get_data_parallel_rank()]
    before = {name: p.detach().clone() for name, p in engine.named_parameters()}
    metrics = []
    for packing, aggregation in ((True, "seq-mean-token-mean"), (False, "token-mean")):
        engine.config = dataclasses.replace(engine.config, use_packing=packing)
        metrics.append(engine.update_policy(share, PolicyUpdateSettings(aggregation=aggregation)))
    after = {name: p.detach().clone() for name, p in engine.named_parameters()}
    metrics[0]["moved"] = max((after[n] - before[n]).abs().max().item() for n in after)
    return metrics, after


def _full_weights_diff(weights: dict, reference: dict, engine) -> float:
    """Max |shard - matching slice of the TP1 reference| over this rank's parameters."""
    from megatron.core import parallel_state

    from rlhf_megatron.models.megatron_layout import resize_vocab_rows, tp_chunk, tp_chunk_gated

    tp, rank = engine.dims.tp, parallel_state.get_tensor_model_parallel_rank()
    worst = 0.0
    for name, shard in weights.items():
        full = reference[name]
        if "word_embeddings" in name or "output_layer" in name:
            full = resize_vocab_rows(full, engine.args.padded_vocab_size)
        if full.shape != shard.shape:
            if name.endswith("linear_fc1.weight"):
                full = tp_chunk_gated(full, tp=tp, rank=rank)
            else:
                dim = next(d for d in range(full.dim()) if full.shape[d] != shard.shape[d])
                full = tp_chunk(full, tp=tp, rank=rank, dim=dim)
        worst = max(worst, (shard - full).abs().max().item())
    return worst


def _context_parallel_job(hf_dir: str, ckpt_dir: str) -> dict:
    import torch.distributed as dist

    from rlhf_megatron.engines import ActorEngine
    from rlhf_megatron.engines.critic import CriticEngine
    from rlhf_megatron.parallel import ParallelDims, destroy_layout, initialize_layout
    from rlhf_megatron.refit.export import is_stage_sender

    result = {"attention": _attention_errors(), "layouts": {}}
    reference = None
    for layout in CONTEXT_PARALLEL.layouts:
        tp, cp, pp = layout.tp, layout.cp, layout.pp
        dims = layout.dims(WORLD)
        initialize_layout(dims)
        engine = ActorEngine(_engine_config(False), hf_dir=hf_dir, dims=dims)
        critic = CriticEngine(_engine_config(False), hf_dir=hf_dir, dims=dims)
        values = _values(engine, critic)
        tempered_gap = _tempered_gap(engine, values["logprobs_dense1"])
        metrics, weights = _updates(engine, dims)
        senders = [None] * WORLD
        dist.all_gather_object(senders, is_stage_sender())
        if reference is None:
            reference = {"values": values, "metrics": metrics, "weights": weights}
        layout = {
            name: (values[name] - reference["values"][name]).abs().max().item() for name in values
        }
        layout["scored"] = {n: float(v.abs().sum()) for n, v in values.items()}
        layout["pg_loss"] = [m["pg_loss"] for m in metrics]
        layout["moved"] = metrics[0]["moved"]
        layout["tempered_gap"] = tempered_gap
        layout["weights"] = _full_weights_diff(weights, reference["weights"], engine)
        layout["senders"] = senders
        result["layouts"][f"tp{tp}cp{cp}pp{pp}"] = layout
        if (tp, cp, pp) == (1, 2, 1):
            saved = engine.save_checkpoint(ckpt_dir, step=1)
            cp2_weights = weights
        destroy_layout()
    # 4. The CP2 checkpoint at TP1/CP1/DP4.
    dims = ParallelDims(WORLD)
    initialize_layout(dims)
    engine = ActorEngine(_engine_config(False), hf_dir=hf_dir, dims=dims)
    engine.load_checkpoint(saved)
    loaded = {name: p.detach() for name, p in engine.named_parameters()}
    result["checkpoint_diff"] = max((loaded[n] - cp2_weights[n]).abs().max().item()
                                    for n in loaded)
    destroy_layout()
    return result


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp")
    hf_dir = str(write_tiny_hf_checkpoint(root / "hf", CONTEXT_PARALLEL.architectures[0]))
    return run_on_ranks(_context_parallel_job, WORLD, (hf_dir, str(root / "ckpt")),
                        timeout_s=600)


@pytest.mark.multirank
def test_cp_attention_equals_full_attention(results):
    for per_rank in results:
        for name, error in per_rank["attention"].items():
            assert error < 1e-12, f"{name}: {error}"  # float64


@pytest.mark.multirank
def test_cp_logprobs_entropy_values_and_update_equal_cp1(results):
    for layout, checks in results[-1]["layouts"].items():  # the last rank: a last stage
        worst = {kind: max(v for n, v in checks.items() if n.startswith(kind))
                 for kind in ("logprobs", "entropy", "values")}
        print(f"{layout} vs tp1cp1pp1 (rank 3): {worst}, weights {checks['weights']:.2g}, "
              f"tempered vs untempered {checks['tempered_gap']:.2g}")
    for rank, per_rank in enumerate(results):
        for layout, checks in per_rank["layouts"].items():
            where = f"rank {rank} {layout}"
            for name, scored in checks["scored"].items():
                assert scored > 1.0, f"{where}: {name} is all zeros"
                assert checks[name] < LOGPROB_TOLERANCE, f"{where}: {name} {checks[name]}"
            assert checks["weights"] < WEIGHT_TOLERANCE, f"{where}: weights {checks['weights']}"
            reference = per_rank["layouts"]["tp1cp1pp1"]
            assert checks["pg_loss"] == pytest.approx(reference["pg_loss"], abs=1e-6), where
            assert checks["moved"] > 1e-3, where  # the steps did move the weights
            assert checks["tempered_gap"] > TEMPERED_GAP, f"{where}: {checks['tempered_gap']}"


@pytest.mark.multirank
def test_cp_refit_sends_once_and_cp2_checkpoint_loads_at_cp1(results):
    for per_rank in results:
        for layout, checks in per_rank["layouts"].items():
            assert checks["senders"] == SENDERS[int(layout[-1])], layout
        assert per_rank["checkpoint_diff"] == 0.0
