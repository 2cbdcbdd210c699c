"""The roles of a run, in one table: each Megatron engine role (actor, critic, reward model) with
the config section it reads, whether the run builds it, where its weights come from and whether
it trains; and how many devices each role needs. Validation, device planning, the worker groups
and the planner all read this table; the layers above key their own parts (a group's facade, a
worker's engine) by its names."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlhf_megatron.config.schema import TrainConfig


@dataclass(frozen=True)
class Role:
    """One Megatron engine role. `name` is also its TrainConfig section (.layout, .engine)."""

    name: str
    trained: bool
    """Its engine is updated, so it takes the run's seed (trainer.seed)."""
    in_run: Callable[[TrainConfig], bool]
    weights: Callable[[TrainConfig], str]
    """The HF directory or checkpoint its engine starts from."""


ACTOR = Role("actor", trained=True, in_run=lambda cfg: True,
                     weights=lambda cfg: cfg.model.path)
"""The actor also holds the reference when the algorithm uses one (workers/megatron_worker.py)."""
CRITIC = Role("critic", trained=True, in_run=lambda cfg: cfg.uses_critic,
                      weights=lambda cfg: cfg.critic.path or cfg.model.path)
REWARD_MODEL = Role("reward_model", trained=False,
                            in_run=lambda cfg: cfg.uses_reward_model,
                            weights=lambda cfg: cfg.reward_model.path)
ROLE_TABLE = (ACTOR, CRITIC, REWARD_MODEL)
"""Every Megatron role there is, in build order."""
MEGATRON_ROLES = tuple(role.name for role in ROLE_TABLE)
ROLLOUT = "rollout"
"""The rollout engines' role (vLLM, not Megatron): a pool and a worker group like the others."""


def roles_in_run(cfg: TrainConfig) -> list[Role]:
    """The Megatron roles the run builds, in ROLE_TABLE order: the actor always, the critic for
    PPO, the reward model when reward_model.path is set."""
    return [role for role in ROLE_TABLE if role.in_run(cfg)]


def megatron_roles(cfg: TrainConfig) -> list[tuple[str, Any]]:
    """(role name, config section) of every Megatron engine the run builds (roles_in_run). Each
    section has .layout and .engine."""
    return [(role.name, getattr(cfg, role.name)) for role in roles_in_run(cfg)]


def device_needs(cfg: TrainConfig) -> dict[str, int]:
    """Devices each role of the run needs: its layout's world size for a Megatron role,
    num_engines x tensor_parallel_size for the rollout."""
    needs = {ACTOR.name: cfg.actor.layout.world_size,
             ROLLOUT: cfg.rollout.num_engines * cfg.rollout.engine.tensor_parallel_size}
    for name, section in megatron_roles(cfg)[1:]:  # after the actor (a pool plan's order)
        needs[name] = section.layout.world_size
    return needs
