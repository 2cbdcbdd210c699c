"""Rewards: rule rewards (GSM8K ``####``, ``\\boxed{}``, last number, exact match) in a registry,
custom batched reward functions loaded from ``"file.py:function"``, and ``RewardManager``, which
scores a batch into a ``(bs,)`` float32 tensor, synchronously or on a thread pool.

    from rlhf_megatron.rewards import RewardConfig, RewardManager
    with RewardManager(RewardConfig(by_data_source={"openai/gsm8k": "gsm8k"})) as rm:
        rewards = rm.compute(responses, answers, data_sources)  # (bs,) float32
"""

from rlhf_megatron.rewards.custom import BatchRewardFn, CustomReward, load_custom_reward
from rlhf_megatron.rewards.errors import RewardError
from rlhf_megatron.rewards.extract import (
    answers_match,
    extract_answer,
    extract_boxed,
    extract_gsm8k,
    extract_last_number,
    parse_ground_truth,
)
from rlhf_megatron.rewards.manager import RewardConfig, RewardManager
from rlhf_megatron.rewards.rules import (
    RULE_REWARDS,
    RuleReward,
    compute_exact_match,
    compute_numeric_match,
    get_rule_reward,
)

__all__ = [
    "RULE_REWARDS",
    "BatchRewardFn",
    "CustomReward",
    "RewardConfig",
    "RewardError",
    "RewardManager",
    "RuleReward",
    "answers_match",
    "compute_exact_match",
    "compute_numeric_match",
    "extract_answer",
    "extract_boxed",
    "extract_gsm8k",
    "extract_last_number",
    "get_rule_reward",
    "load_custom_reward",
    "parse_ground_truth",
]
