"""The launch scripts run a real (short) CPU training run: the sbatch script on two simulated SLURM
nodes (the Ray head and a worker node on loopback, the actor's two TP ranks placed one per node),
and launch/local.sh on one machine; the trainer joins the cluster through RAY_ADDRESS."""

from __future__ import annotations

import shlex
import sys
import threading
from pathlib import Path

from controller_harness import CONFIG, read_metrics, small_run_overrides
from test_slurm_launch import SIM_NODES, run_local_sh, run_simulated_slurm

from rlhf_megatron.quickstart import prepare


class WorkerNodes(threading.Thread):
    """While a simulated job runs, records the simulated node (SIM_NODE, which the fake srun
    puts in each `ray start` step's environment and Ray workers inherit) of every Megatron
    worker of that job (its environment carries the job's SIM_STATE). Processes a worker forks
    (checkpoint writers) carry its title too: `ranks()` leaves them out."""

    def __init__(self, state_dir: Path) -> None:
        super().__init__(daemon=True)
        self.needle = f"SIM_STATE={state_dir}".encode()
        self.nodes: dict[int, str] = {}
        self.parents: dict[int, int] = {}
        self.done = threading.Event()

    def ranks(self) -> dict[int, str]:
        return {pid: node for pid, node in self.nodes.items()
                if self.parents[pid] not in self.nodes}

    def run(self) -> None:
        while not self.done.wait(0.5):
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit() and int(entry.name) not in self.nodes:
                    self._look(entry)

    def _look(self, entry: Path) -> None:
        try:
            if b"ray::MegatronWorker" not in (entry / "cmdline").read_bytes():
                return
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # gone
            return
        if self.needle in env:
            try:  # /proc/<pid>/stat: "pid (comm) state ppid ..."
                self.parents[int(entry.name)] = int(
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                return
            node = next((v[9:].decode() for v in env if v.startswith(b"SIM_NODE=")), "?")
            self.nodes[int(entry.name)] = node


def test_sbatch_runs_a_training_run_on_two_nodes(tmp_path: Path) -> None:
    assets = prepare(tmp_path / "assets")
    run_dir = tmp_path / "run"
    overrides = small_run_overrides(assets, run_dir, **{
        "trainer.total_steps": 2, "trainer.val_every": 0, "resources.nodes": 2,
        "resources.devices_per_node": 1, "resources.cpus_per_device": 1})
    command = [sys.executable, "-m", "rlhf_megatron", "train", "--config", str(CONFIG),
               *overrides]
    train_cmd = shlex.join(command) + ' ray.address="$RAY_ADDRESS"'
    watcher = WorkerNodes(tmp_path / "state")
    watcher.start()
    try:
        result = run_simulated_slurm(tmp_path, train_cmd, timeout_s=400)
    finally:
        watcher.done.set()
        watcher.join()
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    # The actor's two TP ranks (one Ray worker each) sat one per node.
    assert sorted(watcher.ranks().values()) == list(SIM_NODES), watcher.nodes
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    assert "joined the Ray cluster at" in result.stdout + result.stderr
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in records)
    assert (tmp_path / "logs").is_dir() and len(list((tmp_path / "logs").glob("ray-*.log"))) == 2


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
