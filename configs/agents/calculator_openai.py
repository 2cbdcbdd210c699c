"""A ReAct calculator agent written only with the `openai` SDK (issue 27): it asks the policy
through the trainer's OpenAI-compatible endpoint, runs the tool calls it gets back in the
project's sandboxed Python tool, sends the output back as a `tool` message, and scores the final
answer. The same protocol as the built-in `arithmetic_tool` environment (tag format: the model
writes `<python> print( 7 * 8 + 3 ) </python>`, the endpoint returns it as a `python` tool call),
so the tools quickstart's SFT warm start applies.

    environment:
      agent: {path: configs/agents/calculator_openai.py:calculator}
"""

import asyncio
import json
import re
import ssl

import openai

from rlhf_megatron.environments import PythonSandbox, SandboxLimits

PYTHON_TOOL = {"type": "function", "function": {
    "name": "python", "description": "Run Python code and return what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                   "required": ["code"]}}}
ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")
# One TLS context for every episode's client: httpx builds one per client otherwise, loading the
# CA store each time (~20 ms of CPU a client, more than a tiny model's whole episode; the endpoint
# is plain HTTP on loopback, so the context is never even used).
TLS = ssl.create_default_context()


async def calculator(base_url: str, api_key: str, sample: dict, max_turns: int = 3,
                     output_bytes: int = 256) -> float:
    """Reward 1.0 when the final answer equals the sample's answer, else 0.0."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                                http_client=openai.DefaultAsyncHttpxClient(verify=TLS))
    sandbox = PythonSandbox(SandboxLimits(output_bytes=output_bytes))
    messages = [{"role": "user", "content": sample["prompt"]}]
    try:
        async with client:
            for _ in range(max_turns):
                reply = await client.chat.completions.create(
                    model="policy", messages=messages, tools=[PYTHON_TOOL])
                message = reply.choices[0].message
                text = message.content or ""
                answer = ANSWER.search(text)
                calls = message.tool_calls or []
                if answer and (not calls or answer.start() < text.find("<python>")):
                    return float(answer.group(1) == str(sample["answer"]).strip())
                if not calls:
                    return 0.0
                messages.append(message.model_dump(exclude_none=True))
                for call in calls:
                    code = json.loads(call.function.arguments).get("code", "")
                    result = await asyncio.to_thread(sandbox.run, code)
                    output = result.output.strip() if result.ok else f"Error: {result.error}"
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    except openai.BadRequestError:  # the episode's turn or token limit: no answer given
        return 0.0
    finally:
        sandbox.close()
    return 0.0
