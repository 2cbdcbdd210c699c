"""SLURM simulated on one machine, for the launch tests
(tests/integration/launch/test_slurm_launch.py, test_slurm_train.py): fake `srun` / `scontrol`
scripts run the real launch/slurm sbatch script on two "nodes" (two Ray nodes on loopback), or
launch/local.sh on one, on a free block of ports; every process of a run carries a tag in its
environment, and none may outlive the run."""

from __future__ import annotations

import os
import random
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

from rlhf_megatron.testing.processes import pids_with_env

REPO = Path(__file__).resolve().parents[2]  # the checkout (tests run from it)
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
    import pytest

    pytest.fail("no free block of 200 ports in 20000-32000 after 50 tries")


def _reap_tagged(tag: str, grace_s: float) -> list[int]:
    """Wait grace_s for tagged processes to end, SIGKILL the rest; return what was left."""
    deadline = time.monotonic() + grace_s
    while (left := pids_with_env(f"{TAG_VAR}={tag}")) and time.monotonic() < deadline:
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


def run_local_sh(tmp_path: Path, train_cmd: list[str] | str, timeout_s: float = 90.0,
                 ray_bin: Path = RAY_BIN, stop_grace_s: int = 20) -> subprocess.CompletedProcess:
    """Run launch/local.sh with TRAIN_CMD=train_cmd on unique ports and a unique temp dir (and
    `ray_bin` as its RAY, `stop_grace_s` as its STOP_GRACE_S)."""
    ports = _pick_port_env()
    node_ports = " ".join(f"--{var[4:].lower().replace('_', '-')}={ports[var]}" for var in (
        "RAY_NODE_MANAGER_PORT", "RAY_OBJECT_MANAGER_PORT", "RAY_METRICS_EXPORT_PORT",
        "RAY_DASHBOARD_AGENT_LISTEN_PORT", "RAY_DASHBOARD_AGENT_GRPC_PORT",
        "RAY_RUNTIME_ENV_AGENT_PORT", "RAY_MIN_WORKER_PORT", "RAY_MAX_WORKER_PORT"))
    ray_tmp = tempfile.mkdtemp(prefix="rsl", dir="/tmp")
    env = {**os.environ, TAG_VAR: uuid.uuid4().hex, "RAY": str(ray_bin),
           "PYTHON": sys.executable, "NUM_CPUS": "1", "RAY_TEMP_DIR": ray_tmp,
           "LOG_DIR": str(tmp_path / "logs"), "STOP_GRACE_S": str(stop_grace_s),
           "OMP_NUM_THREADS": "1",
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
