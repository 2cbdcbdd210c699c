"""How a run stops: signals (preemption, Ctrl-C), the cause of a dead Ray actor, and the shared
memory a killed worker leaves behind.

Signals. `GracefulStop.install()` (called after `ray.init`, which installs Ray's own SIGTERM
handler) takes SIGTERM, SIGUSR1 and SIGINT. While the training loop runs, the first signal only
sets a flag: the loop finishes the step it is in, saves a complete checkpoint of it and raises
`StopRequested`; outside the loop (start-up) it raises at once. A second signal raises at once.
The CLI turns `StopRequested` into one line and its exit code: `EXIT_PREEMPTED` (75) for SIGTERM
and SIGUSR1 (the launcher requeues the job on it), 130 for SIGINT.

Shared memory. A refit transport is a file `/dev/shm/rlhf_megatron_refit_<pid>_<hex>` created by
worker `<pid>`; `ray.kill` skips its finalizers, so the driver unlinks the segments of the workers
it killed (`remove_refit_segments`) and, at start, those of processes that no longer exist
(`remove_orphan_segments`, e.g. after a kill -9 of an earlier run).
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rlhf_megatron.errors import RlhfMegatronError, say

EXIT_PREEMPTED = 75
"""Exit status after SIGTERM/SIGUSR1: a checkpoint of the step reached was saved; run again with
trainer.resume=auto (EX_TEMPFAIL; launch/slurm requeues the job on it)."""
EXIT_INTERRUPTED = 130
"""Exit status after Ctrl-C (SIGINT), also with the checkpoint saved."""

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "rlhf_megatron_refit_"
_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")


class StopRequested(RlhfMegatronError):
    """A signal stopped the run; `exit_code` is what the process should exit with."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def exit_code_of(signal_name: str) -> int:
    return EXIT_INTERRUPTED if signal_name == "SIGINT" else EXIT_PREEMPTED


class GracefulStop:
    """Signal handlers of one run. `in_loop` says whether a signal may wait for the step's end."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.in_loop = False
        self.tearing_down = False
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        """(Re)install the handlers; call again after anything that installs its own (ray.init)."""
        for name in _SIGNALS:
            number = getattr(signal, name)
            previous = signal.signal(number, self._handle)
            if previous is not self._handle and number not in self._previous:
                self._previous[number] = previous

    def restore(self) -> None:
        for number, previous in self._previous.items():
            signal.signal(number, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _handle(self, number: int, _frame: Any) -> None:
        name = signal.Signals(number).name
        if self.tearing_down:  # teardown is bounded; let it finish
            return
        first = self.signal_name is None
        if first:
            self.signal_name = name
        if first and self.in_loop:
            say(f"{name}: finishing the current step, then saving a checkpoint and stopping "
                 "(send it again to stop at once)")
            return
        when = "during start-up" if first else "again"
        raise StopRequested(f"stopped by {name} {when}; nothing saved since the last checkpoint",
                            exit_code_of(self.signal_name or name))

    def stop_after(self, step: int, checkpoint: Path | None) -> StopRequested:
        """The exception that ends the loop after `step` (its checkpoint already saved)."""
        name = self.signal_name or "a signal"
        where = f"checkpoint {checkpoint}" if checkpoint is not None else "no checkpoint"
        return StopRequested(f"stopped by {name} after step {step}; {where}; run again with "
                             "trainer.resume=auto to continue", exit_code_of(name))


# ------------------------------------------------------------------------------ dead actors
_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure)\b:?.*$")


def actor_death_reason(exc: BaseException) -> str:
    """One line from a RayActorError: its first meaningful line (the exception raised in the
    actor's constructor, or Ray's account of why the process died) plus where the actor's log is.
    Ray's first line ("The actor died unexpectedly ...") says nothing, so it is skipped."""
    text = str(getattr(exc, "error_msg", None) or exc)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if _EXC_LINE.match(line)]
    plain = [line for line in lines[1:] if not re.match(r"^(class_name|actor_id|pid|name|"
                                                        r"namespace|ip):", line)
             and not line.startswith(("File ", "ray::", "Traceback"))]
    reason = errors[-1] if errors else (plain[0] if plain else (lines[0] if lines else
                                                                 "the actor died"))
    reason = reason.split(" Some common causes include")[0]  # Ray's generic advice
    pid = re.search(r"\bpid[:=] ?(\d+)", text)
    ip = re.search(r"\bip[:=] ?([\d.]+)", text)
    where = _worker_log(int(pid.group(1))) if pid else None
    if where is None and pid:
        where = f"pid {pid.group(1)}" + (f" on {ip.group(1)}" if ip else "")
    return f"{reason[:400]}" + (f" (log: {where})" if where else "")


def _worker_log(pid: int) -> str | None:
    """The worker's stderr log in this node's Ray session, if it is on this node."""
    try:
        import ray

        node = ray._private.worker._global_node
        logs = Path(node.get_session_dir_path()) / "logs"
    except Exception:  # not connected, or Ray moved the attribute
        return None
    found = sorted(logs.glob(f"worker-*-{pid}.err"))
    return str(found[0]) if found else f"{logs}/worker-*-{pid}.err"


# ------------------------------------------------------------------------------ shared memory
def segment_pid(path: Path) -> int | None:
    """The pid of the process that created refit segment `path` (in its name); None if not ours."""
    match = re.match(rf"^{SEGMENT_PREFIX}(\d+)_", path.name)
    return int(match.group(1)) if match else None


def remove_refit_segments(pids: Iterable[int], directory: Path = SHM_DIR) -> list[Path]:
    """Unlink the refit segments created by the processes `pids` (workers the driver killed)."""
    wanted = set(pids)
    removed = []
    for path in directory.glob(f"{SEGMENT_PREFIX}*"):
        if segment_pid(path) in wanted:
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def remove_orphan_segments(directory: Path = SHM_DIR) -> list[Path]:
    """Unlink our refit segments whose creating process no longer exists."""
    removed = []
    for path in directory.glob(f"{SEGMENT_PREFIX}*"):
        pid = segment_pid(path)
        try:
            if pid is None or path.stat().st_uid != os.getuid() or _alive(pid):
                continue
            path.unlink()
            removed.append(path)
        except OSError:
            continue
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
