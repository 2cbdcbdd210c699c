"""Episode rewards in the controller (issue 27 item 4): an episode whose agent returned None is
scored by the configured ``reward:`` section on its generated text, and that reward sits at the
episode's last generated token, not at its last token (a tool's output may come after it)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from rlhf_megatron import quickstart as rl_quickstart
from rlhf_megatron import quickstart_tools
from rlhf_megatron.config import load_config
from rlhf_megatron.controller.phases import compute_advantages_phase, score_episodes
from rlhf_megatron.data.batch import TokenBatch
from rlhf_megatron.data.prompts import PromptRow
from rlhf_megatron.rewards import RewardConfig, RewardManager

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_an_episode_left_unscored_takes_the_configured_reward_at_its_last_generated_token(
        tmp_path):
    tok = rl_quickstart.write_tokenizer(tmp_path, quickstart_tools.vocabulary(),
                                        quickstart_tools.CHAT_TEMPLATE)
    cfg = load_config(REPO_ROOT / "configs" / "quickstart_agent_cpu.yaml")
    rewards = RewardManager(RewardConfig(reward_name="math_numeric"))
    run = SimpleNamespace(cfg=cfg, rewards=rewards, tokenizer=tok,
                          groups=SimpleNamespace(reward_model=None))
    prompt = tok.encode("1 + 2", add_special_tokens=False)
    right = tok.encode("<answer> 3 </answer>", add_special_tokens=False)
    wrong = tok.encode("<answer> 4 </answer>", add_special_tokens=False)
    observation = tok.encode("7", add_special_tokens=False)
    streams = [prompt + right + observation, prompt + right + observation, prompt + wrong]
    width = max(len(s) for s in streams)
    ids = torch.zeros(3, width, dtype=torch.long)
    loss = torch.zeros(3, width, dtype=torch.long)
    for i, stream in enumerate(streams):
        ids[i, :len(stream)] = torch.tensor(stream)
        loss[i, len(prompt):len(prompt) + len(right)] = 1
    last_generated = len(prompt) + len(right) - 1
    env_rewards = torch.zeros(3, width)
    env_rewards[0, last_generated] = 0.25  # row 0: the agent's own reward
    batch = TokenBatch(ids, (ids != 0).long() | loss, loss, {
        "prompt_index": torch.tensor([0, 0, 0]), "episode_rewards": env_rewards,
        "episode_scored": torch.tensor([True, False, False])})
    rows = [PromptRow(prompt="1 + 2", answer="3", data_source="arithmetic",
                      origin="test line 1")]

    scores = score_episodes(run, batch, rows, torch.tensor([0.25, 0.0, 0.0])).result()
    assert scores.tolist() == [0.25, 1.0, 0.0]
    out, _ = compute_advantages_phase(run, batch, scores)
    token = out.fields["token_level_rewards"]
    assert token[0, last_generated] == 0.25 and token[1, last_generated] == 1.0
    assert token.sum().item() == 1.25  # nothing at row 1's observation, nothing on row 2
    assert batch.fields["episode_rewards"][1].sum() == 0  # the batch's field is left as it was

    everything_scored = batch.with_fields(episode_scored=torch.ones(3, dtype=torch.bool))
    given = torch.tensor([0.25, 0.5, 0.0])
    assert score_episodes(run, everything_scored, rows, given).result() is given
