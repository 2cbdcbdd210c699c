"""Combinations of the off-policy rollout modes that the one step loop runs (issue 26), each a
short run on split pools (one core each for the actor, the critic and vLLM):

- one_step_off PPO (a critic, GAE, KL in the reward) with validation every 2 steps, the driver
  killed -9 after step 5 and the run resumed from its step-4 checkpoint: every step is logged
  once, the critic trains every step, validation runs at steps 2, 4, 6 and 8, each batch is one
  version behind, and every prompt of the stream is trained exactly once across the kill;
- async with max_staleness 2 and validation every 3 steps: the engines run two batches ahead,
  groups up to 2 versions behind are trained, and what the staleness filter drops is counted and
  never trained.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlhf_megatron.records.checkpoint_store import CheckpointStore
from rlhf_megatron.testing.train_runs import (
    REPO,
    RayHead,
    kill_hard,
    read_metrics,
    run_train,
    small_run_overrides,
    start_train,
    wait_until,
)

STEPS = 8
PROMPTS = 4
SPLIT = {"resources.mode": "split", "resources.devices_per_node": 3,
         "resources.actor_devices": 1, "resources.rollout_devices": 1, "actor.layout.tp": 1}


def _trained_keys(run_dir: Path) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """step -> keys trained and step -> keys dropped, from the last record of each step (a
    resumed run re-runs the steps after its checkpoint)."""
    trained, dropped = {}, {}
    for line in (run_dir / "async_prompts.jsonl").read_text().splitlines():
        record = json.loads(line)
        trained[record["step"]], dropped[record["step"]] = record["keys"], record["dropped"]
    return trained, dropped


def test_one_step_off_ppo_with_validation_resumes_after_kill_9(
        assets: Path, tmp_path: Path, head: RayHead) -> None:
    run_dir = tmp_path / "ppo_one_step_off"
    overrides = small_run_overrides(assets, run_dir, **{
        "data.prompts_per_step": PROMPTS, "trainer.total_steps": STEPS, "trainer.val_every": 2,
        "trainer.save_every": 2, "trainer.rollout_mode": "one_step_off", **SPLIT,
        "resources.critic_devices": 1, "critic.layout.tp": 1,
        "actor.engine.micro_batch_size": 8, "critic.engine.micro_batch_size": 8})
    config = REPO / "configs" / "quickstart_ppo_cpu.yaml"
    # Its own Ray cluster: kill -9 of the driver takes it down, as a user's would.
    process = start_train(overrides, tmp_path / "killed.log", config)
    wait_until(lambda: len(read_metrics(run_dir)) >= 5, process, timeout=300)
    kill_hard(process)
    store = CheckpointStore(run_dir / "checkpoints", keep_last=2)
    saved = store.load_controller_state(store.latest())
    assert saved["step"] >= 4 and saved["async_stream"]["pending"], saved
    result = run_train([*overrides, "trainer.resume=auto"], timeout=600, config=config,
                       head=head)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"at step {saved['step'] + 1}" in result.stderr
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all("critic/vf_loss" in r and "kl/coef" in r for r in records), records[-1].keys()
    assert [r["step"] for r in records if "val/reward/mean" in r] == [2, 4, 6, 8]
    for r in records[1:]:  # one version behind; the resumed run regenerates its first batch
        lag = 0 if r["step"] == saved["step"] + 1 else 1  # with the restored weights
        assert r[f"async/staleness_{lag}"] == 1.0, r
    trained, dropped = _trained_keys(run_dir)
    keys = [k for step in range(1, STEPS + 1) for k in trained[step] + dropped[step]]
    assert len(keys) == len(set(keys)) == STEPS * PROMPTS  # none repeated
    assert sorted(keys) == list(range(STEPS * PROMPTS))  # none lost


def test_async_two_versions_ahead_counts_what_it_drops(
        assets: Path, tmp_path: Path, head: RayHead) -> None:
    run_dir = tmp_path / "async_staleness_2"
    overrides = small_run_overrides(assets, run_dir, **{
        "data.prompts_per_step": PROMPTS, "trainer.total_steps": STEPS, "trainer.val_every": 3,
        "trainer.rollout_mode": "async", "trainer.max_staleness": 2, **SPLIT,
        "resources.devices_per_node": 2})
    result = run_train(overrides, timeout=600, head=head)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    # Validation while the engines keep generating the batches ahead (greedy, held-out prompts).
    assert [r["step"] for r in records if "val/reward/mean" in r] == [3, 6]
    lags = [max(int(k.rsplit("_", 1)[1]) for k in r if k.startswith("async/staleness_")
                and k != "async/staleness_mean") for r in records]
    assert max(lags) == 2 and all(lag <= 2 for lag in lags), lags  # two batches ahead, no more
    trained, dropped = _trained_keys(run_dir)
    for r in records:
        assert r["async/dropped_groups"] == len(dropped[r["step"]]), r
    assert records[-1]["async/dropped_total"] == sum(len(d) for d in dropped.values())
    keys = [k for step in trained for k in trained[step] + dropped[step]]
    assert len(keys) == len(set(keys)) and sorted(keys) == list(range(len(keys)))
    assert not set(k for d in dropped.values() for k in d) & set(
        k for t in trained.values() for k in t)  # a dropped group is never trained
