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


CHOOSING_AGENT = '''
import aiohttp
import openai

SEEN = {}

async def agent(base_url, api_key, sample):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    async with client:
        if sample["api"] == "chat":
            messages = [{"role": "user", "content": sample["prompt"]}]
            reply = await client.chat.completions.create(
                model="policy", messages=messages, n=3, logprobs=True, top_logprobs=1)
            texts = [c.message.content for c in reply.choices]
            chosen = reply.choices[sample["take"]].message
            again = await client.chat.completions.create(model="policy", messages=messages + [
                chosen.model_dump(exclude_none=True), {"role": "user", "content": "2"}])
        else:
            reply = await client.completions.create(
                model="policy", prompt=sample["prompt"], n=2, logprobs=2, max_tokens=8)
            texts = [c.text for c in reply.choices]
            SEEN["top"] = reply.choices[0].logprobs.top_logprobs[0]
            chosen = sample["prompt"] + texts[sample["take"]]
            again = await client.completions.create(model="policy", prompt=chosen + " <user> 2",
                                                    max_tokens=8)
    SEEN[sample["api"]] = {"texts": texts, "indexes": [c.index for c in reply.choices],
                           "usage": reply.usage.completion_tokens}
    return 1.0
'''


def test_n_choices_and_the_episode_goes_on_with_the_choice_sent_back(chat, tmp_path):
    """A chat request with n=3 and a completion with n=2: each choice is its own sample (seeded
    apart: the scripted policy says choice j's text), the usage counts all of them, and the
    episode's generated ids are the choice the agent went on with (not choice 0), with no
    mismatch counted."""
    policy = ScriptedPolicy(chat, lambda turn, choice: f"<answer> {50 + choice} </answer>"
                            if turn == 0 else "<answer> 7 </answer>")
    samples = [{"api": "chat", "prompt": "7 * 8 + 3", "take": 2},
               {"api": "text", "prompt": "<user> 7 * 8 + 3 <eos> <assistant>", "take": 1}]
    episodes, metrics, g = run_agent(chat, policy, CHOOSING_AGENT, samples, tmp_path)
    seen = g["SEEN"]
    assert [t.split() for t in seen["chat"]["texts"]] == \
        [["<answer>", str(50 + j), "</answer>"] for j in range(3)]
    assert seen["chat"]["indexes"] == [0, 1, 2] and seen["chat"]["usage"] == 3 * 4
    assert [t.split()[1] for t in seen["text"]["texts"]] == ["50", "51"]
    assert list(seen["top"].values()) == [-0.25, -1.5]
    for e, taken in zip(episodes, ("52", "51"), strict=True):
        generated = [i for i, m in zip(e.ids, e.loss_mask, strict=True) if m]
        assert chat.tokenizer.decode(generated, skip_special_tokens=True).split() == \
            ["<answer>", taken, "</answer>", "<answer>", "7", "</answer>"]
        assert e.turns == 2 and e.ids[:e.prompt_len] == chat.encode(
            "<user> 7 * 8 + 3 <eos> <assistant>")
    assert metrics["agent/choices_taken"] == 2
    assert metrics["agent/text_mismatches"] == metrics["agent/token_mismatches"] == 0


