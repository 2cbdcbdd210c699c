"""trainer.rollout_mode one_step_off and async through the real CLI, on split pools (one core for
vLLM, one for the actor at TP=1), on the quickstart task:

- one_step_off learns: mean reward of the last 10 steps >= MARGIN above the first 10;
- an async run on two engines survives the death of each (vLLM's engine process killed -9):
  the dead engine's groups go to the other, a replacement starts and joins at a refit (or at
  once, when no engine is left); one death more than rollout.engine_restarts ends the run within
  60 s with a one-line error;
- async with max_staleness=1 learns too, through those deaths and a resume: the resumed run
  trains every prompt exactly once (no prompt lost or repeated, from async_prompts.jsonl), and
  every trained group is at most 1 version stale. (The driver's error exit saves nothing, so the
  resume starts from what a kill -9 of the driver would leave too.)
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from rlhf_megatron.records.checkpoint_store import CheckpointStore
from rlhf_megatron.testing.train_runs import (
    RayHead,
    kill_mid_run,
    read_metrics,
    run_train,
    small_run_overrides,
    start_train,
    titled_processes,
    wait_until,
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


def _engine_processes(process) -> list[int]:
    """The pids of vLLM's engine processes, children of the run's AsyncRolloutWorkers."""
    return titled_processes("EngineCore", process.pid, parent_title="ray::AsyncRolloutWorker")


def _seen(run_dir: Path, **values: float) -> bool:
    """Some logged step has every metric at the given value (names with '/' as '__')."""
    return any(all(r.get(k.replace("__", "/")) == v for k, v in values.items())
               for r in read_metrics(run_dir))


def test_async_run_survives_dead_rollout_engines_then_resumes_and_learns(
        assets: Path, tmp_path: Path, head: RayHead) -> None:
    """Two async engines (issue 26 item 6), rollout.engine_restarts=2:
    1. engine B's vLLM process is killed -9 after step 8: the run goes on with engine A (steps
       logged with one live engine) while B's replacement starts, and B's groups go to A;
    2. A is killed too: with no engine live the run waits for B's replacement, refits it at
       once and goes on; A's replacement joins at a later refit (two live engines again);
    3. a third death is one more than allowed: the run ends within 60 s with a one-line error;
    4. the resumed run finishes: every prompt trained exactly once across it all, and it learns.
    """
    run_dir, log = tmp_path / "async", tmp_path / "engine_death.log"
    args = _overrides(assets, run_dir, "async", **{
        "trainer.max_staleness": 1, "trainer.save_every": 10, "rollout.engine_restarts": 2,
        "rollout.num_engines": 2, "resources.rollout_devices": 2,
        "resources.devices_per_node": 3})
    process = start_train(args, log)  # its own Ray cluster, as a user's run
    try:
        wait_until(lambda: len(read_metrics(run_dir)) >= 8, process, timeout=600)
        first = _engine_processes(process)
        assert len(first) == 2, first
        os.kill(first[1], signal.SIGKILL)
        wait_until(lambda: _seen(run_dir, rollout__engine_deaths=1, rollout__engines_live=1),
                   process, timeout=300)
        os.kill(first[0], signal.SIGKILL)
        wait_until(lambda: _seen(run_dir, rollout__engine_deaths=2, rollout__engines_live=2),
                   process, timeout=600)
    except BaseException:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    line = kill_mid_run(process, run_dir, log, count=2, after_steps=1, timeout=60,
                        victims=lambda: _engine_processes(process))
    # One line, naming the dead engine (seen by the stream, or by the actor's refit).
    assert line.startswith("rlhf-megatron: error:") and "rollout engine" in line \
        and "EngineDeadError" in line, line
    text = log.read_text()
    assert text.count("the replacement engine has the trainer's weights") == 2, text[-3000:]
    records = read_metrics(run_dir)
    assert any(r["rollout/requeued_groups"] > 0 for r in records)
    store = CheckpointStore(run_dir / "checkpoints", keep_last=2)
    saved = store.load_controller_state(store.latest())
    assert saved["step"] >= 10 and saved["async_stream"]["pending"], saved
    result = run_train([*args, "trainer.resume=auto"], timeout=900, head=head)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"at step {saved['step'] + 1}" in result.stderr
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    steps = _trained_keys(run_dir)
    keys = [k for step in range(1, STEPS + 1) for k in steps[step]]
    assert len(keys) == len(set(keys)) == STEPS * PROMPTS  # none repeated
    assert sorted(keys) == list(range(STEPS * PROMPTS))  # none lost
    first_mean, last_mean = window_means(records, "reward/mean", WINDOW)
    assert last_mean - first_mean >= MARGIN, (first_mean, last_mean)
    assert all(r["async/dropped_groups"] == 0.0 for r in records)
    assert all(max(int(k.rsplit("_", 1)[1]) for k in r if k.startswith("async/staleness_")
                   and k != "async/staleness_mean") <= 1 for r in records)
