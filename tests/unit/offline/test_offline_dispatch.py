"""`rlhf-megatron train` reaches the offline loop for sft/dpo/kto (controller/run.py dispatch),
and validate_config takes the offline checks (no rollout section needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_megatron.config import load_config, validate_config

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


@pytest.mark.parametrize("alg", ["sft", "dpo", "kto"])
def test_train_dispatches_offline_algorithms(alg, monkeypatch):
    import rlhf_megatron.offline.trainer as offline_trainer
    from rlhf_megatron.controller.run import train

    seen = []
    monkeypatch.setattr(offline_trainer, "train_offline", lambda cfg: seen.append(cfg) or "ran")
    cfg = load_config(CONFIGS / f"quickstart_{alg}_cpu.yaml")
    assert train(cfg) == "ran" and seen == [cfg]
    plan = validate_config(cfg, check_paths=False)
    assert plan.role_pool == {"actor": "shared"} and plan.total == 2  # no rollout devices
