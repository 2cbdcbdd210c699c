"""Agents in processes of their own (environment.agent.processes, issue 27): the episodes run in
the pool's processes, not the caller's; an agent that kills its process fails only that process's
episodes, and the process is started again for the next rollout; a hanging agent is cancelled
at its time limit and its process keeps serving; a result that is not a reward is refused in one
line; closing the pools leaves no process behind."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time

from rlhf_megatron import quickstart as rl_quickstart
from rlhf_megatron import quickstart_tools
from rlhf_megatron.environments.config import AgentConfig, EnvironmentConfig
from rlhf_megatron.environments.loader import load_agent
from rlhf_megatron.rollout import SamplingSettings
from rlhf_megatron.rollout.agent_episodes import AgentRunner
from rlhf_megatron.rollout.agent_processes import close_pools
from rlhf_megatron.rollout.episodes import NO_OPTIONS, ChatFormat, TurnOutput

AGENT = '''
import asyncio
import os

import openai

async def agent(base_url, api_key, sample, parent):
    if sample["prompt"] == "exit":
        await asyncio.sleep(0.3)
        os._exit(3)
    if sample["prompt"] == "slow":  # still running when its process's "exit" episode kills it
        await asyncio.sleep(2)
    if sample["prompt"] == "hang":
        await asyncio.sleep(3600)
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    async with client:
        reply = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": sample["prompt"]}])
    if sample["prompt"] == "dict":
        return {"reward": 1.0}
    return float(os.getpid() != parent and "59" in reply.choices[0].message.content)
'''


def test_agents_run_in_their_own_processes_and_a_dead_one_is_replaced(tmp_path):
    chat = ChatFormat(rl_quickstart.write_tokenizer(
        tmp_path / "tok", quickstart_tools.vocabulary(), quickstart_tools.CHAT_TEMPLATE))

    async def policy(e, max_tokens, options=NO_OPTIONS):
        await asyncio.sleep(0.05)
        ids = chat.encode("<answer> 59 </answer>") + [chat.tokenizer.eos_token_id]
        return TurnOutput(ids, [-0.5] * len(ids), "stop")

    agent_file = tmp_path / "agent.py"
    agent_file.write_text(AGENT)
    spec = f"{agent_file}:agent"
    cfg = EnvironmentConfig(agent=AgentConfig(path=spec, timeout_seconds=20, processes=2,
                                              kwargs={"parent": os.getpid()}),
                            max_turns=2, max_tokens_per_turn=16, max_tokens_per_episode=32)
    cfg.validate()
    runner = AgentRunner(load_agent(spec), cfg, chat, policy,
                         SamplingSettings(temperature=1.0, max_tokens=16))

    def rollout(prompts):
        episodes = asyncio.run(runner.run_async([{"prompt": p} for p in prompts]))
        return [e.reward for e in episodes], [e.env.error for e in episodes]

    try:
        # Round-robin: even episodes on process 0, odd ones on process 1.
        rewards, errors = rollout(["1 + 2"] * 8)
        assert rewards == [1.0] * 8 and errors == [None] * 8  # each ran outside this process
        rewards, errors = rollout(["exit", "1 + 2", "slow", "1 + 2"])
        assert rewards == [0.0, 1.0, 0.0, 1.0], (rewards, errors)
        assert errors[0] == errors[2] == "the agent's process died (exit code 3)", errors
        rewards, errors = rollout(["1 + 2", "1 + 2", "dict", "1 + 2"])  # process 0 started again
        assert rewards == [1.0, 1.0, 0.0, 1.0], (rewards, errors)
        assert errors[2].startswith("returned {'reward': 1.0}: an agent returns"), errors
        runner.cfg.agent.timeout_seconds = 1.0
        rewards, errors = rollout(["hang", "1 + 2"])
        assert rewards == [0.0, 1.0] and "timeout_seconds=1.0" in errors[0], errors
        runner.cfg.agent.timeout_seconds = 20
        assert rollout(["1 + 2", "1 + 2"])[0] == [1.0, 1.0]  # the hang was cancelled there
    finally:
        close_pools()
    # Every agent process ends; under a loaded CI machine (session 26's third rehearsal) one was
    # still exiting when close_pools returned, so give a SIGKILLed process time to be reaped.
    deadline = time.monotonic() + 15
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not multiprocessing.active_children()
