"""The roles of a run, built in one place: which Megatron engines it builds (actor, critic,
reward model) and how many devices each role needs. Validation, device planning, the worker
groups and the planner all read these two functions."""

from __future__ import annotations

from typing import Any

from rlhf_megatron.config.schema import TrainConfig

MEGATRON_ROLES = ("actor", "critic", "reward_model")
"""Every Megatron role there is, in build order."""


def megatron_roles(cfg: TrainConfig) -> list[tuple[str, Any]]:
    """(role, config section) of every Megatron engine the run builds, in MEGATRON_ROLES order:
    the actor always (it also holds the reference), the critic for PPO, the reward model when
    reward_model.path is set. Each section has .layout and .engine."""
    present = {"actor": True, "critic": cfg.uses_critic, "reward_model": cfg.uses_reward_model}
    return [(role, getattr(cfg, role)) for role in MEGATRON_ROLES if present[role]]


def device_needs(cfg: TrainConfig) -> dict[str, int]:
    """Devices each role of the run needs: its layout's world size for a Megatron role,
    num_engines x tensor_parallel_size for the rollout."""
    needs = {"actor": cfg.actor.layout.world_size,
             "rollout": cfg.rollout.num_engines * cfg.rollout.engine.tensor_parallel_size}
    for role, section in megatron_roles(cfg)[1:]:
        needs[role] = section.layout.world_size
    return needs