HTTP_AGENT = '''
import asyncio
import json

import aiohttp

SEEN = {}

async def agent(base_url, api_key, sample):
    root = base_url.split("/sessions/")[0] + "/v1"
    sid = base_url.split("/sessions/")[1].split("/")[0]
    auth = {"Authorization": "Bearer " + api_key}
    hi = {"model": "policy", "messages": [{"role": "user", "content": "7 * 8 + 3"}]}
    seen = SEEN.setdefault(sample["case"], {})
    async with aiohttp.ClientSession() as http:
        async def post(name, url, body, headers=auth):
            async with http.post(url, json=body, headers=headers) as r:
                seen[name] = (r.status, await r.json())
        if sample["case"] == "refusals":
            await post("no_session", root + "/chat/completions", hi)
            await post("unknown_header", root + "/chat/completions", hi,
                       {**auth, "X-Session-Id": "nobody"})
            await post("top_p_other", base_url + "/chat/completions", {**hi, "top_p": 0.5})
            await post("n_0", base_url + "/chat/completions", {**hi, "n": 0})
            await post("n_17", base_url + "/chat/completions", {**hi, "n": 17})
            await post("top_21", base_url + "/chat/completions",
                       {**hi, "logprobs": True, "top_logprobs": 21})
            tool = {"type": "function", "function": {"name": "python", "parameters": {
                "type": "object", "properties": {"code": {"type": "string"}}}}}
            await post("required", base_url + "/chat/completions",
                       {**hi, "tools": [tool], "tool_choice": "required"})
            await post("named", base_url + "/chat/completions", {**hi, "tools": [tool],
                       "tool_choice": {"type": "function", "function": {"name": "python"}}})
            await post("echo", base_url + "/completions",
                       {"model": "policy", "prompt": "<user> 1", "echo": True})
            too_long = " ".join(["7"] * 40)
            await post("too_long", base_url + "/chat/completions",
                       {**hi, "messages": [{"role": "user", "content": too_long}]})
            await post("after_refusal", base_url + "/chat/completions", hi)
        elif sample["case"] == "header":
            await post("header", root + "/chat/completions", {**hi, "top_p": 0.9},
                       {**auth, "X-Session-Id": sid})
        elif sample["case"] == "completions":
            body = {"model": "policy", "prompt": "<user> 7 * 8 + 3 <eos> <assistant>",
                    "stream": True, "stop": "</answer>"}
            async with http.post(base_url + "/completions", json=body, headers=auth) as r:
                lines = (await r.text()).splitlines()
            chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
            seen["stream"] = (r.status, "".join(c["choices"][0]["text"] for c in chunks
                                                if c["choices"]), lines[-2:])
        elif sample["case"] == "dropped":  # read the first content chunk, then go away
            body = {**hi, "stream": True}
            async with http.post(base_url + "/chat/completions", json=body,
                                 headers=auth) as r:
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        seen["first"] = json.loads(line[6:])
                        break
            await asyncio.sleep(0.5)  # the turn finishes without its client
            await post("retry", base_url + "/chat/completions", hi)
    return 1.0
'''


def test_the_http_surface_header_sessions_completions_refusals_and_a_dropped_stream(
        chat, tmp_path):
    """Over raw HTTP: the X-Session-Id header names a session on /v1; top_p equal to the
    run's is served; a streamed /v1/completions with a stop string; one-line 4xx refusals
    (no or unknown session, another top_p, n out of range, too many top log-probs, a forced
    tool_choice, echo, a prompt the engine refuses), after which the session is over and the
    endpoint serves on;
    a client that reads one chunk of a stream and goes away leaves the turn to finish, and
    its retry gets that turn (a replay), generated once."""
    policy = ScriptedPolicy(chat, lambda turn, choice: "<answer> 59 </answer> 1 2 3",
                            pause_after=None)
    policy.refuse_longer_than = 30
    samples = [{"case": c} for c in ("refusals", "header", "completions", "dropped")]
    episodes, metrics, g = run_agent(chat, policy, HTTP_AGENT, samples, tmp_path)
    refusals = g["SEEN"]["refusals"]
    expected = {"no_session": 400, "unknown_header": 404, "top_p_other": 400, "n_0": 400,
                "n_17": 400, "top_21": 400, "required": 400, "named": 400, "echo": 400,
                "too_long": 400, "after_refusal": 400}
    assert {name: status for name, (status, _) in refusals.items()} == expected, refusals
    for status, body in refusals.values():
        assert "\n" not in body["error"]["message"] and body["error"]["code"] == status
    assert "maximum model length" in refusals["too_long"][1]["error"]["message"]
    assert "over" in refusals["after_refusal"][1]["error"]["message"]
    assert "'python'" in refusals["named"][1]["error"]["message"]
    status, body = g["SEEN"]["header"]["header"]
    assert status == 200 and body["choices"][0]["message"]["content"].split()[1] == "59"
    status, text, tail = g["SEEN"]["completions"]["stream"]
    assert status == 200 and text.split() == ["<answer>", "59"] and tail == ["data: [DONE]", ""]
    dropped = g["SEEN"]["dropped"]
    assert dropped["first"]["choices"][0]["delta"]["role"] == "assistant"
    status, body = dropped["retry"]
    assert status == 200 and body["choices"][0]["message"]["content"].split()[:2] == \
        ["<answer>", "59"]
    e = episodes[3]
    assert e.turns == 1 and e.env.replays == 1 and e.env.http_errors >= 1
    assert [e.truncated for e in episodes] == [True, False, False, False]
    assert metrics["agent/failed_frac"] == 0


HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "</tools><|eos|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and m.tool_calls %}{{ m.content or '' }}"
    "{%- for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}"
    "{%- else %}{{ m.content }}{% endif %}<|eos|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

HERMES_AGENT = '''
import json

import openai

SEEN = {}
TOOL = {"type": "function", "function": {"name": "python", "parameters": {
    "type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}

async def agent(base_url, api_key, sample):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": "what is 7 times 8 plus 3"}]
    async with client:
        if sample["stream"]:
            stream = await client.chat.completions.create(
                model="policy", messages=messages, tools=[TOOL], stream=True)
            SEEN["chunks"] = [c.model_dump(exclude_none=True) async for c in stream]
            return 1.0
        reply = await client.chat.completions.create(model="policy", messages=messages,
                                                     tools=[TOOL])
        message = reply.choices[0].message
        SEEN["reply"] = (message.content, [(c.function.name, json.loads(c.function.arguments))
                                           for c in message.tool_calls or []],
                         reply.choices[0].finish_reason)
        messages += [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "59"}]
        await client.chat.completions.create(model="policy", messages=messages, tools=[TOOL])
    return 1.0
'''


def test_a_vllm_tool_parser_turns_the_template_s_tool_format_into_tool_calls(tmp_path):
    """environment.agent.tool_parser=hermes on a byte-level BPE tokenizer whose chat template
    has hermes' tool format: the generated <tool_call> block comes back as an OpenAI tool call
    (vLLM's own Hermes2ProToolParser), the content without it; the agent's tool call sent back
    renders to the generated ids (no mismatch); streamed, no chunk leaks the markup before the
    parser saw the whole turn."""
    from rlhf_megatron.testing.tiny_models import train_tiny_tokenizer

    tok = train_tiny_tokenizer(tmp_path / "tok")
    tok.add_tokens(["<tool_call>", "</tool_call>"])  # added, not special: as in Qwen2.5's
    tok.chat_template = HERMES_TEMPLATE
    chat = ChatFormat(tok)
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(7 * 8 + 3)"}}\n</tool_call>'
    policy = ScriptedPolicy(chat, lambda turn, choice: call if turn == 0 else "59")
    agent_file = tmp_path / "agent.py"
    agent_file.write_text(HERMES_AGENT)
    spec = f"{agent_file}:agent"
    cfg = EnvironmentConfig(agent=AgentConfig(path=spec, timeout_seconds=60, tool_parser="hermes"),
                            max_turns=3, max_tokens_per_turn=64, max_tokens_per_episode=160)
    agent = load_agent(spec)
    runner = AgentRunner(agent, cfg, chat, policy, SAMPLING)
    episodes = asyncio.run(runner.run_async([{"stream": False}, {"stream": True}]))
    metrics = runner.metrics(episodes)
    seen = agent.__globals__["SEEN"]
    content, calls, finish = seen["reply"]
    assert calls == [("python", {"code": "print(7 * 8 + 3)"})] and finish == "tool_calls"
    assert not content, content
    assert episodes[0].turns == 2 and metrics["agent/failed_frac"] == 0
    assert episodes[0].env.text_mismatches == episodes[0].env.token_mismatches == 0
    streamed = [c["choices"][0] for c in seen["chunks"] if c.get("choices")]
    assert "tool_call" not in "".join(c["delta"].get("content") or "" for c in streamed)
    assert [c["delta"]["tool_calls"][0]["function"]["name"] for c in streamed
            if c["delta"].get("tool_calls")] == ["python"]
    assert streamed[-1]["finish_reason"] == "tool_calls"
