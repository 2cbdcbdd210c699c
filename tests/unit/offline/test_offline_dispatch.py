"""SFT/DPO/KTO take the one step loop (controller/loop.py) with the offline source, build the
actor alone (no reference engine, no rollout), and validate_config takes the offline checks (no
rollout section needed)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from rlhf_megatron.config import load_config, validate_config
from rlhf_megatron.config.roles import megatron_roles

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


@pytest.mark.parametrize("alg", ["sft", "dpo", "kto"])
def test_offline_algorithms_take_the_one_loop_with_the_actor_alone(alg):
    from rlhf_megatron.controller.loop import build_source, offline_step, rl_step
    from rlhf_megatron.controller.offline_source import OfflineSource

    cfg = load_config(CONFIGS / f"quickstart_{alg}_cpu.yaml")
    assert cfg.is_offline and not cfg.uses_reference  # the reference is the actor's first pass
    assert isinstance(build_source(SimpleNamespace(cfg=cfg)), OfflineSource)
    assert offline_step is not rl_step
    assert [role for role, _ in megatron_roles(cfg)] == ["actor"]
    plan = validate_config(cfg, check_paths=False)
    assert plan.role_pool == {"actor": "shared"} and plan.total == 2  # no rollout devices


def test_rl_algorithms_keep_their_sources():
    from rlhf_megatron.controller.loop import build_source
    from rlhf_megatron.controller.sources import PromptSource

    cfg = load_config(CONFIGS / "quickstart_cpu.yaml")
    assert not cfg.is_offline and isinstance(build_source(SimpleNamespace(cfg=cfg)),
                                             PromptSource)
