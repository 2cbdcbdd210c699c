"""Critic values equal a hand-built reference (HF body hidden states @ head); reward-model scores
equal AutoModelForSequenceClassification's; one critic update (SGD) at TP2 and at PP2 gives the
weights, values and loss of the same update at TP1; bad RM input is refused."""

from __future__ import annotations

import pytest
import torch

from rlhf_megatron.testing.layouts import CRITIC
from rlhf_megatron.testing.multirank import run_on_ranks
from rlhf_megatron.testing.tiny_models import write_tiny_hf_checkpoint, write_tiny_hf_reward_model

TOLERANCE = 1e-5
HIDDEN = 128  # write_tiny_hf_checkpoint's hidden size: each value is a 128-term dot product
FP32_EPS = torch.finfo(torch.float32).eps  # 1.19e-7


def after_step_tolerance(scale: float) -> float:
    """How far the values after the TP2/PP2 step may be from the TP1 step's: HIDDEN x eps x scale.

    Each value is hidden state @ head, a HIDDEN-term fp32 sum whose terms came through the model
    sharded differently (TP2 splits the row-parallel sums and all-reduces the halves), so its
    round-off is bounded by HIDDEN x eps x the sum of |terms| (Higham, gamma_n), taken here as the
    largest value after the step (`scale`). The SGD step at lr 0.5 moves the values by up to 8.3,
    to 8.49, so the bound is 1.3e-4 while the step's own size is 8.3. Measured at TP2: 1.0e-5 on
    AVX-512/AMX, 2.9e-6 with the AVX2 cap (PP2: 0, the same sums as TP1). The old absolute 1e-5
    (1.2e-6 relative at 8.49, 10 eps) failed on AVX-512 (1.0014e-5). The weights, values and
    scores before the step stay at 1e-5 absolute (scales 1.3 and 1.7; measured <= 9.5e-7 on
    both ISAs). Planted: the TP2 loss scaled by 1.001 moves after_vs_tp1 to 4.9e-3 (weights 3e-4).
    """
    return HIDDEN * FP32_EPS * scale


def _batch():
    from rlhf_megatron.data.batch import TokenBatch

    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 300, (4, 10), generator=g)
    attn = torch.ones_like(ids)
    attn[0, 7:] = 0
    attn[2, 5:] = 0
    loss_mask = attn.clone()
    loss_mask[:, :3] = 0
    return TokenBatch(ids * attn, attn, loss_mask)


def _hf_hidden(hf_dir: str, batch) -> torch.Tensor:
    import transformers

    model = transformers.AutoModel.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state


def _hf_scores(rm_dir: str, batch) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(rm_dir)
    with torch.no_grad():
        return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, 0]


def _critic_config(packing: bool):
    from rlhf_megatron.engines import EngineConfig, OptimizerSettings

    # SGD without clipping keeps the update linear in the gradient, so comparing weights at 1e-5
    # compares the gradients themselves (Adam's first step ~ lr * sign(g) would amplify round-off).
    return EngineConfig(micro_batch_size=2, use_packing=packing,
                        optimizer=OptimizerSettings(name="sgd", lr=0.5, clip_grad=0.0))


def _critic_update(critic, batch) -> dict:
    """One update towards random returns; the values before and after, metrics, new weights."""
    from megatron.core import parallel_state

    values = critic.compute_values(batch)
    returns = values + torch.randn(values.shape, generator=torch.Generator().manual_seed(0))
    metrics = critic.update_critic(batch.with_fields(values=values,
                                                     returns=returns * batch.loss_mask))
    return {
        "values": values, "after": critic.compute_values(batch), "metrics": metrics,
        "weights": {name: p.detach().clone() for name, p in critic.named_parameters()},
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "padded_vocab": critic.args.padded_vocab_size,
    }


def _reference_critic_job(lm_dir: str) -> dict:
    """The same critic update at TP1/PP1 (one rank)."""
    from rlhf_megatron.engines.critic import CriticEngine
    from rlhf_megatron.parallel import ParallelDims, destroy_layout, initialize_layout

    dims = ParallelDims(1)
    initialize_layout(dims)
    result = _critic_update(CriticEngine(_critic_config(False), hf_dir=lm_dir, dims=dims), _batch())
    destroy_layout()
    return result


def _weights_diff(result: dict, reference: dict, tp: int) -> float:
    """Max |weight - reference| over this rank's shards (vocab rows padded as at this layout)."""
    from rlhf_megatron.models.megatron_layout import resize_vocab_rows, tp_chunk, tp_chunk_gated

    worst = 0.0
    for name, shard in result["weights"].items():
        full = reference["weights"][name]
        if "word_embeddings" in name:
            full = resize_vocab_rows(full, result["padded_vocab"])
        if full.shape != shard.shape:
            if name.endswith("linear_fc1.weight"):
                full = tp_chunk_gated(full, tp=tp, rank=result["tp_rank"])
            else:
                dim = next(d for d in range(full.dim()) if full.shape[d] != shard.shape[d])
                full = tp_chunk(full, tp=tp, rank=result["tp_rank"], dim=dim)
        worst = max(worst, (shard - full).abs().max().item())
    return worst


