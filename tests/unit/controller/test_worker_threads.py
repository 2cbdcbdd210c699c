"""Threads follow the work: how many intra-op threads each worker takes while it computes
(ray_cluster.worker_threads), and that a worker drops back to one thread between calls
(workers/threads.py), even after vLLM has replaced torch.set_num_threads with a no-op."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlhf_megatron.cluster import ray_cluster
from rlhf_megatron.config import load_config
from rlhf_megatron.config.validate import plan_devices
from rlhf_megatron.workers.threads import on_cores

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "quickstart_cpu.yaml"


@pytest.fixture(autouse=True)
def _four_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray_cluster.os, "sched_getaffinity", lambda pid: set(range(4)),
                        raising=False)


def _threads(*overrides: str) -> dict[str, int]:
    cfg = load_config(CONFIG, overrides)
    plan = plan_devices(cfg)
    return {role: ray_cluster.worker_threads(cfg, plan, role) for role in plan.role_pool}


def test_colocated_phases_take_every_shared_core_in_turn() -> None:
    # 2 devices x 2 CPUs = 4 cores: the TP=2 actor's ranks split them, the engine takes all.
    assert _threads("resources.cpus_per_device=2") == {"actor": 2, "rollout": 4}
    assert _threads("resources.cpus_per_device=2", "actor.layout.tp=1",
                    "actor.layout.dp=1") == {"actor": 4, "rollout": 4}


def test_actor_and_critic_forwards_share_the_pool() -> None:
    threads = _threads("resources.cpus_per_device=2", "algorithm.name=ppo", "actor.layout.tp=1",
                       "critic.layout.tp=1")
    assert threads["actor"] == threads["critic"] == 2 and threads["rollout"] == 4


def test_split_pools_keep_their_own_cores() -> None:
    threads = _threads("resources.mode=split", "resources.devices_per_node=3",
                       "resources.cpus_per_device=1", "resources.actor_devices=2",
                       "resources.rollout_devices=1")
    assert threads == {"actor": 1, "rollout": 1}


def test_no_more_threads_than_the_machine_has() -> None:
    assert _threads("resources.cpus_per_device=8")["rollout"] == 4


class _Worker:
    def __init__(self, threads: int) -> None:
        self.threads = threads

    @on_cores
    def work(self) -> int:
        return torch.get_num_threads()


def test_a_call_runs_on_its_threads_then_gives_them_back(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # what vLLM's CPU worker does
    assert _Worker(3).work() == 3
    assert torch.get_num_threads() == 1


def test_a_fixed_count_overrides_and_a_bad_one_is_a_config_error() -> None:
    from rlhf_megatron.errors import ConfigError

    assert _threads("resources.cpus_per_device=2", "resources.worker_threads=1") == {
        "actor": 1, "rollout": 1}
    with pytest.raises(ConfigError, match="resources.worker_threads=0"):
        _threads("resources.worker_threads=0")
