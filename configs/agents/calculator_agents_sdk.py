"""The calculator agent of calculator_openai.py written with the OpenAI Agents SDK
(`pip install openai-agents`, issue 27 item 6): an `Agent` with one `function_tool`, `python`, that
runs code in the project's sandboxed Python tool, on an `OpenAIChatCompletionsModel` whose client
points at the trainer's endpoint. The SDK runs the ReAct loop itself (a reply with tool calls ->
the tools -> the next request), so this file holds no loop and no parsing.

It returns None: the run's `reward:` section scores the episode's generated text
(configs/agents/answer_tag_reward.py in configs/quickstart_agent_sdk_cpu.yaml).

    environment:
      agent: {path: configs/agents/calculator_agents_sdk.py:calculator}
"""

import asyncio
import ssl

import openai
from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelBehaviorError,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

from rlhf_megatron.environments import PythonSandbox, SandboxLimits

set_tracing_disabled(True)  # the SDK's traces would go to api.openai.com
# One TLS context for every episode's client: httpx builds one per client otherwise, loading the
# CA store each time (~20 ms of CPU a client, more than a tiny model's whole episode; the endpoint
# is plain HTTP on loopback, so the context is never even used).
TLS = ssl.create_default_context()


async def calculator(base_url: str, api_key: str, sample: dict, max_turns: int = 3,
                     output_bytes: int = 256) -> None:
    """One episode: the SDK's agent answers sample["prompt"], using `python` as it likes."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                                http_client=openai.DefaultAsyncHttpxClient(verify=TLS))
    sandbox = PythonSandbox(SandboxLimits(output_bytes=output_bytes))

    @function_tool
    async def python(code: str) -> str:
        """Run Python code and return what it prints.

        Args:
            code: the program.
        """
        result = await asyncio.to_thread(sandbox.run, code)
        return result.output.strip() if result.ok else f"Error: {result.error}"

    agent = Agent(name="calculator", model=OpenAIChatCompletionsModel("policy", client),
                  tools=[python])
    try:
        async with client:
            await Runner.run(agent, sample["prompt"], max_turns=max_turns)
    except (MaxTurnsExceeded, ModelBehaviorError, openai.BadRequestError):
        pass  # out of turns or tokens, or a malformed call: the reward scores what was said
    finally:
        sandbox.close()
    return None
