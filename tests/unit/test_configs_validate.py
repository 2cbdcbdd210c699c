"""Every configs/*.yaml loads and validates; each big-model config fits its cluster (`plan`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_megatron.config import load_config, validate_config
from rlhf_megatron.config.validate import model_hf_config
from rlhf_megatron.planner import Cluster, plan_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))

# config -> the cluster it is written for (nodes x GPUs per node, GiB per GPU)
BIG_MODELS = {
    "qwen2.5-32b_grpo_2x8.yaml": Cluster(2, 8, 80),
    "llama3.1-70b_ppo_8x8.yaml": Cluster(8, 8, 80),
    "qwen2.5-72b_grpo_8x8.yaml": Cluster(8, 8, 80),
}


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)  # paths in the configs are relative to the repository root


def test_the_big_model_configs_are_shipped():
    names = {path.name for path in CONFIGS}
    assert set(BIG_MODELS) <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[path.name for path in CONFIGS])
def test_config_loads_and_validates(path):
    cfg = load_config(path)
    validate_config(cfg, check_paths=False)


@pytest.mark.parametrize("name", sorted(BIG_MODELS))
def test_big_model_config_fits_its_cluster(name):
    cluster = BIG_MODELS[name]
    cfg = load_config(REPO / "configs" / name)
    assert (cfg.resources.nodes, cfg.resources.devices_per_node) == \
        (cluster.nodes, cluster.gpus_per_node)
    assert cfg.actor.engine.dtype == "bf16" and cfg.rollout.engine.dtype == "bfloat16"
    assert model_hf_config(cfg, check_paths=False) is not None  # the shipped config.json
    report = plan_config(cfg, cluster, suggest=False)
    assert report.fits, "\n".join(report.reasons())
