"""Agent sessions without an engine (issue 27): the token bookkeeping of a session on the tools
quickstart's word-level tokenizer and chat template, the tag-format tool calls, and the
``environment.agent`` config's one-line errors. The endpoint over a real AsyncLLM with the
``openai`` SDK is tested in tests/integration/rollout/test_async_rollout.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rlhf_megatron import quickstart as rl_quickstart
from rlhf_megatron import quickstart_tools
from rlhf_megatron.config import load_config
from rlhf_megatron.environments.config import AgentConfig, EnvironmentConfig
from rlhf_megatron.environments.loader import load_agent
from rlhf_megatron.errors import ConfigError
from rlhf_megatron.rollout.agent_episodes import AgentRunner
from rlhf_megatron.rollout.agent_sessions import AgentSession, SessionError, SessionTokens
from rlhf_megatron.rollout.agent_tools import parse_tag_calls
from rlhf_megatron.rollout.episodes import NO_OPTIONS, ChatFormat, TurnOutput, record_turn

REPO_ROOT = Path(__file__).resolve().parents[3]
PYTHON_TOOL = {"type": "function", "function": {"name": "python", "parameters": {
    "type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    return ChatFormat(rl_quickstart.write_tokenizer(out, quickstart_tools.vocabulary(),
                                                    quickstart_tools.CHAT_TEMPLATE))


def _turn(chat, session, text):
    ids = chat.encode(text) + [chat.tokenizer.eos_token_id]
    return record_turn(session.episode, TurnOutput(ids, [-0.5] * len(ids), "stop"),
                       chat.tokenizer)


def test_a_session_keeps_generated_ids_and_counts_what_the_agent_changed(chat):
    cfg = EnvironmentConfig(max_turns=3, max_tokens_per_turn=16, max_tokens_per_episode=48)
    tokens = SessionTokens(chat, cfg)
    s = AgentSession("s", 0, {})
    first = [{"role": "user", "content": "7 * 8 + 3"}]
    tokens.open_chat(s, first, [PYTHON_TOOL])
    prompt = list(s.episode.ids)
    assert prompt == chat.prompt_ids(first)
    text = _turn(chat, s, "<python> print( 7 * 8 + 3 ) </python>")
    generated = list(s.episode.ids[len(prompt):])
    s.sent = first + [{"role": "assistant", "content": text}]
    honest = s.sent + [{"role": "tool", "content": "59"}]
    tokens.open_chat(s, honest, [PYTHON_TOOL])
    assert s.state.text_mismatches == s.state.token_mismatches == 0
    # Only the tool turn and the next generation prompt are appended, with loss mask 0.
    assert s.episode.ids == chat.prompt_ids(honest) and s.episode.loss_mask[len(prompt):] == \
        [1] * len(generated) + [0] * (len(s.episode.ids) - len(prompt) - len(generated))
    _turn(chat, s, "<answer> 59 </answer>")
    kept = list(s.episode.ids)
    s.sent = honest + [{"role": "assistant", "content": "<answer> 59 </answer>"}]
    altered = honest + [{"role": "assistant", "content": "<answer> 58 </answer>"},
                        {"role": "user", "content": "1"}]
    tokens.open_chat(s, altered, None)
    assert s.state.text_mismatches == s.state.token_mismatches == 1
    assert s.episode.ids[:len(kept)] == kept  # the generated answer stays as generated
    _turn(chat, s, "2")
    with pytest.raises(SessionError, match="reached its limit") as info:
        tokens.open_chat(s, altered + [{"role": "assistant", "content": "2"}], None)
    assert info.value.status == 400 and s.episode.truncated


def test_completions_continue_the_session_text_or_are_refused(chat):
    tokens = SessionTokens(chat, EnvironmentConfig())
    s = AgentSession("c", 0, {})
    tokens.open_completion(s, "<user> 1 + 2 <eos> <assistant>")
    s.text = "<user> 1 + 2 <eos> <assistant> 3"
    with pytest.raises(SessionError) as info:
        tokens.open_completion(s, "<user> 1 + 2 <eos> <assistant> 4 <eos>")
    assert info.value.status == 409 and s.state.text_mismatches == 1
    with pytest.raises(SessionError, match="completions"):
        tokens.open_chat(s, [{"role": "user", "content": "1"}], None)


def test_tag_calls_of_declared_tools_only():
    calls = parse_tag_calls("a <python> print(1) </python> <shell>ls</shell>", [PYTHON_TOOL])
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [("python", '{"code": "print(1)"}')]


def test_agent_results_that_are_not_rewards_end_the_episode_with_zero_and_none_defers(chat):
    async def agent(base_url, api_key, sample):
        return None

    runner = AgentRunner(agent, EnvironmentConfig(agent=AgentConfig(path="x.py:agent")), chat,
                         None, None)
    for result in ("1", float("nan"), ValueError("boom"), True):
        s = AgentSession("r", 0, {"prompt": "1 + 2"})
        e = runner._finish(s, result)
        assert e.reward == 0.0 and not e.turn_rewards and s.state.error, result
    e = runner._finish(AgentSession("r", 0, {"prompt": "1 + 2"}), 1)
    assert e.reward == 1.0 and e.turn_rewards == [(len(e.ids) - 1, 1.0)]
    # None leaves the reward to the configured one, for an episode that generated something;
    # one that never sent a request has nothing to score and keeps 0.
    idle = AgentSession("r", 0, {"prompt": "1 + 2"})
    e = runner._finish(idle, None)
    assert e.scored and e.reward == 0.0 and not idle.state.error
    s = AgentSession("s", 1, {})
    SessionTokens(chat, runner.cfg).open_chat(s, [{"role": "user", "content": "1 + 2"}], None)
    _turn(chat, s, "<answer> 3 </answer>")
    e = runner._finish(s, None)
    assert not e.scored and not e.turn_rewards and not s.state.error
    assert runner.metrics([e])["agent/reward_by_config_frac"] == 1.0


def test_agent_config_errors_are_one_line(tmp_path):
    agents = tmp_path / "agents.py"
    agents.write_text("def sync_agent(url, key, sample):\n    return 1.0\n"
                      "async def agent(url, key, sample):\n    return 1.0\n")
    cases = {
        f"environment.agent.path={agents}:sync_agent": "not an async function",
        f"environment.agent.path={agents}:missing": "has no function 'missing'",
        f"environment.agent.path={tmp_path}/nope.py:agent": "does not exist",
        "environment.agent.timeout_seconds=0": "expected a number > 0",
        "environment.agent.tool_parser=hermse": "not a vLLM tool parser .known: .*hermes",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError, match=message) as info:
            load_config(None, [override]).environment.validate()
        assert "\n" not in str(info.value)
    both = load_config(None, ["environment.path=arithmetic_tool",
                              f"environment.agent.path={agents}:agent"])
    with pytest.raises(ConfigError, match="not both"):
        both.environment.validate()
    ok = load_config(None, [f"environment.agent.path={agents}:agent",
                            "environment.agent.tool_parser=qwen3_xml"]).environment
    ok.validate()
    assert ok.enabled and asyncio.iscoroutinefunction(load_agent(ok.agent.path))


def test_an_agents_sdk_agent_runs_its_react_loop_through_the_endpoint(chat):
    """configs/agents/calculator_agents_sdk.py, the OpenAI Agents SDK's own loop, over the real
    endpoint and a scripted policy (a tool call, then the answer): the tool ran in the sandbox,
    its output is in the stream with loss mask 0, the SDK sent every turn back as it was
    returned, and the episode is left to the configured reward (answer_tag_reward.py)."""
    from rlhf_megatron.rewards import RewardConfig, RewardManager
    from rlhf_megatron.rollout import SamplingSettings

    script = ["<python> print( 7 * 8 + 3 ) </python>", "<answer> 59 </answer>"]

    async def scripted(e, max_tokens, options=NO_OPTIONS):
        ids = chat.encode(script[min(e.turns, 1)]) + [chat.tokenizer.eos_token_id]
        return TurnOutput(ids, [-0.5] * len(ids), "stop")

    spec = f"{REPO_ROOT / 'configs' / 'agents' / 'calculator_agents_sdk.py'}:calculator"
    cfg = EnvironmentConfig(agent=AgentConfig(path=spec, timeout_seconds=60), max_turns=3,
                            max_tokens_per_turn=16, max_tokens_per_episode=48)
    runner = AgentRunner(load_agent(spec), cfg, chat, scripted,
                         SamplingSettings(temperature=1.0, max_tokens=16))
    episodes = asyncio.run(runner.run_async([{"prompt": "7 * 8 + 3"}] * 2))
    metrics = runner.metrics(episodes)
    assert metrics["agent/failed_frac"] == 0 and metrics["agent/reward_by_config_frac"] == 1
    assert metrics["agent/text_mismatches"] == metrics["agent/token_mismatches"] == 0
    assert metrics["episode/turns_mean"] == 2 and metrics["agent/requests_mean"] == 2
    for e in episodes:
        assert not e.scored and e.turns == 2
        text = chat.tokenizer.decode(e.ids)
        assert "<tool> 59" in text, text  # the sandbox's output, sent back by the SDK
        generated = [i for i, m in zip(e.ids, e.loss_mask, strict=True) if m]
        assert chat.tokenizer.decode(generated, skip_special_tokens=True).split() == \
            " ".join(script).split()
    answer = chat.tokenizer.decode(generated, skip_special_tokens=True)
    reward = RewardManager(RewardConfig(custom_function=str(
        REPO_ROOT / "configs" / "agents" / "answer_tag_reward.py") + ":compute_score"))
    assert reward.compute([answer, script[0]], ["59", "59"]).tolist() == [1.0, 0.0]


DROPPING_AGENT = '''
import asyncio
import contextlib

import aiohttp

from rlhf_megatron.environments.loader import load_agent

calculator = load_agent(CALCULATOR)
TOOLS = calculator.__globals__["PYTHON_TOOL"]


async def agent(base_url, api_key, sample):
    if sample.get("drop"):  # a streamed request dropped mid-turn, as a client timeout does
        body = {"model": "policy", "messages": [{"role": "user", "content": sample["prompt"]}],
                "tools": [TOOLS], "stream": True}
        headers = {"Authorization": f"Bearer {api_key}"}

        async def post():
            async with http.post(f"{base_url}/chat/completions", json=body,
                                 headers=headers) as reply:
                await reply.read()

        async with aiohttp.ClientSession() as http:
            request = asyncio.create_task(post())
            while not STARTED.is_set():  # the server is generating this request's turn
                await asyncio.sleep(0.01)
            request.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await request
        DROPPED.set()
    return await calculator(base_url, api_key, sample)  # retries the same first request
'''


def test_64_sessions_and_a_dropped_connection_end_cleanly(chat, tmp_path):
    """64 concurrent sessions of the openai-SDK calculator (configs/agents/calculator_openai.py)
    and one whose first, streamed request is dropped mid-turn: its retry of the same request gets
    the turn already generated (nothing generated twice), every episode ends with its reward, and
    nothing is left behind (no agent thread, no child process, no /dev/shm file)."""
    import multiprocessing
    import threading

    from rlhf_megatron.rollout import SamplingSettings
    from rlhf_megatron.testing.processes import shm_files

    script = ["<python> print( 7 * 8 + 3 ) </python>", "<answer> 59 </answer>"]
    generated: list[int] = []

    started, dropped = threading.Event(), threading.Event()

    async def scripted(e, max_tokens, options=NO_OPTIONS):
        if e.sample_index == 0 and e.turns == 0:  # the turn outlives its dropped connection
            started.set()
            for _ in range(3000):
                if dropped.is_set():
                    break
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.01)
        generated.append(e.sample_index)
        ids = chat.encode(script[min(e.turns, 1)]) + [chat.tokenizer.eos_token_id]
        return TurnOutput(ids, [-0.5] * len(ids), "stop")

    calculator = REPO_ROOT / "configs" / "agents" / "calculator_openai.py"
    agent_file = tmp_path / "dropping.py"
    agent_file.write_text(f"CALCULATOR = {str(calculator) + ':calculator'!r}\n" + DROPPING_AGENT)
    spec = f"{agent_file}:agent"
    cfg = EnvironmentConfig(agent=AgentConfig(path=spec, timeout_seconds=60), max_turns=3,
                            max_tokens_per_turn=16, max_tokens_per_episode=48)
    shm = shm_files()
    agent = load_agent(spec)
    agent.__globals__.update(STARTED=started, DROPPED=dropped)
    runner = AgentRunner(agent, cfg, chat, scripted,
                         SamplingSettings(temperature=1.0, max_tokens=16))
    samples = [{"prompt": "7 * 8 + 3", "answer": "59", "drop": True}] + \
        [{"prompt": "7 * 8 + 3", "answer": "59"}] * 64
    episodes = asyncio.run(runner.run_async(samples))
    metrics = runner.metrics(episodes)
    assert [e.reward for e in episodes] == [1.0] * 65
    assert metrics["agent/failed_frac"] == 0 and metrics["agent/replays"] == 1
    assert metrics["agent/text_mismatches"] == metrics["agent/token_mismatches"] == 0
    assert generated.count(0) == 2 and len(generated) == 130  # two turns each, none twice
    assert episodes[0].ids == episodes[1].ids
    assert not [t for t in threading.enumerate() if t.name == "agents"]
    assert not multiprocessing.active_children()
    assert shm_files() <= shm
