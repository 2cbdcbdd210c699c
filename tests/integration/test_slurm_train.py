"""The launch scripts run a real (short) CPU training run: the sbatch script on two simulated SLURM
nodes (the Ray head and a worker node on loopback, the actor's two TP ranks placed one per node),
and launch/local.sh on one machine; the trainer joins the cluster through RAY_ADDRESS."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from controller_harness import CONFIG, read_metrics, small_run_overrides
from test_slurm_launch import run_local_sh, run_simulated_slurm

from rlhf_megatron.quickstart import prepare


def test_sbatch_runs_a_training_run_on_two_nodes(tmp_path: Path) -> None:
    assets = prepare(tmp_path / "assets")
    run_dir = tmp_path / "run"
    overrides = small_run_overrides(assets, run_dir, **{
        "trainer.total_steps": 2, "trainer.val_every": 0, "resources.nodes": 2,
        "resources.devices_per_node": 1, "resources.cpus_per_device": 1})
    command = [sys.executable, "-m", "rlhf_megatron", "train", "--config", str(CONFIG),
               *overrides]
    train_cmd = shlex.join(command) + ' ray.address="$RAY_ADDRESS"'
    result = run_simulated_slurm(tmp_path, train_cmd, timeout_s=400)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
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
