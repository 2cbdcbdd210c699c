"""Issue 12 A, B, D on the CPU without Megatron ranks: when the distributed optimizer is chosen,
that offload releases the allocator's cache through the platform, and that a torch optimizer's
state initialised before a load steps exactly like a fresh one."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from rlhf_megatron.engines.config import OptimizerSettings, distributed_optimizer_enabled
from rlhf_megatron.engines.offload import Offloader
from rlhf_megatron.engines.optimizer_state import init_torch_optimizer_state
from rlhf_megatron.platform import Platform


# ------------------------------------------------------------------ A: the distributed optimizer
@dataclass(frozen=True)
class FakePlatform:
    supports_distributed_optimizer: bool


@pytest.mark.parametrize("name, requested, supported, expected", [
    ("adam", True, True, True),
    ("sgd", True, True, False),  # Megatron: "Only Adam and HybridDeviceOptimizer ... supported"
    ("adam", False, True, False),
    ("adam", True, False, False),
    ("sgd", True, False, False),
])
def test_distributed_optimizer_only_where_it_works(name, requested, supported, expected):
    settings = OptimizerSettings(name=name, use_distributed_optimizer=requested)
    assert distributed_optimizer_enabled(settings, FakePlatform(supported)) is expected


def test_distributed_optimizer_never_on_the_cpu_platform():
    assert not distributed_optimizer_enabled(OptimizerSettings(), Platform("cpu", "gloo"))


# ------------------------------------------------------------------ B: offload gives memory back
class RecordingPlatform:
    """Records, at each release, the sizes of the storages being offloaded."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors, self.releases = tensors, []

    def release_cached_memory(self) -> None:
        self.releases.append([t.untyped_storage().nbytes() for t in self.tensors])


def test_offload_releases_cached_memory_after_freeing_and_reports_bytes():
    tensors = [torch.randn(1000), torch.randn(10, 30), torch.arange(7)]
    copies = [t.clone() for t in tensors]
    platform = RecordingPlatform(tensors)
    offloader = Offloader(platform=platform)
    moved = offloader.offload(tensors + [tensors[0][:10]])  # a view: its storage counts once
    expected = sum(t.untyped_storage().nbytes() for t in copies)
    assert moved == expected == offloader.offloaded_bytes
    assert platform.releases == [[0, 0, 0]], "release must run once, after the storages are freed"
    offloader.onload()
    assert offloader.offloaded_bytes == 0 and len(platform.releases) == 1
    assert all(torch.equal(a, b) for a, b in zip(tensors, copies))


def test_platform_release_is_empty_cache_on_cuda_and_nothing_on_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    Platform("cpu", "gloo").release_cached_memory()
    assert calls == []
    Platform("cuda", "nccl").release_cached_memory()
    assert calls == [1]


def test_offload_on_cpu_still_drops_rss():
    psutil = pytest.importorskip("psutil")
    process = psutil.Process()
    big = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
    offloader = Offloader(platform=Platform("cpu", "gloo"))
    before = process.memory_info().rss
    moved = offloader.offload([big])
    dropped = before - process.memory_info().rss
    offloader.onload()
    assert moved == 64 << 20 and dropped > 0.5 * moved, (moved, dropped)
    assert int(big.sum()) == 64 << 20


# ------------------------------------------------------------------ D: state before the first step
def _model_and_grads(seed: int = 0) -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(5, 3, generator=g)),
              torch.nn.Parameter(torch.randn(3, generator=g))]
    grads = [[torch.randn(p.shape, generator=g) for p in params] for _ in range(2)]
    return params, grads


def _run(make_optimizer, init_first: bool) -> tuple[list[torch.Tensor], list[dict]]:
    params, grads = _model_and_grads()
    optimizer = make_optimizer(params)
    if init_first:
        init_torch_optimizer_state(optimizer)
    for step_grads in grads:
        for p, grad in zip(params, step_grads):
            p.grad = grad.clone()
        optimizer.step()
    return [p.detach().clone() for p in params], [dict(optimizer.state[p]) for p in params]


@pytest.mark.parametrize("make_optimizer", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.1),
], ids=["adamw", "adam-amsgrad", "sgd-momentum"])
def test_initialised_state_steps_exactly_like_a_fresh_optimizer(make_optimizer):
    fresh_params, fresh_state = _run(make_optimizer, init_first=False)
    init_params, init_state = _run(make_optimizer, init_first=True)
    assert all(torch.equal(a, b) for a, b in zip(fresh_params, init_params))
    for a, b in zip(fresh_state, init_state):
        assert sorted(a) == sorted(b)
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_initialised_adam_state_is_complete_and_existing_state_is_kept():
    params, _ = _model_and_grads()
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    init_torch_optimizer_state(optimizer)
    state = optimizer.state[params[0]]
    assert sorted(state) == ["exp_avg", "exp_avg_sq", "step"]
    assert float(state["step"]) == 0.0 and state["step"].device.type == "cpu"
    assert state["exp_avg"].shape == params[0].shape and not state["exp_avg"].any()
    state["exp_avg"].fill_(3.0)
    init_torch_optimizer_state(optimizer)
    assert torch.all(optimizer.state[params[0]]["exp_avg"] == 3.0)


def test_planner_does_not_shard_sgd_state_over_dp(monkeypatch):
    """The planner counts optimizer state as the engine builds it: SGD is never sharded."""
    from pathlib import Path

    from rlhf_megatron.config import load_config
    from rlhf_megatron.planner import Cluster, plan_config

    monkeypatch.chdir(Path(__file__).resolve().parents[2])

    def actor_bytes(*overrides: str) -> float:
        cfg = load_config("configs/qwen2.5-32b_grpo_2x8.yaml", [
            "actor.engine.optimizer.name=sgd", "actor.engine.optimizer.sgd_momentum=0.9",
            "actor.layout.tp=4", "actor.layout.dp=2", *overrides])
        return plan_config(cfg, Cluster(2, 8, 80)).roles["actor"].total

    assert actor_bytes("actor.engine.optimizer.use_distributed_optimizer=true") == actor_bytes(
        "actor.engine.optimizer.use_distributed_optimizer=false")
