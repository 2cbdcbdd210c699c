"""End to end on CPU through the real CLI: Ray (local), a Megatron actor at TP=2 over gloo, a
vLLM-CPU rollout engine, refit after every update. A few steps each of GRPO, PPO with a critic,
and split pools."""

from __future__ import annotations

from pathlib import Path

import pytest
from controller_harness import REPO, read_metrics, run_train, small_run_overrides

from rlhf_megatron.quickstart import prepare
from rlhf_megatron.testing.tiny_models import write_tiny_hf_reward_model

PPO_CONFIG = REPO / "configs" / "quickstart_ppo_cpu.yaml"


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare(tmp_path_factory.mktemp("quickstart_assets"))


def _check_common(run_dir: Path, steps: int) -> list[dict]:
    records = _check_common_scores(run_dir, steps)
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in records)
    return records


def _check_common_scores(run_dir: Path, steps: int) -> list[dict]:
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for r in records:        # vLLM scored the sampled tokens with the weights the trainer has: refit happened.
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
        "trainer.save_every": 3, "actor.engine.micro_batch_size": 8,
        "critic.engine.micro_batch_size": 8}), config=PPO_CONFIG)
    assert result.returncode == 0, result.stderr[-3000:]
    records = _check_common(run_dir, 3)
    for r in records:
        assert "critic/vf_loss" in r and r["critic/grad_norm"] > 0
        assert "kl/coef" in r
    # The adaptive controller moved the coefficient (KL below target: it shrinks).
    assert records[0]["kl/coef"] == pytest.approx(0.001)
    assert records[2]["kl/coef"] < records[0]["kl/coef"]
    assert (run_dir / "checkpoints" / "step_00000003" / "critic").is_dir()


def test_grpo_with_reward_model(assets: Path, tmp_path: Path) -> None:
    reward_model = write_tiny_hf_reward_model(tmp_path / "rm", "LlamaForCausalLM", seed=3)
    run_dir = tmp_path / "rm_run"
    result = run_train(small_run_overrides(assets, run_dir, **{
        "reward_model.path": reward_model, "trainer.total_steps": 2, "trainer.val_every": 0}))
    assert result.returncode == 0, result.stderr[-3000:]
    records = _check_common_scores(run_dir, 2)
    # Scores of a random value head, not 0/1 exact-match rewards.
    assert all(r["reward/std"] > 0 and r["reward/mean"] not in (0.0, 1.0) for r in records)


def test_split_pools(assets: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "split"
    result = run_train(small_run_overrides(assets, run_dir, **{
        "resources.mode": "split", "resources.devices_per_node": 3, "ray.num_cpus": 3,
        "trainer.total_steps": 2, "trainer.val_every": 0}))
    assert result.returncode == 0, result.stderr[-3000:]
    _check_common(run_dir, 2)
    assert "pools {'actor': 2, 'rollout': 1} (split)" in result.stderr


def test_refit_by_broadcast_to_two_engines(assets: Path, tmp_path: Path) -> None:
    """The cross-node refit path (torch.distributed broadcast, one group per engine), forced on
    one machine, feeding two vLLM engines."""
    run_dir = tmp_path / "broadcast"
    result = run_train(small_run_overrides(assets, run_dir, **{
        "rollout.refit_transport": "broadcast", "rollout.num_engines": 2,
        "trainer.total_steps": 2, "trainer.val_every": 0}))
    assert result.returncode == 0, result.stderr[-3000:]
    _check_common(run_dir, 2)
