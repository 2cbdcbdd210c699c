"""Issue 18 acceptance through the real CLI, three runs in a row on one run directory:

1. SIGTERM to `rlhf-megatron train` (its own local Ray cluster) mid-run: a complete checkpoint of
   the step reached, exit 75 within 60 s, one line and no traceback, and nothing left behind
   (no process of the run, no /dev/shm refit segment).
2. resume=auto (joining a shared Ray head) continues at exactly the next step and ends normally;
   its workers and segments are gone afterwards.
3. The newest checkpoint is damaged (a truncated .distcp, COMPLETE intact): `rlhf-megatron
   checkpoints` lists it as damaged, resume=auto falls back to the previous one with a warning
   naming the reason, and then a custom reward that never returns ends the run after
   reward.timeout_s with one line naming the function (the error exit path: again nothing left).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from rlhf_megatron.cli import main
from rlhf_megatron.cluster.lifecycle import EXIT_PREEMPTED
from rlhf_megatron.records.checkpoint_store import CheckpointStore, verify_checkpoint
from rlhf_megatron.testing.processes import leaked_refit_segments, pids_with_env, refit_segments
from rlhf_megatron.testing.train_runs import (
    REPO,
    RayHead,
    last_line,
    read_metrics,
    small_run_overrides,
    train_command,
    wait_until,
)

TAG_VAR = "RLHF_RELIAB_TAG"
WORKER_TITLES = (b"ray::MegatronWorker", b"ray::RolloutWorker")
TIMEOUT_S = 3.0
# Hangs from its second call on (the first is the probe before Ray starts); notes the moment.
HANGING_REWARD = """
import pathlib, time
def reward(responses, answers, **kwargs):
    calls = pathlib.Path(__file__).with_suffix(".calls")
    n = int(calls.read_text()) + 1 if calls.exists() else 1
    calls.write_text(str(n))
    if n >= 2:
        pathlib.Path(__file__).with_suffix(".hang").write_text(repr(time.time()))
        time.sleep(3600)
    return [0.0] * len(responses)
