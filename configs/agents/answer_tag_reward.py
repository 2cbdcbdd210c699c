"""The tools quickstart's reward as a verl-style `compute_score`, for agents that leave the reward
to the configured one (configs/agents/calculator_agents_sdk.py): 1.0 when the last
`<answer>N</answer>` the model wrote equals the row's answer, else 0.0.

    reward:
      custom_function: agents/answer_tag_reward.py:compute_score
"""

import re

ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    answers = ANSWER.findall(solution_str)
    return float(bool(answers) and answers[-1] == str(ground_truth).strip())
