"""The launch scripts run a real (short) CPU training run: the sbatch script on two simulated SLURM
nodes (the Ray head and a worker node on loopback, the actor's two TP ranks placed one per node),
and launch/local.sh on one machine; the trainer joins the cluster through RAY_ADDRESS."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from rlhf_megatron.quickstart import prepare
from rlhf_megatron.testing.processes import pids_with_env, proc_environ, proc_stat
from rlhf_megatron.testing.slurm_sim import SIM_NODES, run_local_sh, run_simulated_slurm
from rlhf_megatron.testing.train_runs import CONFIG, read_metrics, small_run_overrides


class WorkerNodes(threading.Thread):
    """While a simulated job runs, records the simulated node (SIM_NODE, which the fake srun
    puts in each `ray start` step's environment and Ray workers inherit) of every Megatron
    worker of that job (its environment carries the job's SIM_STATE). Processes a worker forks
    (checkpoint writers) carry its title too: `ranks()` leaves them out."""

    def __init__(self, state_dir: Path) -> None:
        super().__init__(daemon=True)
        self.needle = f"SIM_STATE={state_dir}"
        self.nodes: dict[int, str] = {}
        self.parents: dict[int, int] = {}
        self.done = threading.Event()

    def ranks(self) -> dict[int, str]:
        return {pid: node for pid, node in self.nodes.items()
                if self.parents[pid] not in self.nodes}

    def run(self) -> None:
        while not self.done.wait(0.5):
            for pid in pids_with_env(self.needle, (b"ray::MegatronWorker",)):
                if pid not in self.nodes:
                    self._look(pid)

    def _look(self, pid: int) -> None:
        env, stat = proc_environ(pid), proc_stat(pid)
        if env is None or stat is None:  # gone
            return
        self.parents[pid] = stat[1]
        self.nodes[pid] = next((v[9:].decode() for v in env if v.startswith(b"SIM_NODE=")), "?")


def _preempt_after_step_1(run_dir: Path) -> Callable[[subprocess.Popen], None]:
    """on_start hook: SIGUSR1 to the batch shell once step 1 is logged, as SLURM's
    --signal=B:USR1@grace does ahead of the time limit or a preemption."""

    def start(job: subprocess.Popen) -> None:
        def send() -> None:
            deadline = time.monotonic() + 300
            while not read_metrics(run_dir) and job.poll() is None \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
            if job.poll() is None:
                os.kill(job.pid, signal.SIGUSR1)

        threading.Thread(target=send, daemon=True).start()

    return start


def test_sbatch_runs_a_training_run_on_two_nodes_preempted_and_requeued(tmp_path: Path) -> None:
    """Signal -> checkpoint -> requeue -> the requeued job continues from exactly the next step;
    the harness fails the test if any process of either job outlives it."""
    assets = prepare(tmp_path / "assets")
    run_dir = tmp_path / "run"
    total = 40
    overrides = small_run_overrides(assets, run_dir, **{
        "trainer.total_steps": total, "trainer.val_every": 0, "trainer.resume": "auto",
        "resources.nodes": 2, "resources.devices_per_node": 1, "resources.cpus_per_device": 1})
    command = [sys.executable, "-m", "rlhf_megatron", "train", "--config", str(CONFIG),
               *overrides]
    train_cmd = shlex.join(command) + ' ray.address="$RAY_ADDRESS"'
    watcher = WorkerNodes(tmp_path / "state")
    watcher.start()
    try:
        first = run_simulated_slurm(tmp_path, train_cmd, timeout_s=400, name="job1",
                                    on_start=_preempt_after_step_1(run_dir))
    finally:
        watcher.done.set()
        watcher.join()
    assert first.returncode == 75, (first.stdout[-2000:], first.stderr[-3000:])
    assert "SIGUSR1: asking the trainer to save a checkpoint and stop" in first.stderr
    stopped = re.search(r"stopped by SIGUSR1 after step (\d+); checkpoint (\S+);", first.stderr)
    assert stopped, first.stderr[-3000:]
    step = int(stopped.group(1))
    assert 1 <= step < total and Path(stopped.group(2)).name == f"step_{step:08d}"
    assert (tmp_path / "state" / "requeue.log").read_text().split() == ["4242"]
    # The actor's two TP ranks (one Ray worker each) sat one per node.
    assert sorted(watcher.ranks().values()) == list(SIM_NODES), watcher.nodes
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, step + 1))
    assert "joined the Ray cluster at" in first.stdout + first.stderr
    assert (tmp_path / "logs").is_dir() and len(list((tmp_path / "logs").glob("ray-*.log"))) == 2

    # SLURM starts the requeued job with the same script and arguments.
    second = run_simulated_slurm(tmp_path, train_cmd, timeout_s=400, name="job2")
    assert second.returncode == 0, (second.stdout[-2000:], second.stderr[-3000:])
    assert f"at step {step + 1}" in second.stderr
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, total + 1))
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in records)
    assert (tmp_path / "state" / "requeue.log").read_text().split() == ["4242"]


def test_local_sh_runs_a_training_run(tmp_path: Path) -> None:
    assets = prepare(tmp_path / "assets")
    run_dir = tmp_path / "run"
    # local.sh's Ray head has 1 CPU here: two half-CPU bundles hold the actor's ranks and vLLM.
    overrides = small_run_overrides(assets, run_dir, **{
        "trainer.total_steps": 2, "trainer.val_every": 0, "resources.devices_per_node": 2,
        "resources.cpus_per_device": 0.5})
    command = [sys.executable, "-m", "rlhf_megatron", "train", "--config", str(CONFIG),
               *overrides]
    result = run_local_sh(tmp_path, shlex.join(command), timeout_s=400)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]
    assert "joined the Ray cluster at" in result.stdout + result.stderr
