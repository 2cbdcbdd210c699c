"""Critic values equal a hand-built reference (HF body hidden states @ head); reward-model scores
equal AutoModelForSequenceClassification's; the critic update trains; bad RM input is refused."""

from __future__ import annotations

import pytest
import torch

from rlhf_megatron.testing.multirank import run_on_ranks
from rlhf_megatron.testing.tiny_models import write_tiny_hf_checkpoint, write_tiny_hf_reward_model

TOLERANCE = 1e-5
LAYOUTS = [(2, 1), (1, 2)]


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


def _value_job(lm_dir: str, rm_dir: str) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from rlhf_megatron.engines import EngineConfig
    from rlhf_megatron.engines.critic import CriticEngine, RewardModelEngine
    from rlhf_megatron.parallel import ParallelDims, destroy_layout, initialize_layout

    batch = _batch()
    out = {}
    for tp, pp in LAYOUTS:
        dims = ParallelDims(dist.get_world_size(), tp=tp, pp=pp)
        initialize_layout(dims)
        config = EngineConfig(micro_batch_size=2, use_packing=pp == 1)
        rm = RewardModelEngine(config, hf_dir=rm_dir, dims=dims)
        scores = rm.score(batch)
        critic = CriticEngine(config, hf_dir=lm_dir, dims=dims)
        values = critic.compute_values(batch)
        head = [p for n, p in critic.named_parameters() if n.startswith("output_layer")]
        # The freshly initialised head lives on the last stage; share it for the reference.
        weight = head[0].detach().clone() if head else torch.zeros(1, 128)
        if pp > 1:
            dist.broadcast(weight, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                           group=parallel_state.get_pipeline_model_parallel_group())
        hidden = _hf_hidden(lm_dir, batch)
        expected = torch.nn.functional.pad((hidden @ weight.T)[..., 0][:, :-1], (1, 0))
        expected = expected * batch.loss_mask
        old_values = values.clone()
        returns = (old_values + torch.randn(values.shape, generator=torch.Generator().manual_seed(0)))
        metrics = critic.update_critic(
            batch.with_fields(values=old_values, returns=returns * batch.loss_mask)
        )
        after = critic.compute_values(batch)
        out[f"tp{tp}pp{pp}"] = {
            "scores": (scores - _hf_scores(rm_dir, batch)).abs().max().item(),
            "values": (values - expected).abs().max().item(),
            "value_scale": values.abs().max().item(),
            "vf_loss": metrics["vf_loss"],
            "moved": (after - values).abs().max().item(),
        }
        destroy_layout()
    return out


@pytest.mark.multirank
def test_critic_values_and_reward_scores_match_references(tmp_path):
    lm_dir = write_tiny_hf_checkpoint(tmp_path / "lm", "Qwen2ForCausalLM")
    rm_dir = write_tiny_hf_reward_model(tmp_path / "rm", "Qwen2ForCausalLM", seed=4)
    per_rank = run_on_ranks(_value_job, 2, (str(lm_dir), str(rm_dir)), timeout_s=600)
    for result in per_rank:
        for layout, r in result.items():
            assert r["scores"] < TOLERANCE, f"{layout}: {r}"
            assert r["values"] < TOLERANCE, f"{layout}: {r}"
            assert r["value_scale"] > 1e-3, f"{layout}: {r}"  # the head is not all zeros
            assert r["vf_loss"] > 0 and r["moved"] > 1e-6, f"{layout}: {r}"


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
