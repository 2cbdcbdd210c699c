"""reward.timeout_s: a custom reward that never returns is killed after timeout_s (error or score
0, as configured), close() never waits on it, and no process is left."""

from __future__ import annotations

import time

import pytest

from rlhf_megatron.rewards import RewardConfig, RewardError, RewardManager
from rlhf_megatron.rewards.process import RewardTimeout
from rlhf_megatron.testing.processes import is_alive

SLOW = ("import time\n"
        "def f(responses, answers, **kw):\n"
        "    print('noise on stdout must not break the protocol')\n"
        "    if responses[0] == 'hang':\n"
        "        time.sleep(3600)\n"
        "    return [float(r == a) for r, a in zip(responses, answers)]\n"
        # verl's per-sample signature (issue 28): the same child process and deadline
        "def verl_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if solution_str == 'hang':\n"
        "        time.sleep(3600)\n"
        "    return {'score': float(solution_str == ground_truth)}\n")


@pytest.fixture(scope="module")
def slow_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "slow.py"
    path.write_text(SLOW)
    return path


@pytest.fixture(scope="module")
def reward_file(slow_file) -> str:
    return f"{slow_file}:f"


@pytest.mark.parametrize("function", ["f", "verl_score"])
def test_overrun_is_one_line_naming_the_function_and_the_process_dies(slow_file, function):
    reward_file = f"{slow_file}:{function}"
    manager = RewardManager(RewardConfig(custom_function=reward_file, timeout_s=1.5))
    try:
        assert manager.compute(["a", "b"], ["a", "c"]).tolist() == [1.0, 0.0]
        pid = manager._process._proc.pid
        start = time.monotonic()
        with pytest.raises(RewardTimeout) as info:
            manager.compute(["hang"], ["x"])
        assert time.monotonic() - start < 1.5 + 1.0
        message = str(info.value)
        assert "\n" not in message and reward_file in message and "1.5s" in message
        assert not is_alive(pid)
        # the next batch gets a fresh process
        assert manager.compute(["a"], ["a"]).tolist() == [1.0]
    finally:
        manager.close()


def test_zero_on_timeout_counts_and_close_never_waits(reward_file, capsys):
    manager = RewardManager(RewardConfig(custom_function=reward_file, timeout_s=1.0,
                                         on_timeout="zero"))
    assert manager.compute(["hang", "b"], ["x", "b"]).tolist() == [0.0, 0.0]
    assert manager.timeouts == 1 and "1 timed-out batches so far" in capsys.readouterr().err
    manager.cfg.timeout_s = 60.0
    future = manager.compute_async(["hang"], ["x"])
    time.sleep(0.5)
    pid = manager._process._proc.pid
    start = time.monotonic()
    manager.close()
    assert time.monotonic() - start < 2.0 and not is_alive(pid)
    with pytest.raises(RewardError):
        future.result(timeout=5)


@pytest.mark.parametrize("field, value", [("timeout_s", 0), ("timeout_s", float("nan")),
                                          ("on_timeout", "ignore")])
def test_bad_timeout_settings(field, value):
    with pytest.raises(RewardError, match=f"reward.{field}"):
        RewardConfig(**{field: value}).validate()


def test_child_starts_without_torch_yet_serves_the_package(tmp_path):
    """The reward process skips the package __init__ (torch) unless the user's code needs it."""
    light, heavy = tmp_path / "light.py", tmp_path / "heavy.py"
    light.write_text("import sys\ndef f(r, a, **k):\n    return [float('torch' in sys.modules)]\n")
    heavy.write_text("from rlhf_megatron.rewards import extract_last_number\n"
                     "def f(r, a, **k):\n    return [float(extract_last_number(r[0]) == '3')]\n")
    for path, expected in ((light, 0.0), (heavy, 1.0)):
        with RewardManager(RewardConfig(custom_function=f"{path}:f", timeout_s=60)) as manager:
            assert manager.compute(["so it is 3"], ["3"]).tolist() == [expected]
