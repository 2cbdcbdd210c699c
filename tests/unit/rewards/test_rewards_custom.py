"""Loading and calling custom batched reward functions: success and every one-line error."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_megatron.rewards import RewardError, load_custom_reward

# The seed example: TRL's accuracy_reward signature.
ACCURACY = """
def accuracy_reward(completions, solution, **kwargs):
    return [1.0 if c.strip() == s.strip() else 0.0 for c, s in zip(completions, solution)]
"""


def _write(tmp_path: Path, body: str, name: str = "reward.py") -> Path:
    path = tmp_path / name
    path.write_text(body)
    return path


def _spec(tmp_path: Path, body: str, fn: str = "f", name: str = "reward.py") -> str:
    return f"{_write(tmp_path, body, name)}:{fn}"


def _error(spec: str, *call: list[str]) -> str:
    with pytest.raises(RewardError) as info:
        fn = load_custom_reward(spec)
        fn(*call)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_trl_style_batch_function(tmp_path: Path) -> None:
    fn = load_custom_reward(_spec(tmp_path, ACCURACY, fn="accuracy_reward"))
    assert fn(["a", " b ", "c"], ["a", "b", "x"], data_sources=None) == [1.0, 1.0, 0.0]


def test_only_accepted_keywords_are_passed(tmp_path: Path) -> None:
    body = "def f(responses, answers, data_sources=None):\n    return [len(data_sources)] * 2\n"
    fn = load_custom_reward(f"{_write(tmp_path, body)}:f")
    assert fn(["a", "b"], ["a", "b"], data_sources=["x", "y"], unused=1) == [2.0, 2.0]


def test_same_stem_files_do_not_collide(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    one = _write(tmp_path / "a", "def f(r, a):\n    return [1.0] * len(r)\n")
    two = _write(tmp_path / "b", "def f(r, a):\n    return [2.0] * len(r)\n")
    assert load_custom_reward(f"{one}:f")(["x"], ["y"]) == [1.0]
    assert load_custom_reward(f"{two}:f")(["x"], ["y"]) == [2.0]


def test_missing_file(tmp_path: Path) -> None:
    assert "does not exist" in _error(f"{tmp_path / 'nope.py'}:f")


def test_not_a_py_file(tmp_path: Path) -> None:
    assert "is not a .py file" in _error(_spec(tmp_path, ACCURACY, name="reward.txt"))


def test_spec_without_function() -> None:
    assert "must have the form 'path/to/file.py:function'" in _error("reward.py")


def test_function_missing(tmp_path: Path) -> None:
    assert "has no function 'nope'" in _error(_spec(tmp_path, ACCURACY, fn="nope"))


def test_not_callable(tmp_path: Path) -> None:
    assert "'f' is not callable (type int)" in _error(_spec(tmp_path, "f = 3\n"))


def test_import_fails(tmp_path: Path) -> None:
    message = _error(_spec(tmp_path, "raise ImportError('no sympy')\n"))
    assert "raised ImportError: no sympy" in message


def test_function_raises(tmp_path: Path) -> None:
    body = "def f(r, a):\n    raise ValueError('bad\\nanswer')\n"
    spec = f"{_write(tmp_path, body)}:f"
    assert _error(spec, ["x"], ["y"]) == f"reward function {spec} raised ValueError: bad answer"


def test_wrong_length(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "def f(r, a):\n    return [1.0] * 3\n")
    message = _error(spec, ["x"] * 4, ["y"] * 4)
    assert message.endswith("returned 3 rewards for 4 responses")


@pytest.mark.parametrize(
    ("returned", "expected"),
    [
        ("[1.0, 'x']", "non-numeric reward 'x' (str) at index 1"),
        ("[None, 1.0]", "non-numeric reward None (NoneType) at index 0"),
        ("[True, 1.0]", "non-numeric reward True (bool) at index 0"),
        ("[1.0, float('nan')]", "non-finite reward nan at index 1"),
        ("[float('inf'), 0.0]", "non-finite reward inf at index 0"),
        ("1.0", "returned float, expected a list of floats"),
    ],
)
def test_bad_values(tmp_path: Path, returned: str, expected: str) -> None:
    spec = _spec(tmp_path, "def f(r, a):\n    return " + returned + "\n")
    assert expected in _error(spec, ["x", "y"], ["x", "y"])


def test_tensor_result_is_accepted(tmp_path: Path) -> None:
    body = "import torch\ndef f(r, a):\n    return torch.ones(len(r))\n"
    assert load_custom_reward(f"{_write(tmp_path, body)}:f")(["x", "y"], ["x", "y"]) == [1.0, 1.0]
