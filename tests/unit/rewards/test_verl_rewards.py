"""verl's reward functions unchanged (issue 28 item 2): the per-sample signature
``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` is told from ours by
its parameter names and called once per response with keywords; ``async def`` works for both
signatures; a dict return's ``score`` is the reward and its other numeric keys become
``reward/<key>`` means; all of it through the killable child process (RewardManager)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_megatron.rewards import RewardConfig, RewardError, RewardManager, load_custom_reward

# Written from verl's documented custom_reward_function signature: the data source, the decoded
# response, the ground truth, and the row's extra_info.
VERL_STYLE = '''
import re

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    numbers = re.findall(r"-?[0-9]+", solution_str.replace(",", ""))
    correct = bool(numbers) and numbers[-1] == str(ground_truth)
    bonus = (extra_info or {}).get("bonus", 0.0)
    return {"score": float(correct) + bonus, "acc": correct, "pred": numbers[-1] if numbers else "",
            "source_is_gsm8k": float(data_source == "openai/gsm8k")}

def plain(data_source, solution_str, ground_truth):
    return float(solution_str.strip() == ground_truth)

async def async_verl(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if ground_truth in solution_str else 0.0

async def async_batched(responses, answers, **kwargs):
    return [float(r == a) for r, a in zip(responses, answers)]

def batched_dicts(responses, answers, extra_infos=None):
    return [{"score": float(r == a), "len": len(r)} for r, a in zip(responses, answers)]

def no_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}
'''


@pytest.fixture()
def reward_file(tmp_path: Path) -> Path:
    path = tmp_path / "verl_reward.py"
    path.write_text(VERL_STYLE)
    return path


def test_verl_signature_is_called_per_sample_with_its_extra_info(reward_file: Path) -> None:
    fn = load_custom_reward(f"{reward_file}:compute_score")
    assert fn.per_sample and not fn.is_async
    scored = fn.score(["so 1,000", "it is 7", "nothing"], ["1000", "8", "3"],
                      data_sources=["openai/gsm8k", "openai/gsm8k", "other"],
                      extra_infos=[{"bonus": 0.5}, None, {}])
    assert scored.rewards == [1.5, 0.0, 0.0]
    # The dict's numeric keys are means over the batch; a string ("pred") is not a metric.
    assert scored.metrics == {"reward/acc": pytest.approx(1 / 3),
                              "reward/source_is_gsm8k": pytest.approx(2 / 3)}


def test_a_verl_function_without_extra_info_and_the_async_kinds(reward_file: Path) -> None:
    assert load_custom_reward(f"{reward_file}:plain")(["a", "b"], ["a", "a"]) == [1.0, 0.0]
    fn = load_custom_reward(f"{reward_file}:async_verl")
    assert fn.per_sample and fn.is_async
    assert fn(["x 42 y", "no"], ["42", "42"], data_sources=["d", "d"]) == [1.0, 0.0]
    fn = load_custom_reward(f"{reward_file}:async_batched")
    assert not fn.per_sample and fn.is_async
    assert fn(["a", "b"], ["a", "c"]) == [1.0, 0.0]


def test_batched_dict_returns_and_a_dict_without_score(reward_file: Path) -> None:
    scored = load_custom_reward(f"{reward_file}:batched_dicts").score(["ab", "c"], ["ab", "x"])
    assert scored.rewards == [1.0, 0.0] and scored.metrics == {"reward/len": 1.5}
    with pytest.raises(RewardError, match="returned a dict without 'score' at index 0"):
        load_custom_reward(f"{reward_file}:no_score")(["a"], ["a"])


def test_the_manager_runs_verl_functions_in_its_process_and_keeps_the_metrics(
        reward_file: Path) -> None:
    with RewardManager(RewardConfig(custom_function=f"{reward_file}:compute_score")) as manager:
        rewards = manager.compute(["7", "9"], ["7", "7"], ["openai/gsm8k", "openai/gsm8k"],
                                  extra_infos=[None, None])
        assert rewards.tolist() == [1.0, 0.0]
        rewards = manager.compute_async(["1", "1"], ["1", "1"], ["a", "b"],
                                        extra_infos=[None, None]).result()
        assert rewards.tolist() == [1.0, 1.0]
        # Weighted by batch size over both calls, then forgotten.
        assert manager.take_metrics() == {"reward/acc": 0.75, "reward/source_is_gsm8k": 0.5}
        assert manager.take_metrics() == {}
