"""Faults through the real CLI: kill -9 mid-run, during a checkpoint save, then resume (the
previous checkpoint loads, a step logged but not checkpointed is redone, and the metrics equal the
uninterrupted run's), a Ray worker killed mid-step (the run ends within 60 s naming it), and bad
inputs (one line, non-zero exit)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from rlhf_megatron.records.checkpoint_store import CheckpointStore
from rlhf_megatron.testing.processes import leaked_refit_segments, refit_segments
from rlhf_megatron.testing.train_runs import (
    RayHead,
    kill_hard,
    kill_mid_run,
    last_line,
    read_metrics,
    run_train,
    small_run_overrides,
    stable,
    start_train,
    titled_processes,
    train_in_process,
    wait_until,
)

# `assets` (the quickstart's) and `head` (a shared Ray cluster): tests/integration/conftest.py

STEPS = 4
# Warm-up then cosine decay: the lr differs every step, so a resume that rebuilt the scheduler
# instead of restoring it would log (and train with) another lr than the uninterrupted run.
SCHEDULE = {"actor.engine.optimizer.warmup_steps": 3,
            "actor.engine.optimizer.lr_decay_style": "cosine",
            "actor.engine.optimizer.total_steps": 10}


@pytest.fixture(scope="module")
def uninterrupted(assets: Path, head: RayHead,
                  tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    result = run_train(small_run_overrides(assets, run_dir, **{
        "trainer.total_steps": STEPS, "trainer.save_every": 1, "trainer.keep_last": 2,
        **SCHEDULE}), head=head)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return records


def _resume_and_compare(assets: Path, run_dir: Path, uninterrupted: list[dict],
                        first_resumed: int, head: RayHead) -> None:
    result = run_train(small_run_overrides(assets, run_dir, **{
        "trainer.total_steps": STEPS, "trainer.save_every": 1, "trainer.keep_last": 2,
        "trainer.resume": "auto", **SCHEDULE}), head=head)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"at step {first_resumed}" in result.stderr
    resumed = read_metrics(run_dir)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    for a, b in zip(uninterrupted, resumed, strict=True):
        assert stable(a) == stable(b), f"step {a['step']} differs after resume"
    # The lr after the first resumed step is the restored schedule's, not a fresh one's.
    lrs = [r["actor/lr"] for r in resumed]
    assert len(set(lrs)) == STEPS and lrs[first_resumed - 1] != lrs[0], lrs


def test_kill_mid_run_during_checkpoint_save_then_resume_is_exact(
        assets: Path, tmp_path: Path, head: RayHead, uninterrupted: list[dict]) -> None:
    """kill -9 while step 3's checkpoint is being written (one run covers what a kill at any
    other moment leaves on disk, plus a partial checkpoint): step 3 is logged but not
    checkpointed, so the resume redoes it from step 2's checkpoint."""
    run_dir = tmp_path / "killed_in_save"
    checkpoints = run_dir / "checkpoints"
    overrides = small_run_overrides(assets, run_dir, **{
        "trainer.total_steps": STEPS, "trainer.save_every": 1, "trainer.keep_last": 2,
        **SCHEDULE})
    # Its own Ray cluster (start_train): kill -9 of the driver takes it down, as a user's would.
    process = start_train(overrides, tmp_path / "killed_in_save.log")

    def saving_step_3() -> bool:
        return checkpoints.is_dir() and any(p.name.startswith(".tmp-step_00000003")
                                            for p in checkpoints.iterdir())

    wait_until(saving_step_3, process, timeout=240, poll=0.005)
    kill_hard(process)
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]
    store = CheckpointStore(checkpoints, keep_last=2)
    assert store.latest().name == "step_00000002"
    assert store.load_controller_state(store.latest())["step"] == 2
    # The previous checkpoint loads (engines, loader, rollout weights) and the run goes on
    # exactly as if nothing had happened.
    _resume_and_compare(assets, run_dir, uninterrupted, first_resumed=3, head=head)


def test_killed_worker_ends_the_run_naming_it(assets: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "worker_death"
    segments = refit_segments()
    log = tmp_path / "worker_death.log"
    process = start_train(small_run_overrides(assets, run_dir, **{"trainer.total_steps": 500}),
                          log)
    # The actor's rank 1 (its two ranks are Ray workers under the driver: its own cluster).
    line = kill_mid_run(process, run_dir, log, count=2,
                        victims=lambda: titled_processes("ray::MegatronWorker", process.pid))
    assert line.startswith("rlhf-megatron: error: worker actor[") and "died" in line, line
    # ray.kill skips the workers' finalizers: the driver unlinks the segments they made.
    assert not leaked_refit_segments(segments), "refit segments left in /dev/shm by the dead worker"


# ---------------------------------------------------------------------------- bad inputs
def _one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2, result.stderr[-2000:]
    line = last_line(result.stderr)
    assert line.startswith("rlhf-megatron: error: "), result.stderr[-2000:]
    for needle in needles:
        assert needle in line, line


# These four are refused before Ray starts, so they call the CLI in this process
# (`train_in_process`: exit code and the fd-level stderr, as a subprocess's).
def test_unknown_config_key(assets: Path, tmp_path: Path, capfd) -> None:
    result = train_in_process(
        small_run_overrides(assets, tmp_path / "r", **{"trainer.totl_steps": 3}), capfd)
    _one_line_error(result, "unknown config key 'trainer.totl_steps'", "total_steps")
    assert len(result.stderr.strip().splitlines()) == 1


def test_missing_dataset_field(assets: Path, tmp_path: Path, capfd) -> None:
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"prompt": "1 + 2 =", "answer": "3"}) + "\n"
                    + json.dumps({"prompt": "2 + 2 ="}) + "\n")
    result = train_in_process(small_run_overrides(assets, tmp_path / "r", **{
        "data.train_files": f"[{data}]"}), capfd)
    _one_line_error(result, "bad.jsonl", "line 2", "answer")
    assert len(result.stderr.strip().splitlines()) == 1


def test_layout_that_does_not_fit_the_resources(assets: Path, tmp_path: Path, capfd) -> None:
    result = train_in_process(small_run_overrides(assets, tmp_path / "r", **{
        "resources.mode": "split", "resources.devices_per_node": 2}), capfd)
    _one_line_error(result, "split pools need actor 2 + rollout 1 = 3 devices",
                    "resources give 2")
    assert len(result.stderr.strip().splitlines()) == 1


def test_layout_larger_than_the_ray_cluster(assets: Path, tmp_path: Path) -> None:
    # A subprocess with a 1-CPU cluster of its own: this check is made against the cluster it
    # starts (Ray in the test's own process would outlive the test).
    result = run_train(small_run_overrides(assets, tmp_path / "r", **{"ray.num_cpus": 1}))
    _one_line_error(result, "needs 2 devices", "Ray cluster has 1")


@pytest.mark.parametrize("body, needle", [
    ("    raise ValueError('grader crashed')\n", "grader crashed"),
    ("    return [1.0]\n", "returned 1 rewards for 2 responses"),
])
def test_bad_custom_reward(assets: Path, tmp_path: Path, body: str, needle: str,
                           capfd) -> None:
    """Found by a probe call on two training rows before Ray starts (no workers to wait for)."""
    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text("def accuracy_reward(responses, answers, **kwargs):\n" + body)
    result = train_in_process(small_run_overrides(assets, tmp_path / "r", **{
        "reward.custom_function": f"{reward_file}:accuracy_reward"}), capfd)
    _one_line_error(result, "accuracy_reward", needle)
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Ray cluster" not in result.stderr
