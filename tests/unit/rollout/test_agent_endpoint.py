"""The agent endpoint's OpenAI surface over real HTTP, without an engine (issue 27): token-by-token
server-sent events, ``n`` choices and the session going on with the one sent back, top
log-probs, ``stop``, the ``X-Session-Id`` header, ``/v1/completions``, a prompt the engine
refuses and a client that drops a stream mid-turn. The policy is a scripted turn generator on
the tools quickstart's word-level tokenizer that streams its ids one at a time; the clients are
the ``openai`` SDK and aiohttp, in agents run by the AgentRunner as in a rollout."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from rlhf_megatron import quickstart as rl_quickstart
from rlhf_megatron import quickstart_tools
from rlhf_megatron.environments.config import AgentConfig, EnvironmentConfig
from rlhf_megatron.environments.loader import load_agent
from rlhf_megatron.rollout import SamplingSettings
from rlhf_megatron.rollout.agent_episodes import AgentRunner
from rlhf_megatron.rollout.episodes import NO_OPTIONS, ChatFormat, TurnOutput

SAMPLING = SamplingSettings(temperature=1.0, top_p=0.9, max_tokens=16)


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    return ChatFormat(rl_quickstart.write_tokenizer(out, quickstart_tools.vocabulary(),
                                                    quickstart_tools.CHAT_TEMPLATE))


class ScriptedPolicy:
    """A turn generator: choice j of turn t says ``texts(t, j)``, one id at a time through
    ``on_tokens``, stopping where a ``stop`` string appears (as vLLM does: the id that completes
    it is the last). After ``pause_after`` ids of the first turn it waits for ``resume`` (set by
    a client that has read a streamed chunk) for at most 20 s, and records whether it had to
    give up: a reply sent only after the turn would leave it waiting."""

    def __init__(self, chat: ChatFormat, texts, pause_after: int | None = None) -> None:
        self.chat, self.texts, self.pause_after = chat, texts, pause_after
        self.resume = threading.Event()
        self.gave_up = False
        self.refuse_longer_than: int | None = None

    async def __call__(self, e, max_tokens, options=NO_OPTIONS) -> TurnOutput:
        if self.refuse_longer_than is not None and len(e.ids) > self.refuse_longer_than:
            raise ValueError(f"the prompt ({len(e.ids)} tokens) is longer than the maximum "
                             f"model length of {self.refuse_longer_than}")
        tok = self.chat.tokenizer
        ids = (self.chat.encode(self.texts(e.turns, options.choice)) + [tok.eos_token_id])
        ids = ids[:max_tokens]
        out: list[int] = []
        for k, i in enumerate(ids):
            out.append(i)
            if options.on_tokens is not None:
                options.on_tokens([i])
            await asyncio.sleep(0.002)
            if e.turns == 0 and k + 1 == self.pause_after:
                deadline = time.monotonic() + 20
                while not self.resume.is_set() and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                self.gave_up = not self.resume.is_set()
            if any(s in tok.decode(out, skip_special_tokens=True) for s in options.stop):
                break
        top = [[(i, -0.25), (i + 1, -1.5)][:options.top_logprobs] for i in out]
        return TurnOutput(out, [-0.25] * len(out), "stop", None,
                          top if options.top_logprobs else None)


def run_agent(chat, policy, source: str, samples, tmp_path: Path, **globals_):
    """``agent`` in ``source`` (its module globals updated with ``globals_``) over ``policy``,
    one episode per sample: (episodes, metrics, the agent module's globals)."""
    agent_file = tmp_path / "agent.py"
    agent_file.write_text(source)
    spec = f"{agent_file}:agent"
    cfg = EnvironmentConfig(agent=AgentConfig(path=spec, timeout_seconds=60), max_turns=3,
                            max_tokens_per_turn=16, max_tokens_per_episode=48)
    agent = load_agent(spec)
    agent.__globals__.update(globals_)
    runner = AgentRunner(agent, cfg, chat, policy, SAMPLING)
    episodes = asyncio.run(runner.run_async(samples))
    return episodes, runner.metrics(episodes), agent.__globals__


STREAMING_AGENT = '''
import openai

SEEN = {}

async def agent(base_url, api_key, sample):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": sample["prompt"]}]
    async with client:
        stream = await client.chat.completions.create(
            model="policy", messages=messages, stream=True, logprobs=True, top_logprobs=2,
            stream_options={"include_usage": True}, **sample.get("extra", {}))
        pieces, logprobs, finish, usage = [], [], None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.total_tokens
            for choice in chunk.choices:
                if choice.delta.content:
                    pieces.append(choice.delta.content)
                    RESUME.set()  # the policy's event: a chunk arrived
                if choice.logprobs is not None and choice.logprobs.content:
                    logprobs += [(x.logprob, [t.logprob for t in x.top_logprobs])
                                 for x in choice.logprobs.content]
                finish = choice.finish_reason or finish
        whole = await client.chat.completions.create(
            model="policy", messages=messages + [
                {"role": "assistant", "content": "".join(pieces)},
                {"role": "user", "content": "2"}])
    SEEN[sample["name"]] = {"pieces": pieces, "logprobs": logprobs, "finish": finish,
                            "usage": usage, "next": whole.choices[0].message.content}
    return 1.0
'''


def test_a_streamed_turn_arrives_token_by_token_and_stops_at_a_stop_string(chat, tmp_path):
    """The client reads content chunks while the turn is still generating (the policy waits
    for the first one); they add up to the turn's text, cut before ``stop``, with every token's
    log-prob and top log-probs, the finish and the usage; the episode keeps the generated ids
    and the next turn continues from them. Cutting at a stop string changes the text against
    the ids, which the token check counts."""
    tool_call = "<python> print( 7 * 8 + 3 ) </python>"
    policy = ScriptedPolicy(chat, lambda turn, choice: tool_call if turn == 0 else
                            "<answer> 59 </answer>", pause_after=3)
    samples = [{"name": "plain", "prompt": "7 * 8 + 3"},
               {"name": "stop", "prompt": "7 * 8 + 3", "extra": {"stop": ["+"]}}]
    episodes, metrics, g = run_agent(chat, policy, STREAMING_AGENT, samples, tmp_path,
                                     RESUME=policy.resume)
    assert not policy.gave_up  # the first chunk reached the client mid-turn
    plain, stop = g["SEEN"]["plain"], g["SEEN"]["stop"]
    assert len(plain["pieces"]) >= 5, plain  # token by token, not one chunk at the end
    assert "".join(plain["pieces"]).split() == tool_call.split()
    first_turn = len(chat.encode(tool_call)) + 1  # and the eos
    assert plain["finish"] == "stop" and plain["usage"] == episodes[0].prompt_len + first_turn
    assert plain["logprobs"] == [(-0.25, [-0.25, -1.5])] * first_turn
    assert "".join(stop["pieces"]).split() == "<python> print( 7 * 8".split()  # cut before "+"
    assert plain["next"].split() == ["<answer>", "59", "</answer>"]
    assert [e.turns for e in episodes] == [2, 2] and metrics["agent/failed_frac"] == 0
    assert metrics["agent/text_mismatches"] == 0
    assert [e.env.token_mismatches for e in episodes] == [0, 1]