def _value_job(lm_dir: str, rm_dir: str, reference: dict) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from rlhf_megatron.engines import EngineConfig
    from rlhf_megatron.engines.critic import CriticEngine, RewardModelEngine
    from rlhf_megatron.parallel import destroy_layout, initialize_layout

    batch = _batch()
    out = {}
    for layout in CRITIC.layouts:
        tp, pp = layout.tp, layout.pp
        dims = layout.dims(dist.get_world_size())
        initialize_layout(dims)
        rm = RewardModelEngine(EngineConfig(micro_batch_size=2), hf_dir=rm_dir, dims=dims)
        scores = rm.score(batch)
        critic = CriticEngine(_critic_config(packing=pp == 1), hf_dir=lm_dir, dims=dims)
        head = [p for n, p in critic.named_parameters() if n.startswith("output_layer")]
        # The freshly initialised head lives on the last stage; share it for the reference.
        weight = head[0].detach().clone() if head else torch.zeros(1, 128)
        if pp > 1:
            dist.broadcast(weight, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                           group=parallel_state.get_pipeline_model_parallel_group())
        hidden = _hf_hidden(lm_dir, batch)
        expected = torch.nn.functional.pad((hidden @ weight.T)[..., 0][:, :-1], (1, 0))
        expected = expected * batch.loss_mask
        result = _critic_update(critic, batch)
        out[f"tp{tp}pp{pp}"] = {
            "scores": (scores - _hf_scores(rm_dir, batch)).abs().max().item(),
            "values": (result["values"] - expected).abs().max().item(),
            "value_scale": result["values"].abs().max().item(),
            "vf_loss": result["metrics"]["vf_loss"],
            "weights_vs_tp1": _weights_diff(result, reference, tp),
            "after_vs_tp1": (result["after"] - reference["after"]).abs().max().item(),
        }
        destroy_layout()
    return out


@pytest.mark.multirank
def test_critic_values_and_reward_scores_match_references(tmp_path):
    (architecture,) = CRITIC.architectures
    lm_dir = write_tiny_hf_checkpoint(tmp_path / "lm", architecture)
    rm_dir = write_tiny_hf_reward_model(tmp_path / "rm", architecture, seed=4)
    (reference,) = run_on_ranks(_reference_critic_job, 1, (str(lm_dir),), timeout_s=300)
    per_rank = run_on_ranks(_value_job, 2, (str(lm_dir), str(rm_dir), reference), timeout_s=600)
    # The TP1 step is not a no-op: it moved the values far more than the tolerance.
    assert (reference["after"] - reference["values"]).abs().max().item() > 1e-2
    after_scale = reference["after"].abs().max().item()
    # Its loss is the value loss by hand: before the step the prediction is the old value, so
    # nothing clips and vf_loss = 0.5 * token-mean((value - return)^2) = 0.5 * mean(noise^2).
    noise, mask = torch.randn((4, 10), generator=torch.Generator().manual_seed(0)), _batch().loss_mask
    expected_loss = 0.5 * float((noise**2 * mask).sum() / mask.sum())
    assert abs(reference["metrics"]["vf_loss"] - expected_loss) < TOLERANCE, reference["metrics"]
    for result in per_rank:
        for layout, r in result.items():
            assert r["scores"] < TOLERANCE, f"{layout}: {r}"
            assert r["values"] < TOLERANCE, f"{layout}: {r}"
            assert r["value_scale"] > 1e-3, f"{layout}: {r}"  # the head is not all zeros
            assert abs(r["vf_loss"] - reference["metrics"]["vf_loss"]) < TOLERANCE, f"{layout}: {r}"
            assert r["weights_vs_tp1"] < TOLERANCE, f"{layout}: {r}"
            assert r["after_vs_tp1"] < after_step_tolerance(after_scale), f"{layout}: {r}"


def _rm_without_head_job(lm_dir: str) -> str:
    import torch.distributed as dist

    from rlhf_megatron.engines import EngineConfig
    from rlhf_megatron.engines.critic import RewardModelEngine
    from rlhf_megatron.errors import CheckpointError
    from rlhf_megatron.parallel import ParallelDims, destroy_layout, initialize_layout

    initialize_layout(ParallelDims(dist.get_world_size()))
    try:
        RewardModelEngine(EngineConfig(), hf_dir=lm_dir, dims=ParallelDims(1))
    except CheckpointError as exc:
        return str(exc)
    finally:
        destroy_layout()
    return "no error"


@pytest.mark.multirank
def test_reward_model_without_a_score_head_is_refused(tmp_path):
    lm_dir = write_tiny_hf_checkpoint(tmp_path / "lm", "LlamaForCausalLM")
    (message,) = run_on_ranks(_rm_without_head_job, 1, (str(lm_dir),), timeout_s=300)
    assert "has no score.weight" in message and "ForSequenceClassification" in message
