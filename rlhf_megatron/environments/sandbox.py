"""A sandboxed Python tool: one fresh subprocess per call, with hard limits.

Limits (all enforced by the OS or the parent, so a misbehaving call never hangs the caller):
- CPU time: ``RLIMIT_CPU`` (the kernel kills the child with SIGXCPU/SIGKILL);
- memory: ``RLIMIT_AS`` (allocations fail with MemoryError);
- output size: stdout/stderr go to a file capped by ``RLIMIT_FSIZE`` (the child dies with SIGXFSZ
  when it floods) and only the first ``output_bytes`` are returned;
- wall clock: the parent kills the child's whole process group after ``wall_seconds``
  (a ``time.sleep`` or blocked read uses no CPU time);
- no network and no writes outside its own temporary directory: an audit hook (PEP 578) installed
  before the user's code runs refuses ``socket`` creation, subprocesses/exec/fork, ``ctypes``
  loading, and any open-for-write / remove / rename / mkdir outside the directory.
  Network namespaces (``unshare -n``) need privileges this project's containers lack, so the
  audit hook is the network barrier; it stops Python code, not native code (documented limit).
The child runs ``python -I -B`` (isolated: no user site, no PYTHON* variables, no bytecode writes)
with ``cwd`` = its temporary directory and a minimal environment.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# Runs in the child before the user's code: reads the code, installs the audit hook, execs it.
_BOOTSTRAP = r'''
import os, sys
_root = os.path.realpath(os.getcwd())
_code = open("main.py").read()
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_DENY = ("socket.__new__", "socket.connect", "socket.bind", "subprocess.Popen", "os.system",
         "os.exec", "os.posix_spawn", "os.fork", "os.forkpty", "os.spawn", "ctypes.dlopen",
         "ctypes.cdata", "os.kill", "os.killpg")
_PATH_EVENTS = ("os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.symlink", "os.link",
                "os.chmod", "os.chown", "os.truncate", "os.utime", "shutil.rmtree")
def _inside(p):
    try:
        p = os.fsdecode(p)
    except TypeError:
        return True  # a file descriptor: already opened under these rules
    r = os.path.realpath(p)
    return r == _root or r.startswith(_root + os.sep)
def _hook(event, args):
    if event.startswith(_DENY):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open":
        path, mode, flags = args
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool(flags & _WRITE)
        if writes and path is not None and not _inside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside the sandbox directory")
    elif event in _PATH_EVENTS:
        for p in args[:2]:
            if isinstance(p, (str, bytes, os.PathLike)) and not _inside(p):
                raise PermissionError(f"sandbox: {event} on {p!r} outside the sandbox directory")
sys.addaudithook(_hook)
del _hook
exec(compile(_code, "<tool>", "exec"), {"__name__": "__main__"})
'''


@dataclass(frozen=True)
class SandboxLimits:
    """Per-call limits of :class:`PythonSandbox` (seconds, bytes)."""

    cpu_seconds: int = 2
    wall_seconds: float = 5.0
    memory_bytes: int = 512 * 2**20
    output_bytes: int = 2048
    file_bytes: int = 1 * 2**20


@dataclass(frozen=True)
class ToolResult:
    """One tool call's outcome.

    status: "ok" | "error" (non-zero exit, an exception, a refused operation, a resource limit)
        | "timeout" (wall clock) | "output_limit" (output over ``output_bytes``).
    output: stdout (then stderr's last line on error), at most ``output_bytes`` characters.
    error: one line describing the failure, or None when ok.
    """

    status: str
    output: str
    error: str | None
    seconds: float

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class PythonSandbox:
    """Runs Python snippets in a fresh limited subprocess inside one private temporary directory.

    The directory lives as long as the sandbox (an episode); :meth:`close` removes it.
    """

    def __init__(self, limits: SandboxLimits | None = None) -> None:
        self.limits = limits or SandboxLimits()
        self.root = Path(tempfile.mkdtemp(prefix="rlhf_sandbox_"))
        self._logs = Path(tempfile.mkdtemp(prefix="rlhf_sandbox_out_"))

    def run(self, code: str) -> ToolResult:
        """Execute ``code``; never raises for anything the code does, never outlives wall_seconds."""
        (self.root / "main.py").write_text(code)
        out_path = self._logs / "out.txt"
        start = time.monotonic()
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-B", "-c", _BOOTSTRAP], cwd=self.root, stdin=subprocess.DEVNULL,
                stdout=out, stderr=subprocess.STDOUT, env=self._env(), start_new_session=True,
                preexec_fn=self._limit,
            )
            try:
                code_rc = proc.wait(timeout=self.limits.wall_seconds)
                timed_out = False
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                code_rc, timed_out = proc.wait(), True
        seconds = time.monotonic() - start
        return self._result(out_path, code_rc, timed_out, seconds)

    def _result(self, out_path: Path, rc: int, timed_out: bool, seconds: float) -> ToolResult:
        size = out_path.stat().st_size
        with open(out_path, "rb") as f:
            text = f.read(self.limits.output_bytes).decode("utf-8", "replace")
            f.seek(max(0, size - 400))
            tail = f.read().decode("utf-8", "replace")
        if timed_out:
            return ToolResult("timeout", text, f"tool timed out after {self.limits.wall_seconds:g} s",
                              seconds)
        # Python ignores SIGXFSZ: a flood fails its write (EFBIG) once the file reaches the cap.
        flooded = rc == -signal.SIGXFSZ or size >= self._file_cap()
        if flooded or (rc == 0 and size > self.limits.output_bytes):
            return ToolResult("output_limit", text,
                              f"tool output exceeded {self.limits.output_bytes} bytes", seconds)
        if rc in (-signal.SIGXCPU, -signal.SIGKILL):
            return ToolResult("timeout", text,
                              f"tool hit the CPU limit of {self.limits.cpu_seconds} s", seconds)
        if rc != 0:
            lines = [ln for ln in tail.strip().splitlines() if ln.strip()]
            last = lines[-1] if lines else ""
            why = f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"
            return ToolResult("error", text, f"tool failed ({why}): {last}"[:300], seconds)
        return ToolResult("ok", text, None, seconds)

    def _env(self) -> dict[str, str]:
        return {"PATH": "/usr/bin:/bin", "HOME": str(self.root), "TMPDIR": str(self.root),
                "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"}

    def _limit(self) -> None:
        """preexec_fn: resource limits of the child (runs between fork and exec)."""
        cpu = self.limits.cpu_seconds
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (self.limits.memory_bytes,) * 2)
        cap = self._file_cap()
        resource.setrlimit(resource.RLIMIT_FSIZE, (cap, cap))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    def _file_cap(self) -> int:
        return max(self.limits.file_bytes, self.limits.output_bytes + 1)

    def close(self) -> None:
        """Remove the sandbox's directories."""
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(self._logs, ignore_errors=True)

    def __enter__(self) -> PythonSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group (it was started in its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
