"""When the controller skips the actor's old-log-prob forward (phases.on_policy_shortcut): only
when the batch gets one optimizer step and nothing reads the old log-probs before or besides
the update."""

from __future__ import annotations

import dataclasses

import pytest

from rlhf_megatron.algorithms import PolicyLossConfig, RolloutCorrectionConfig
from rlhf_megatron.config import TrainConfig
from rlhf_megatron.controller.phases import on_policy_shortcut


def _cfg(**algorithm) -> TrainConfig:
    cfg = TrainConfig()
    return dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, **algorithm))


def test_one_step_per_batch_takes_the_shortcut() -> None:
    assert on_policy_shortcut(_cfg(mini_batches=1, kl_mode="loss"))
    assert on_policy_shortcut(_cfg(mini_batches=1, kl_mode="none"))


@pytest.mark.parametrize("algorithm", [
    dict(mini_batches=2),  # the second mini-batch's old policy is not the current one
    dict(kl_mode="reward"),  # the KL penalty reads old log-probs before the update
    dict(policy_loss_config=PolicyLossConfig(tis_cap=2.0)),  # TIS: old vs behaviour
    dict(rollout_correction=RolloutCorrectionConfig(is_level="token")),
], ids=["two-mini-batches", "kl-as-reward", "tis", "rollout-correction"])
def test_anything_that_needs_the_old_policy_keeps_the_forward(algorithm: dict) -> None:
    assert not on_policy_shortcut(_cfg(**algorithm))