"""


def _left_over(tag: str, titles: tuple[bytes, ...] = (), grace_s: float = 20.0) -> list[int]:
    deadline = time.monotonic() + grace_s
    tagged = f"{TAG_VAR}={tag}"
    while (left := pids_with_env(tagged, titles, live_only=True)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in left:  # do not leak into the next test
        os.kill(pid, signal.SIGKILL)
    return left


def _start(overrides: list[str], log: Path, tag: str,
           head: RayHead | None = None) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", TAG_VAR: tag}
    if head is not None:
        overrides = [*overrides, f"ray.address={head.address}"]
        env.update(head.auth_env)
    return subprocess.Popen(train_command(overrides), cwd=REPO, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _finish(process: subprocess.Popen, timeout: float) -> int:
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise


# `assets`: the quickstart's, tests/integration/conftest.py.


@pytest.fixture(scope="module")
def head_tag() -> str:
    return uuid.uuid4().hex


@pytest.fixture(scope="module")
def head(head_tag: str):
    os.environ[TAG_VAR] = head_tag  # the head and its workers carry the tag
    try:
        cluster = RayHead(num_cpus=4)
    finally:
        del os.environ[TAG_VAR]
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def preempted(assets: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """Run 1: SIGTERM after step 1 has been logged; returns (run dir, step reached)."""
    tmp = tmp_path_factory.mktemp("preempted")
    run_dir, log, tag = tmp / "run", tmp / "run1.log", uuid.uuid4().hex
    segments = refit_segments()
    process = _start(small_run_overrides(assets, run_dir, **{
        "trainer.total_steps": 60, "trainer.val_every": 0, "trainer.save_every": 0}), log, tag)
    wait_until(lambda: len(read_metrics(run_dir)) >= 1, process, timeout=240)
    os.kill(process.pid, signal.SIGTERM)  # the trainer alone, as the launcher forwards it
    signalled = time.monotonic()
    code = _finish(process, timeout=90)
    elapsed = time.monotonic() - signalled
    text = log.read_text()
    assert code == EXIT_PREEMPTED, text[-3000:]
    assert elapsed < 60, f"took {elapsed:.0f}s to stop after SIGTERM"
    assert "Traceback" not in text, text[-3000:]
    line = last_line(text)
    match = re.match(r"rlhf-megatron: stopped by SIGTERM after step (\d+); checkpoint (\S+);", line)
    assert match, line
    step = int(match.group(1))
    assert 1 <= step < 60 and Path(match.group(2)).name == f"step_{step:08d}"
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, step + 1))
    assert not _left_over(tag), "processes of the run outlived it"
    assert not leaked_refit_segments(segments), "refit segments left in /dev/shm"
    return run_dir, step


def test_sigterm_saves_a_complete_checkpoint_of_the_step_reached(preempted) -> None:
    run_dir, step = preempted
    store = CheckpointStore(run_dir / "checkpoints", keep_last=2)
    latest = store.latest()
    assert latest is not None and latest.name == f"step_{step:08d}"
    assert verify_checkpoint(latest) is None
    assert store.load_controller_state(latest)["step"] == step


def test_resume_continues_at_the_next_step_then_falls_back_past_a_damaged_checkpoint(
        preempted, assets: Path, head: RayHead, head_tag: str, tmp_path: Path, capsys) -> None:
    run_dir, step = preempted
    # Run 2: resume=auto continues at exactly the next step.
    segments = refit_segments()
    log = tmp_path / "run2.log"
    overrides = small_run_overrides(assets, run_dir, **{
        "trainer.total_steps": step + 1, "trainer.val_every": 0, "trainer.save_every": 0,
        "trainer.resume": "auto"})
    code = _finish(_start(overrides, log, uuid.uuid4().hex, head), timeout=300)
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert f"at step {step + 1}" in text
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, step + 2))
    assert not _left_over(head_tag, WORKER_TITLES), "workers outlived the run"
    assert not leaked_refit_segments(segments)

    # Damage the newest checkpoint behind its intact COMPLETE marker.
    newest = run_dir / "checkpoints" / f"step_{step + 1:08d}"
    shard = max((newest / "actor").rglob("*.distcp"), key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    capsys.readouterr()
    assert main(["checkpoints", str(run_dir)]) == 1
    listing = capsys.readouterr().out
    assert re.search(rf"step_{step + 1:08d}\s+damaged\s+actor/\S+\.distcp has", listing), listing
    assert re.search(rf"step_{step:08d}\s+ok", listing), listing

    # Run 3: falls back to the previous checkpoint, then a reward that never returns ends the
    # step after reward.timeout_s with one line, and nothing is left running.
    reward = tmp_path / "hanging_reward.py"
    reward.write_text(HANGING_REWARD)
    log = tmp_path / "run3.log"
    tag = uuid.uuid4().hex
    overrides = small_run_overrides(assets, run_dir, **{
        "trainer.total_steps": step + 2, "trainer.val_every": 0, "trainer.save_every": 0,
        "trainer.resume": "auto", "reward.custom_function": f"{reward}:reward",
        "reward.timeout_s": TIMEOUT_S})
    code = _finish(_start(overrides, log, tag, head), timeout=300)
    ended = time.time()
    text = log.read_text()
    assert code == 2, text[-3000:]
    assert re.search(rf"checkpoint \S+step_{step + 1:08d} is damaged \(actor/\S+\.distcp has "
                     r"\d+ bytes, the manifest says \d+\); falling back", text), text[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{step:08d}'} at step {step + 1}" \
        in text
    line = last_line(text)
    assert line.startswith("rlhf-megatron: error: ") and f"{reward}:reward" in line \
        and f"within {TIMEOUT_S:g}s" in line, line
    hung_at = float(reward.with_suffix(".hang").read_text())
    assert ended - hung_at < TIMEOUT_S + 20, f"ended {ended - hung_at:.1f}s after the hang began"
    assert not _left_over(tag), "the reward process or another process of the run is left"
    assert not _left_over(head_tag, WORKER_TITLES), "workers outlived the run"
    assert not leaked_refit_segments(segments), "refit segments left in /dev/shm"
