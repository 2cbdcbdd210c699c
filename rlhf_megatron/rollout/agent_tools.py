"""Tool calls in a generated assistant turn, as OpenAI ``tool_calls`` (issue 27 item 3).

Two formats:
- a vLLM tool parser by name (``environment.agent.tool_parser``: ``hermes``, ``qwen3_xml``,
  ``llama3_json``, ... every name ``vllm.tool_parsers.ToolParserManager`` registers), for models
  whose chat template has a tool format; the parser is vLLM's own, given the request as vLLM's
  ``ChatCompletionRequest``;
- the tag format (no parser named): a declared function with one required string parameter is
  called as ``<name>value</name>`` (the arithmetic tool's ``<python>print(1 + 2)</python>``).
  The content keeps the tags, so the conversation the agent sends back renders to the same text.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from rlhf_megatron.errors import ConfigError


def tool_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """One OpenAI ``tool_calls`` entry (``arguments`` as a JSON string, as the API has it)."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


def tag_tools(tools: list[dict[str, Any]]) -> dict[str, str]:
    """{function name: its one required string parameter} of the declared ``tools`` that the tag
    format can call."""
    callable_by_tag = {}
    for tool in tools:
        fn = tool.get("function") or {}
        params = fn.get("parameters") or {}
        required = params.get("required") or list(params.get("properties") or {})[:1]
        if fn.get("name") and len(required) == 1:
            callable_by_tag[fn["name"]] = required[0]
    return callable_by_tag


def parse_tag_calls(text: str, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``<name>value</name>`` calls of declared functions in ``text``, in order."""
    found = []
    for name, param in tag_tools(tools).items():
        for match in re.finditer(rf"<{re.escape(name)}>(.*?)</{re.escape(name)}>", text, re.S):
            found.append((match.start(), tool_call(name, {param: match.group(1).strip()})))
    return [call for _, call in sorted(found, key=lambda item: item[0])]


class ToolCallParser:
    """Splits a turn's text into (content, tool_calls) with the configured format."""

    def __init__(self, parser_name: str | None, tokenizer: Any) -> None:
        self.parser_cls = None
        self.tokenizer = tokenizer
        if parser_name is not None:
            self.parser_cls = vllm_tool_parser(parser_name)

    def parse(self, text: str, request: Any, tools: list[dict[str, Any]]
              ) -> tuple[str | None, list[dict[str, Any]]]:
        """``request``: the body as vLLM's ChatCompletionRequest (what its parsers read)."""
        if not tools:
            return text, []
        if self.parser_cls is None:
            return text, parse_tag_calls(text, tools)
        info = self.parser_cls(self.tokenizer, request.tools).extract_tool_calls(text, request)
        if not info.tools_called:
            return text, []
        calls = [tool_call(c.function.name, json.loads(c.function.arguments or "{}"))
                 for c in info.tool_calls]
        return info.content, calls


def vllm_tool_parser(name: str) -> type:
    """vLLM's tool parser class registered as ``name`` (one-line ConfigError when unknown)."""
    from vllm.tool_parsers import ToolParserManager

    try:
        return ToolParserManager.get_tool_parser(name)
    except KeyError:
        known = ", ".join(ToolParserManager.list_registered())
        raise ConfigError(f"environment.agent.tool_parser={name!r}: not a vLLM tool parser "
                          f"(known: {known})") from None
