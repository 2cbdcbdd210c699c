"""The rows' sampling settings travel with the batch (data/sampling.py): set where rollouts become
batches (the async engine's groups, episodes), one value per row, a step may mix temperatures;
greedy rows are refused for training, in config validation and in the engines."""

from __future__ import annotations

import pytest
import torch

from rlhf_megatron.config import validate_config
from rlhf_megatron.config.loader import load_config
from rlhf_megatron.data.sampling import sampled_distribution, sampling_fields
from rlhf_megatron.errors import ConfigError
from rlhf_megatron.rollout import SamplingSettings
from rlhf_megatron.rollout.async_batch import groups_to_batch, groups_to_result
from rlhf_megatron.rollout.async_engine import RolloutGroup, SampleRecord


def _group(key: int, sampling: SamplingSettings | None, n: int = 2) -> RolloutGroup:
    samples = [SampleRecord([7, 8], [-0.5, -0.25], [0, 0], "stop") for _ in range(n)]
    return RolloutGroup(key, [1, 2, 3], samples, 0, sampling)


def test_groups_carry_their_own_temperature_per_row() -> None:
    cold = SamplingSettings(temperature=0.6, top_p=0.9)
    hot = SamplingSettings(temperature=1.3, top_k=20)
    batch = groups_to_batch([_group(0, cold), _group(1, hot, n=3)])
    assert batch.temperature.tolist() == pytest.approx([0.6, 0.6, 1.3, 1.3, 1.3])
    assert batch.top_p.tolist() == pytest.approx([0.9, 0.9, 1.0, 1.0, 1.0])
    assert batch.top_k.tolist() == [-1, -1, 20, 20, 20]
    result = groups_to_result([_group(0, cold)], weight_version=2, first_prompt=4)
    assert result.batch.temperature.tolist() == pytest.approx([0.6, 0.6])


def test_groups_without_settings_are_not_mixed_with_groups_with_them() -> None:
    assert "temperature" not in groups_to_batch([_group(0, None)]).fields
    with pytest.raises(ValueError, match="without their sampling settings"):
        groups_to_batch([_group(0, SamplingSettings()), _group(1, None)])


def test_episodes_batch_carries_the_settings() -> None:
    """Both episode runners build their batch with episodes_to_batch(episodes, sampling)."""
    from rlhf_megatron.rollout.episodes import Episode, episodes_to_batch

    episodes = [Episode(i, 2, [1, 2, 3, 4], [0, 0, 1, 1], [0.0, 0.0, -1.0, -2.0], env=None)
                for i in range(2)]
    batch = episodes_to_batch(episodes, SamplingSettings(temperature=0.8, top_p=0.9))
    assert batch.temperature.tolist() == pytest.approx([0.8, 0.8])
    assert batch.top_p.tolist() == pytest.approx([0.9, 0.9]) and batch.top_k.tolist() == [-1, -1]


def test_sampled_distribution_reads_the_fields_and_refuses_greedy_rows() -> None:
    assert sampled_distribution({}) is None
    fields = sampling_fields(3, SamplingSettings(temperature=0.7, top_p=0.95, top_k=5))
    dist = sampled_distribution(fields)
    assert dist.temperature.tolist() == pytest.approx([0.7] * 3)
    assert dist.truncates(vocab_size=100) and not sampled_distribution(
        sampling_fields(3, SamplingSettings(temperature=0.7))).truncates(vocab_size=100)
    assert not sampled_distribution(
        sampling_fields(1, SamplingSettings(top_k=100))).truncates(vocab_size=100)
    fields["temperature"] = torch.tensor([0.7, 0.0, 0.7])
    with pytest.raises(ConfigError, match="temperature 0 \\(greedy\\)"):
        sampled_distribution(fields)


def test_training_at_temperature_zero_is_refused_in_validation() -> None:
    cfg = load_config(None, ["data.prompts_per_step=4", "rollout.sampling.n=4",
                             "rollout.sampling.temperature=0"])
    with pytest.raises(ConfigError) as info:
        validate_config(cfg, check_paths=False)
    message = str(info.value)
    assert message.startswith("rollout.sampling: temperature=0.0 is greedy decoding")
    assert "\n" not in message
    # validation decoding at T = 0 is fine: it never trains
    validate_config(load_config(None, ["data.prompts_per_step=4", "rollout.sampling.n=4",
                                       "rollout.val_sampling.temperature=0"]), check_paths=False)
