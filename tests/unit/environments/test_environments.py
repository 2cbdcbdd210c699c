"""Environment interface, loader errors and the sandboxed Python tool (issue 15 items 1 + acceptance).

Every misbehaving tool call must come back within its limits with a logged one-line error; the
episode continues (documented in environments/arithmetic.py) and ends with reward 0.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from rlhf_megatron.cli import main
from rlhf_megatron.environments import PythonSandbox, SandboxLimits, load_environment
from rlhf_megatron.environments.arithmetic import (
    ArithmeticToolEnv,
    extract_code,
    make_arithmetic_samples,
)
from rlhf_megatron.environments.loader import EnvironmentLoadError

REPO = Path(__file__).resolve().parents[3]
LIMITS = SandboxLimits(cpu_seconds=1, wall_seconds=1.5, memory_bytes=256 * 2**20,
                       output_bytes=512, file_bytes=64 * 2**10)
OUTSIDE = Path("/tmp") / f"rlhf_sandbox_escape_{os.getpid()}.txt"

BAD_TOOLS = {
    "hang": ("import time\ntime.sleep(30)", "timeout"),
    "spin": ("while True:\n    pass", "timeout"),
    "crash": ("raise ValueError('boom')", "error"),
    "segfault": ("import os\nos.abort()", "error"),
    "flood": ("while True:\n    print('x' * 1000)", "output_limit"),
    "socket": ("import socket\nsocket.create_connection(('127.0.0.1', 9))", "error"),
    "write_outside": (f"open({str(OUTSIDE)!r}, 'w').write('escaped')", "error"),
    "memory": ("x = bytearray(2 ** 30)", "error"),
    "subprocess": ("import subprocess\nsubprocess.run(['true'])", "error"),
}


@pytest.fixture(scope="module")
def sandbox():
    with PythonSandbox(LIMITS) as box:
        yield box


def test_tool_runs_code_and_writes_inside_its_directory(sandbox):
    result = sandbox.run("open('note.txt', 'w').write('hi')\nprint(1234 * 5678 + 9)")
    assert result.ok and result.output.strip() == str(1234 * 5678 + 9)
    assert (sandbox.root / "note.txt").read_text() == "hi"


@pytest.mark.parametrize("name", list(BAD_TOOLS))
def test_misbehaving_tool_is_contained(sandbox, name):
    code, status = BAD_TOOLS[name]
    start = time.monotonic()
    result = sandbox.run(code)
    assert time.monotonic() - start < LIMITS.wall_seconds + 2.0
    assert result.status == status, result
    assert result.error and "\n" not in result.error
    assert len(result.output) <= LIMITS.output_bytes
    assert not OUTSIDE.exists()
    if name in ("socket", "write_outside", "subprocess"):
        assert "sandbox:" in result.error  # refused by the audit hook, not a lucky failure


@pytest.mark.parametrize("name", ["hang", "crash", "flood", "socket", "write_outside"])
def test_episode_continues_after_a_bad_tool_and_scores_zero(caplog, name):
    env = ArithmeticToolEnv(limits=LIMITS)
    messages = env.reset({"prompt": "What is 2 * 3 + 1?", "answer": "7"})
    assert messages[-1]["content"] == "What is 2 * 3 + 1?"
    with caplog.at_level(logging.WARNING, logger="rlhf_megatron.environments.arithmetic"):
        obs, reward, done = env.step(f"<python>{BAD_TOOLS[name][0]}</python>")
    assert not done and reward is None
    assert obs[0]["role"] == "tool" and obs[0]["content"].startswith("Error: ")
    assert any("arithmetic_tool" in r.getMessage() for r in caplog.records)
    stats = env.tool_stats
    assert stats.calls == 1 and stats.errors + stats.timeouts == 1 and len(stats.error_log) == 1
    obs, reward, done = env.step("I do not know.")
    assert done and reward == 0.0 and obs == []
    env.close()


def test_tool_then_answer_scores_one():
    sample = make_arithmetic_samples(1, seed=3)[0]
    env = ArithmeticToolEnv(limits=LIMITS, tool_bonus=0.1)
    env.reset(sample)
    expr = sample["prompt"].removeprefix("What is ").removesuffix("?")
    obs, reward, done = env.step(f"Let me compute. <python>print({expr})</python>")
    assert not done and reward == 0.1 and obs[0]["content"] == sample["answer"]
    assert env.step(f"<answer>{sample['answer']}</answer>") == ([], 1.0, True)
    env.close()
    assert env._sandbox is None  # close() removed the sandbox directory


def test_json_tool_call_format():
    text = '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>'
    assert extract_code(text) == "print(1)"
    assert extract_code("<python> print(2) </python>") == "print(2)"
    assert extract_code("no call") is None


def _env_file(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "my_env.py"
    path.write_text(body)
    return path


def test_loader_builtin_and_user_class(tmp_path):
    assert load_environment("arithmetic_tool") is ArithmeticToolEnv
    path = _env_file(tmp_path, "class Env:\n    def reset(self, s): return []\n"
                               "    def step(self, t): return [], 1.0, True\n")
    assert load_environment(f"{path}:Env").__name__ == "Env"


@pytest.mark.parametrize("spec, needle", [
    ("nowhere/env.py:Env", "does not exist"),
    ("{dir}/my_env.py", "must have the form 'path/to/file.py:class'"),
    ("{dir}/my_env.py:Missing", "has no class 'Missing'"),
    ("{dir}/my_env.py:not_a_class", "is not a class"),
    ("{dir}/my_env.py:NoStep", "has no step method"),
])
def test_loader_errors_are_one_line(tmp_path, spec, needle):
    _env_file(tmp_path, "not_a_class = len\nclass NoStep:\n    def reset(self, s): return []\n")
    with pytest.raises(EnvironmentLoadError) as info:
        load_environment(spec.format(dir=tmp_path))
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_bad_environment_exits_2_with_one_line(tmp_path, capsys):
    code = main(["train", "--config", str(REPO / "configs" / "quickstart_cpu.yaml"),
                 f"environment.path={tmp_path}/missing.py:Env", f"trainer.run_dir={tmp_path}/r"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "environment" in err[0] and "does not exist" in err[0]


def test_the_retired_batched_episode_engine_exits_2_with_one_line(tmp_path, capsys):
    code = main(["train", "--config", str(REPO / "configs" / "quickstart_tools_cpu.yaml"),
                 "environment.engine=batched", f"trainer.run_dir={tmp_path}/r"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "environment.engine" in err[0], err


def test_episodes_pick_the_async_engine():
    """The trainer's rollout workers: AsyncLLM for episodes, the batch engine for single-turn
    sync runs."""
    from rlhf_megatron.cluster.groups import rollout_worker_class
    from rlhf_megatron.config import load_config
    from rlhf_megatron.workers import RolloutWorker
    from rlhf_megatron.workers.async_rollout_worker import AsyncRolloutWorker

    tools = REPO / "configs" / "quickstart_tools_cpu.yaml"
    assert rollout_worker_class(load_config(tools)) is AsyncRolloutWorker
    assert rollout_worker_class(load_config(REPO / "configs" / "quickstart_cpu.yaml")) \
        is RolloutWorker
