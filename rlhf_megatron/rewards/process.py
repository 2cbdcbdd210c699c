"""A custom reward function in a child process the trainer can kill.

User code may hang (a grader waiting on a network, an endless loop); a thread cannot be stopped,
a process can. `RewardProcess.call` sends one batch and waits at most `timeout_s`; on overrun it
kills the process (a fresh one starts on the next call) and raises `RewardTimeout`. The child
dies with the trainer too (PR_SET_PDEATHSIG), so a kill -9 of the trainer leaves nothing behind.

Protocol on the child's stdin/stdout: 8-byte big-endian length + pickle, both ways. The child
first answers ("ready", None) or ("error", message) after loading the function, then one
("ok", (rewards, metrics)) or ("error", message) per batch. The user's prints go to stderr.

    python -c "$_CHILD" "path/to/file.py:function"      # how RewardProcess starts it
"""

from __future__ import annotations

import ctypes
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import Any, BinaryIO

from rlhf_megatron.rewards.custom import load_custom_reward
from rlhf_megatron.rewards.errors import RewardError

_HEADER = struct.Struct(">Q")
# The child starts without the package's __init__ (which imports torch, ~4 s): a stand-in
# package runs the real __init__ only if the user's code asks it for a name.
_CHILD = """
import pathlib, sys, types
import rlhf_megatron
init = pathlib.Path(rlhf_megatron.__file__).parent / "rewards" / "__init__.py"
package = types.ModuleType("rlhf_megatron.rewards")
package.__path__, package.__file__ = [str(init.parent)], str(init)
def _load_all(name):
    exec(compile(init.read_text(), str(init), "exec"), package.__dict__)
    del package.__dict__["__getattr__"]
    return getattr(package, name)
package.__getattr__ = _load_all
sys.modules["rlhf_megatron.rewards"] = package
from rlhf_megatron.rewards.process import main
main(sys.argv[1])
"""
LOAD_TIMEOUT_S = 300.0
"""How long the child may take to start and import the reward file (not counted in timeout_s)."""


class RewardTimeout(RewardError):
    """The custom reward function did not return within reward.timeout_s."""


def _write(stream: BinaryIO, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    chunks, got = [], 0
    while got < n:
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([fd], [], [], wait)
        if not ready:
            raise TimeoutError
        chunk = os.read(fd, n - got)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


class RewardProcess:
    """The function `spec` ("file.py:function") served by a child process.

    Args:
        spec: the custom reward spec (the child loads it with load_custom_reward).
    """

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def _start(self) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", _CHILD, self.spec],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        self._proc = proc
        kind, value = self._receive(proc, LOAD_TIMEOUT_S, "loading")
        if kind != "ready":
            self.kill()
            raise RewardError(value)
        return proc

    def call(self, responses: list[str], answers: list[Any], extra: dict[str, Any],
             timeout_s: float) -> tuple[list[float], dict[str, float]]:
        """The checked rewards of one batch and the means of the function's extra keys
        (custom.Scored; RewardError as CustomReward raises them); RewardTimeout after
        `timeout_s` seconds, with the child killed."""
        with self._lock:
            proc = self._proc if self._proc is not None and self._proc.poll() is None \
                else self._start()
            try:
                _write(proc.stdin, (responses, answers, extra))
            except (BrokenPipeError, OSError):
                self.kill()
                raise RewardError(f"reward function {self.spec}: its process ended") from None
            kind, value = self._receive(proc, timeout_s, "scoring")
        if kind == "error":
            raise RewardError(value)
        return value

    def _receive(self, proc: subprocess.Popen, timeout_s: float, doing: str) -> tuple[str, Any]:
        deadline = time.monotonic() + timeout_s
        fd = proc.stdout.fileno()
        try:
            size = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline))[0]
            return pickle.loads(_read_exact(fd, size, deadline))
        except TimeoutError:
            self.kill()
            raise RewardTimeout(f"reward function {self.spec} did not return within "
                                f"{timeout_s:g}s ({doing}; reward.timeout_s); its process was "
                                "killed") from None
        except (EOFError, OSError, pickle.UnpicklingError):
            code = self.kill()
            status = "it was killed" if code is None else f"exit status {code}"
            raise RewardError(f"reward function {self.spec}: its process ended while {doing} "
                              f"({status})") from None

    def kill(self) -> int | None:
        """Kill the child now (never waits on user code); returns its exit status."""
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.kill()
        code = proc.wait(timeout=10)
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        return code


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the trainer dies (even by kill -9)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main(spec: str) -> None:
    """The child: load `spec`, then score batches until stdin closes."""
    _die_with_parent()
    # Ctrl-C in a terminal and the launcher's SIGUSR1 are for the trainer, which stops at the
    # step's end and still needs its rewards; it kills this process itself.
    for name in ("SIGINT", "SIGUSR1"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the user's prints must not corrupt the protocol
    stdin = sys.stdin.buffer

    try:
        fn = load_custom_reward(spec)
    except RewardError as exc:
        _write(out, ("error", str(exc)))
        return
    _write(out, ("ready", None))
    while header := stdin.read(_HEADER.size):
        responses, answers, extra = pickle.loads(stdin.read(_HEADER.unpack(header)[0]))
        try:
            scored = fn.score(responses, answers, **extra)
            _write(out, ("ok", (scored.rewards, scored.metrics)))
        except RewardError as exc:
            _write(out, ("error", str(exc)))
