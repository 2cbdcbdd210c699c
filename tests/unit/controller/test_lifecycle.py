"""lifecycle.py: the cause kept from a dead Ray actor, refit segments unlinked for killed and
vanished processes, and the signal handler's two behaviours (wait for the step / stop now)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from rlhf_megatron.cluster.lifecycle import (
    EXIT_INTERRUPTED,
    EXIT_PREEMPTED,
    GracefulStop,
    StopRequested,
    actor_death_reason,
    remove_orphan_segments,
    remove_refit_segments,
)


class _FakeActorError(Exception):
    def __init__(self, error_msg: str) -> None:
        super().__init__(error_msg)
        self.error_msg = error_msg


def test_death_in_constructor_keeps_the_exception_line():
    text = ("The actor died because of an error raised in its creation task, "
            "ray::RolloutWorker.__init__() (pid=4242, ip=10.1.2.3, actor_id=ab)\n"
            "  File \"/x/vllm_engine.py\", line 12, in __init__\n    raise ValueError(...)\n"
            "ValueError: max_model_len 16 is smaller than the prompt")
    reason = actor_death_reason(_FakeActorError(text))
    assert reason.startswith("ValueError: max_model_len 16 is smaller than the prompt"), reason
    assert "4242" in reason  # where its log is (or at least which process)


def test_system_death_skips_ray_boilerplate():
    text = ("The actor died unexpectedly before finishing this task.\n\tclass_name: MegatronWorker"
            "\n\tactor_id: 12ab\n\tpid: 999999\n\tname: actor[1]\n\tip: 127.0.0.1\n"
            "The actor is dead because its worker process has died. Worker exit type: "
            "SYSTEM_ERROR Worker exit detail: killed by the OOM killer. Some common causes include: "
            "(1) the process was killed by the OOM killer due to high memory usage")
    reason = actor_death_reason(_FakeActorError(text))
    assert reason.startswith("The actor is dead because its worker process has died"), reason
    assert "OOM killer" in reason and "999999" in reason and "common causes" not in reason


def test_segments_of_killed_and_vanished_processes_are_unlinked(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    mine = tmp_path / f"rlhf_megatron_refit_{os.getpid()}_aaaa"
    orphan = tmp_path / f"rlhf_megatron_refit_{dead}_bbbb"
    killed = tmp_path / "rlhf_megatron_refit_123456789_cccc"
    other = tmp_path / "something_else"
    for path in (mine, orphan, killed, other):
        path.write_bytes(b"x")
    assert remove_refit_segments([123456789], tmp_path) == [killed]
    assert remove_orphan_segments(tmp_path) == [orphan]
    assert mine.exists() and other.exists()


def test_signal_in_the_loop_waits_outside_it_stops_at_once():
    # What SIGINT did before (SIG_IGN when the suite runs in the background, e.g. under nohup).
    before = signal.getsignal(signal.SIGINT)
    stop = GracefulStop()
    stop.install()
    try:
        stop.in_loop = True
        os.kill(os.getpid(), signal.SIGUSR1)  # handled before the next bytecode
        assert stop.signal_name == "SIGUSR1"
        exc = stop.stop_after(3, None)
        assert exc.exit_code == EXIT_PREEMPTED and "after step 3" in str(exc)
        with pytest.raises(StopRequested, match="again") as info:  # a second one: at once
            os.kill(os.getpid(), signal.SIGINT)
        assert info.value.exit_code == EXIT_PREEMPTED
        fresh = GracefulStop()
        fresh.install()
        with pytest.raises(StopRequested, match="during start-up") as info:
            os.kill(os.getpid(), signal.SIGINT)
        assert info.value.exit_code == EXIT_INTERRUPTED
        fresh.restore()
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGINT) is before
