"""The shared Ray head of the test suite (testing/train_runs.RayHead) comes back when it dies:
stop 35's CI lost its head mid-suite, and every run after it waited minutes on a dead GCS and
failed. `address` must hand out a live head, and say why the old one went."""

from __future__ import annotations

import os
import signal

from rlhf_megatron.testing.train_runs import RayHead


def test_a_dead_head_is_started_again_and_its_death_is_reported(capsys) -> None:
    head = RayHead(num_cpus=1)
    try:
        first = head.address
        assert head.address == first and head.restarts == 0  # alive: the same one
        os.killpg(head.process.pid, signal.SIGKILL)  # the head, its GCS and raylet
        head.process.wait(timeout=30)
        second = head.address
        assert head.restarts == 1 and head.process.poll() is None
        assert "the shared Ray head is gone (its process ended, rc=-9)" in capsys.readouterr().err
        assert head._dead() == ""  # the new GCS answers
        head._address, live = "127.0.0.1:1", second  # nothing listens there
        assert head._dead().startswith("its GCS at 127.0.0.1:1 does not answer")
        head._address = live
    finally:
        head.stop()
