"""Qwen3-30B-A3B GRPO on ONE node of 8 x 80 GB: it fits only with the optimizer on the host
(`actor.engine.optimizer.cpu_offload`, Megatron's optimizer_cpu_offload); the planner drops the
master weights and Adam moments from the GPU then. Not run on a GPU here (docs/MOE.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_megatron.config import load_config
from rlhf_megatron.engines import OptimizerSettings
from rlhf_megatron.errors import ConfigError
from rlhf_megatron.planner import Cluster, plan_config
from rlhf_megatron.planner.memory import GIB

REPO = Path(__file__).resolve().parents[2]
CONFIG = "configs/qwen3-30b-a3b_grpo_1x8.yaml"
ONE_NODE = Cluster(1, 8, 80)


# config_json paths are relative to the working directory
pytestmark = pytest.mark.usefixtures("repo_cwd")


def test_one_node_config_fits_with_the_optimizer_on_the_host():
    report = plan_config(load_config(CONFIG, []), ONE_NODE)
    assert report.fits, report.reasons()
    assert report.roles["actor"].optimizer == 0
    assert max(p.total for p in report.phases) <= 80 * GIB


def test_one_node_config_does_not_fit_without_it():
    report = plan_config(load_config(CONFIG, ["actor.engine.optimizer.cpu_offload=false"]),
                         ONE_NODE)
    assert not report.fits
    assert report.roles["actor"].optimizer > 40 * GIB  # experts' Adam state on one GPU each


@pytest.mark.parametrize("fields", [{"name": "sgd"}, {"use_distributed_optimizer": False}])
def test_cpu_offload_needs_adam_and_the_distributed_optimizer(fields):
    with pytest.raises(ConfigError, match="optimizer.cpu_offload needs"):
        OptimizerSettings(cpu_offload=True, **fields).validate()
