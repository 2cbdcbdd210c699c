"""What a run leaves behind, read from Linux's /proc and /dev/shm, for the tests that check a run
cleans up: its processes (found by a tag in their environment, which every child inherits) and
its refit shared-memory segments."""

from __future__ import annotations

import os
import time
from pathlib import Path

from rlhf_megatron.cluster.lifecycle import SEGMENT_PREFIX, segment_pid


def shm_files(prefix: str = "") -> set[str]:
    """Names of the shared-memory files now in /dev/shm that start with `prefix`."""
    return {p.name for p in Path("/dev/shm").glob(f"{prefix}*")}


def refit_segments() -> set[str]:
    """Names of the refit transports' shared-memory files now in /dev/shm (any run's)."""
    return shm_files(SEGMENT_PREFIX)


def thread_names() -> list[str]:
    """The name (`comm`) of each thread of this process: gloo's are `pt_gloo*` / `gloo_*`."""
    tasks = Path("/proc/self/task")
    names = []
    for task in tasks.iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except FileNotFoundError:  # the thread ended since the listing
            continue
    return names


def leaked_refit_segments(before: set[str], grace_s: float = 60.0) -> set[str]:
    """The refit segments not in `before` whose creating process (the pid in the name) is gone:
    what a run that has ended left behind. A live process's segments are not counted, and a dead
    one's are given `grace_s` to go: under pytest-xdist another test's run may have just lost a
    worker whose segments its driver is about to unlink (kill -9 skips the worker's own cleanup);
    nothing unlinks a segment this run leaked, so that one is still there at the deadline."""
    deadline = time.monotonic() + grace_s
    while True:
        leaked = {name for name in refit_segments() - before
                  if (pid := segment_pid(Path(name))) is None or not is_alive(pid)}
        if not leaked or time.monotonic() > deadline:
            return leaked
        time.sleep(0.5)


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of `pid` from /proc/<pid>/stat ("pid (comm) state ppid ..."; comm
    may hold spaces and parentheses, so split after the last one); None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


def is_alive(pid: int) -> bool:
    """`pid` exists and is not a zombie."""
    stat = proc_stat(pid)
    return stat is not None and stat[0] != "Z"


def proc_environ(pid: int) -> list[bytes] | None:
    """The `KEY=value` entries of `pid`'s environment; None when gone or not readable."""
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None


def pids_with_env(entry: str, titles: tuple[bytes, ...] = (), *,
                  live_only: bool = False) -> list[int]:
    """Processes other than this one whose environment holds `entry` (`KEY=value`), and, when
    `titles` is given, whose command line contains one of them; `live_only` leaves zombies out."""
    needle = entry.encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        pid = int(proc.name)
        environ = proc_environ(pid)
        if environ is None or needle not in environ:
            continue
        if live_only and not is_alive(pid):
            continue
        if titles:
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if not any(title in cmdline for title in titles):
                continue
        found.append(pid)
    return found
