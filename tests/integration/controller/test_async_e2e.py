"""trainer.rollout_mode one_step_off and async through the real CLI, on split pools (one core for
vLLM, one for the actor at TP=1), on the quickstart task:

- one_step_off learns: mean reward of the last 10 steps >= MARGIN above the first 10;
- a dead rollout engine (vLLM's engine process killed -9) ends an async run within 60 s with a
  one-line error;
- async with max_staleness=1 learns too, through that crash and a resume: the resumed run trains
  every prompt exactly once (no prompt lost or repeated, from async_prompts.jsonl), and every
  trained group is at most 1 version stale. (One run crashes for both: the driver's error exit
  saves nothing, so the resume starts from what a kill -9 of the driver would leave too.)
"""

from __future__ import annotations

import json
from pathlib import Path

from rlhf_megatron.controller.checkpoint_store import CheckpointStore
from rlhf_megatron.testing.train_runs import (
    RayHead,
    kill_mid_run,
    read_metrics,
    run_train,
    small_run_overrides,
    start_train,
    titled_processes,
    window_means,
)

# `assets` (the quickstart's) and `head` (a shared Ray cluster): tests/integration/conftest.py

# Mean reward of steps 1-10 -> 111-120, measured (session 5, 250-step runs cut to 120):
# one_step_off 0.048 -> 0.249 (+0.20), async across the kill 0.049 -> 0.227 (+0.18); the rise is
# steady (+0.08 by step 60, +0.34 by step 250). A policy that does not learn moves a 10-step
# window of 256 samples by ~0.006 (std of one step's mean ~0.013 at p = 0.05), so MARGIN sits
# ~15 noise widths up and at about half the smaller measured rise.
STEPS = 120
WINDOW = 10
MARGIN = 0.1
PROMPTS = 16
SPLIT = {"resources.mode": "split", "resources.devices_per_node": 2,
         "resources.actor_devices": 1, "resources.rollout_devices": 1, "actor.layout.tp": 1}


def _overrides(assets: Path, run_dir: Path, mode: str, **extra: object) -> list[str]:
    return small_run_overrides(assets, run_dir, **{
        "data.prompts_per_step": PROMPTS, "rollout.sampling.n": 16,
        "actor.engine.micro_batch_size": 256,
        "trainer.total_steps": STEPS, "trainer.val_every": 0, "trainer.seed": 1,
        "trainer.rollout_mode": mode, **SPLIT, **extra})


def test_one_step_off_learns(assets: Path, tmp_path: Path, head: RayHead) -> None:
    run_dir = tmp_path / "one_step_off"
    result = run_train(_overrides(assets, run_dir, "one_step_off"), timeout=900, head=head)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    first, last = window_means(records, "reward/mean", WINDOW)
    assert last - first >= MARGIN, (first, last)
    # One version behind after the first step, never a token of two versions (no partial).
    assert all(r["async/staleness_1"] == 1.0 for r in records[1:])
    assert all(r["async/partial_frac"] == 0.0 for r in records)


def _trained_keys(run_dir: Path) -> dict[int, list[int]]:
    """step -> keys trained, the last record of each step (a resumed run re-runs some)."""
    steps: dict[int, list[int]] = {}
    for line in (run_dir / "async_prompts.jsonl").read_text().splitlines():
        record = json.loads(line)
        steps[record["step"]] = record["keys"] + record["dropped"]
    return steps


def test_dead_rollout_engine_ends_an_async_run_which_resumes_and_learns(
        assets: Path, tmp_path: Path, head: RayHead) -> None:
    run_dir, log = tmp_path / "async", tmp_path / "engine_death.log"
    args = _overrides(assets, run_dir, "async", **{"trainer.max_staleness": 1,
                                                    "trainer.save_every": 10})
    process = start_train(args, log)  # its own Ray cluster, as a user's run
    # vLLM's engine process, a child of the run's AsyncRolloutWorker, once 25 steps are logged.
    line = kill_mid_run(process, run_dir, log, count=1, after_steps=25, timeout=600,
                        victims=lambda: titled_processes("EngineCore", process.pid,
                                                         parent_title="ray::AsyncRolloutWorker"))
    # One line, naming the dead engine (seen by the rollout worker, or by the actor's refit).
    assert line.startswith("rlhf-megatron: error:") and "rollout engine" in line \
        and "EngineDeadError" in line, line
    store = CheckpointStore(run_dir / "checkpoints", keep_last=2)
    saved = store.load_controller_state(store.latest())
    assert saved["step"] >= 20 and saved["async_stream"]["pending"], saved
    result = run_train([*args, "trainer.resume=auto"], timeout=900, head=head)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"at step {saved['step'] + 1}" in result.stderr
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    steps = _trained_keys(run_dir)
    keys = [k for step in range(1, STEPS + 1) for k in steps[step]]
    assert len(keys) == len(set(keys)) == STEPS * PROMPTS  # none repeated
    assert sorted(keys) == list(range(STEPS * PROMPTS))  # none lost
    first, last = window_means(records, "reward/mean", WINDOW)
    assert last - first >= MARGIN, (first, last)
    assert all(r["async/dropped_groups"] == 0.0 for r in records)
    assert all(max(int(k.rsplit("_", 1)[1]) for k in r if k.startswith("async/staleness_")
                   and k != "async/staleness_mean") <= 1 for r in records)
