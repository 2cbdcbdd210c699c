"""`plan_config(cfg, cluster)`: layout checks + memory estimate -> a PlanReport with a verdict.

    from rlhf_megatron.config import load_config
    from rlhf_megatron.planner import Cluster, plan_config
    report = plan_config(load_config("configs/qwen2.5-32b_grpo_2x8.yaml"), Cluster(2, 8, 80))
    print(report.fits, report.reasons())
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf_megatron.config.schema import TrainConfig
from rlhf_megatron.config.validate import model_hf_config
from rlhf_megatron.errors import ConfigError
from rlhf_megatron.planner.checks import check_all
from rlhf_megatron.planner.cluster import Cluster, Finding, on_cluster
from rlhf_megatron.planner.estimate import Phase, RoleMemory, estimate_memory
from rlhf_megatron.planner.shapes import ModelShape, read_shape


@dataclass(frozen=True)
class Suggestion:
    """A layout that fits: the overrides to apply, and its plan."""

    overrides: tuple[str, ...]
    report: PlanReport


@dataclass(frozen=True)
class PlanReport:
    cfg: TrainConfig
    """The config as planned (resources taken from the cluster)."""
    cluster: Cluster
    shapes: dict[str, ModelShape]
    findings: tuple[Finding, ...]
    roles: dict[str, RoleMemory] = field(default_factory=dict)
    """Empty when a layout error stopped the memory estimate."""
    phases: tuple[Phase, ...] = ()
    suggestion: Suggestion | None = None

    @property
    def fits(self) -> bool:
        return not self.errors()

    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    def reasons(self) -> list[str]:
        """One line per error: why it does not fit."""
        return [f"{f.where}: {f.message}" for f in self.errors()]


def model_shapes(cfg: TrainConfig) -> tuple[dict[str, ModelShape], Any]:
    """Shapes of the policy (actor, reference, rollout) and of the critic / reward model.

    The critic and the reward model read config.json from their own path when it is on this
    machine; otherwise they are assumed to have the policy's shape.
    """
    hf = model_hf_config(cfg, check_paths=False)
    if hf is None:
        raise ConfigError("plan needs the model's config.json: set model.config_json (or a "
                          "model.path that exists on this machine)")
    hf.num_key_value_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    policy = ModelShape.from_hf(hf)
    shapes = {"actor": policy}
    for role, path in (("critic", cfg.critic.path), ("reward_model", cfg.reward_model.path)):
        config_json = Path(path) / "config.json" if path else None
        shapes[role] = read_shape(config_json) if config_json and config_json.is_file() \
            else policy
    return shapes, hf


def evaluate(cfg: TrainConfig, cluster: Cluster, shapes: dict[str, ModelShape],
             hf: Any) -> PlanReport:
    """Checks, then (when the layout is valid) the memory estimate; no layout search."""
    cfg = on_cluster(cfg, cluster)
    findings = check_all(cfg, cluster, shapes, hf)
    if any(f.level == "error" for f in findings):
        return PlanReport(cfg, cluster, shapes, tuple(findings))
    roles, phases, memory = estimate_memory(cfg, shapes, cluster)
    return PlanReport(cfg, cluster, shapes, tuple(findings + memory), roles, tuple(phases))
