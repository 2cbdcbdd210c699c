"""Helpers of the tests that train end to end (tests/integration/controller/ and others): run
`python -m rlhf_megatron train` on the quickstart assets as a subprocess, read its metrics, kill
it at chosen moments, and one Ray cluster that many runs join (RayHead)."""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from rlhf_megatron.cli import main

REPO = Path(__file__).resolve().parents[2]  # rlhf_megatron/testing/ -> the checkout
CONFIG = REPO / "configs" / "quickstart_cpu.yaml"

# Wall-clock and throughput figures differ between runs; everything else must match exactly.
VOLATILE_PREFIXES = ("time/", "refit/seconds", "rollout/tokens_per_s")

# torch, MKL and oneDNN capped at AVX2 (the Makefile's AVX2_CAP, `make test-portable`): a RayHead
# started with it passes it to every worker and every driver that joins.
AVX2_CAP_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                "ONEDNN_MAX_CPU_ISA": "AVX2"}


def small_run_overrides(assets: Path, run_dir: Path, **extra: object) -> list[str]:
    values: dict[str, object] = {
        "model.path": assets / "model",
        "data.train_files": f"[{assets / 'train.jsonl'}]",
        "data.val_files": f"[{assets / 'val.jsonl'}]",
        "data.prompts_per_step": 4,
        "rollout.sampling.n": 4,
        "actor.engine.micro_batch_size": 16,
        "trainer.total_steps": 3,
        "trainer.val_every": 2,
        "trainer.save_every": 0,
        "trainer.run_dir": run_dir,
        "metrics.tensorboard": "false",
        "metrics.progress_bar": "false",
        "metrics.plot": "false",
    }
    values.update(extra)
    return [f"{key}={value}" for key, value in values.items()]


def train_command(overrides: list[str], config: Path = CONFIG) -> list[str]:
    return [sys.executable, "-m", "rlhf_megatron", "train", "--config", str(config), *overrides]


def run_train(overrides: list[str], *, timeout: float = 300, config: Path = CONFIG,
              head: RayHead | None = None) -> subprocess.CompletedProcess:
    """The CLI in a subprocess; with `head`, the run joins that Ray cluster."""
    env = _env()
    if head is not None:
        overrides = [*overrides, f"ray.address={head.address}"]
        env.update(head.env)
    return subprocess.run(train_command(overrides, config), cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=env)


def train_in_process(overrides: list[str], capfd, config: Path = CONFIG
                     ) -> subprocess.CompletedProcess:
    """`rlhf-megatron train` called in this process (`cli.main`), for input the CLI refuses
    before Ray starts: the interpreter and its imports are paid once, not ~5-10 s a run.
    Returns what `run_train` returns: the exit code, and stdout/stderr read at the file
    descriptors (`capfd`), with every warning and every WARNING-or-above log record written
    there as the CLI's own process would print them (pytest would otherwise hold them back), so
    a one-line-stderr check is as strict as on a subprocess. Ray must not have started."""
    import ray


    capfd.readouterr()
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    logging.getLogger().addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            warnings.filterwarnings("ignore", category=DeprecationWarning)  # as the Makefile
            try:
                code = main(["train", "--config", str(config), *overrides])
            except SystemExit as exc:  # argparse's own refusals
                code = exc.code
        for warning in caught:
            print(warnings.formatwarning(warning.message, warning.category, warning.filename,
                                         warning.lineno), file=sys.stderr, end="")
    finally:
        logging.getLogger().removeHandler(handler)
    assert not ray.is_initialized(), "Ray started in the test's process"
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(["rlhf-megatron", "train"], code, out, err)


def start_train(overrides: list[str], log: Path, config: Path = CONFIG) -> subprocess.Popen:
    """The CLI in a subprocess of its own session (its own Ray cluster), output to `log`."""
    handle = log.open("w")
    return subprocess.Popen(train_command(overrides, config), cwd=REPO, stdout=handle,
                            stderr=subprocess.STDOUT, env=_env(), start_new_session=True)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def window_means(records: list[dict], key: str, window: int) -> tuple[float, float]:
    """Mean of `key` over the first `window` records and over the last `window` (a learning
    curve's start and end)."""
    values = [r[key] for r in records]
    return sum(values[:window]) / window, sum(values[-window:]) / window


def stable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(VOLATILE_PREFIXES)}


def wait_until(condition: Callable[[], bool], process: subprocess.Popen, timeout: float,
               poll: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"the run ended (rc={process.returncode}) before the condition")
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the run")
        time.sleep(poll)


def kill_hard(process: subprocess.Popen) -> None:
    """kill -9 the driver (the whole session: Ray's local cluster dies with it)."""
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=60)
    time.sleep(2)  # let the raylet notice and reap its workers


def titled_processes(title: str, root: int, parent_title: str | None = None) -> list[int]:
    """Live processes whose command line holds `title`, descended from process `root` (not
    another run's on this host); with `parent_title`, only those whose parent's holds that."""
    out = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout
    parent, args = {}, {}
    for line in out.splitlines()[1:]:
        fields = line.split(None, 2)
        parent[int(fields[0])] = int(fields[1])
        args[int(fields[0])] = fields[2] if len(fields) == 3 else ""

    def under_root(pid: int) -> bool:
        while pid > 1:
            if pid == root:
                return True
            pid = parent.get(pid, 1)
        return False

    return [pid for pid, text in args.items() if title in text and under_root(pid)
            and (parent_title is None or parent_title in args.get(parent[pid], ""))]


def kill_mid_run(process: subprocess.Popen, run_dir: Path, log: Path,
                 victims: Callable[[], list[int]], count: int, after_steps: int = 2,
                 timeout: float = 240) -> str:
    """Once the run has logged `after_steps` steps, kill -9 the last of the `count` processes
    `victims()` finds; the run must end, non-zero, within 60 s of it. Returns the last line of
    its log."""
    try:
        wait_until(lambda: len(read_metrics(run_dir)) >= after_steps, process, timeout=timeout)
        pids = victims()
        assert len(pids) == count, pids
        os.kill(pids[-1], signal.SIGKILL)
        killed_at = time.monotonic()
        process.wait(timeout=90)
        assert time.monotonic() - killed_at < 60
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode not in (0, None)
    return last_line(log.read_text())


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


# ---------------------------------------------------------------------------- one Ray cluster, many runs
# A test head runs no autoscaler monitor (its one node is all there is) and no log monitor (the
# runs that join it print to their own stderr; their workers' output stays in the session's log
# files), and prestarts no workers for its own driver, which runs nothing (they sat idle all
# along): each of those took ~0.2-1.4 % of a core for the whole suite (session 26's profile of a
# CI run: ~20-24 CPU-s a head for the log monitor, ~9 for each of its two idle workers), and a
# `make test` keeps two or three heads up.
_HEAD_SCRIPT = """
import sys, ray
from ray._private import parameter

_init = parameter.RayParams.__init__


def _quiet(self, *args, **kwargs):
    _init(self, *args, **{**kwargs, "no_monitor": True, "include_log_monitor": False})


parameter.RayParams.__init__ = _quiet
context = ray.init(num_cpus=int(sys.argv[1]), include_dashboard=False, log_to_driver=False,
                   configure_logging=False,
                   _system_config={"prestart_worker_first_driver": False})
print("SESSION", context.address_info["session_dir"], flush=True)
print("ADDRESS", context.address_info["gcs_address"], flush=True)
sys.stdin.read()  # until the test module closes our stdin
ray.shutdown()
"""


_RAY_LOG_PROBLEM = re.compile(r"^\[\S+ \S+ [WEF] ")  # Ray's log lines of level W, E, F


class RayHead:
    """A local Ray cluster in a child process, shared by many runs (tests/integration/conftest.py:
    one per pytest run): each run joins it (`ray.address=...`) instead of starting and stopping
    a cluster of its own, which costs 5-15 s a run on 2 busy cores. `stop()` ends it (and every
    worker still on it).

    `address` checks that the head is still there: if its process ended or its GCS stopped
    answering (stop 35's CI lost it mid-suite, and every run after waited minutes on a dead
    address and failed), the head is started again, and why it died is printed from its logs."""

    def __init__(self, num_cpus: int = 4, timeout: float = 300, attempts: int = 3,
                 env: dict[str, str] | None = None) -> None:
        # Token auth with a token of our own: the drivers that join need the same one.
        self.auth_env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        # What the head's workers and the drivers that join run with (`env`, e.g. AVX2_CAP_ENV).
        self.env = {**(env or {}), **self.auth_env}
        self.num_cpus, self.timeout, self.attempts = num_cpus, timeout, attempts
        self.restarts = 0
        self._start()

    def _start(self) -> None:
        deadline = time.monotonic() + self.timeout
        # Ray gives its raylet 30 s to register (hard-coded in ray/_private/node.py); on 2 cores
        # shared with other jobs (load 50+) that can run out, and a session-wide head that
        # failed once would fail every run that joins it: try again, in a fresh session.
        for _ in range(self.attempts):
            self.process = subprocess.Popen(
                [sys.executable, "-c", _HEAD_SCRIPT, str(self.num_cpus)], cwd=REPO,
                env={**_env(), **self.env}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                text=True, start_new_session=True)
            line, self.session_dir = "", ""
            while not line.startswith("ADDRESS "):
                line = self.process.stdout.readline()
                if line.startswith("SESSION "):
                    self.session_dir = line.split(None, 1)[1].strip()
                if (not line and self.process.poll() is not None) or time.monotonic() > deadline:
                    break
            if line.startswith("ADDRESS "):
                self._address = line.split()[1]
                return
            self._kill()
            if time.monotonic() > deadline:
                break
        raise AssertionError(f"the shared Ray head did not start (within {self.timeout:.0f} s)")

    @property
    def address(self) -> str:
        """The GCS address of a live head (started again if it died since the last run)."""
        why = self._dead()
        if why:
            print(f"the shared Ray head is gone ({why}); starting another\n"
                  f"{self._log_tails()}", file=sys.stderr, flush=True)
            self._kill()
            self.restarts += 1
            self._start()
        return self._address

    def _dead(self) -> str:
        """Why the head cannot take a run ('' when it can)."""
        if self.process.poll() is not None:
            return f"its process ended, rc={self.process.returncode}"
        host, port = self._address.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=10).close()
        except OSError as exc:
            return f"its GCS at {self._address} does not answer: {exc}"
        return ""

    def _log_tails(self, lines: int = 15) -> str:
        logs = Path(self.session_dir) / "logs" if self.session_dir else None
        if logs is None or not logs.is_dir():
            return "(no Ray session logs)"
        parts = []
        for name in ("gcs_server.err", "gcs_server.out", "raylet.err", "raylet.out"):
            path = logs / name
            if path.exists():
                text = path.read_text(errors="replace").splitlines()
                if name.endswith(".out"):  # info lines and state dumps: warnings and errors only
                    text = [line for line in text if _RAY_LOG_PROBLEM.match(line)]
                tail = text[-lines:]
                parts.append(f"--- {path}\n" + "\n".join(tail))
        return "\n".join(parts) or f"(nothing in {logs})"

    def _kill(self) -> None:
        """The head and whatever it started (its session: GCS, raylet, workers)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)
