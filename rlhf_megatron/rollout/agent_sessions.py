"""Token-in-token-out agent sessions (issue 27 item 2): one session is one episode's token stream.

The first request of a session opens the episode: its messages through the chat template (with
its ``tools``) are the prompt. Every later request sends the conversation back; the session
appends only what the agent added after the last assistant message, tokenised incrementally
(``ChatFormat.observation_ids``), and generates after its recorded ids. The ids the model
generated are kept exactly: what the agent sent back of them is never tokenised again. It is
checked, twice, and each miss is counted (never fixed silently):

- ``text_mismatches``: the messages sent back up to the last assistant message differ from what
  the endpoint returned (an agent that strips a space, drops a separator or rewrites a turn);
- ``token_mismatches``: rendering and tokenising that conversation again does not give the
  recorded ids (the same, plus the tokenizer's own drift: BPE merges a decoded turn differently).

The completions API (``/v1/completions``) keeps the text so far instead: a prompt must start with
the session's prompt and completions, and only its new suffix is tokenised.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

from rlhf_megatron.environments.base import Environment
from rlhf_megatron.rollout.episodes import (
    ChatFormat,
    Episode,
    TurnOutput,
    record_turn,
    turn_budget,
    unrecord_turn,
)


class SessionError(Exception):
    """A request the endpoint refuses: an HTTP status and a one-line message."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


class AgentEpisodeState(Environment):
    """The counters of one agent episode (held where an environment's ``tool_stats`` are)."""

    def __init__(self) -> None:
        super().__init__()
        self.requests = 0
        self.text_mismatches = 0
        self.token_mismatches = 0
        self.http_errors = 0
        self.error: str | None = None
        self.replays = 0
        """Requests answered again with the turn already generated (a client's retry)."""
        self.choices_taken = 0
        """Turns switched to a choice other than the first of an ``n`` > 1 request."""
        self.generate_seconds = 0.0
        self.handler_seconds = 0.0


class AgentSession:
    """One agent episode: its sample, its Episode once the first request opened it, and what the
    agent should send back next (the conversation or the text so far)."""

    def __init__(self, sid: str, index: int, sample: dict[str, Any]) -> None:
        self.sid, self.index, self.sample = sid, index, sample
        self.state = AgentEpisodeState()
        self.episode: Episode | None = None
        self.sent: list[dict[str, Any]] = []
        self.text: str | None = None
        self.last_request: tuple[list[dict[str, Any]], Any] | None = None
        self.last_reply: dict[str, Any] | None = None
        """The last chat request (messages, tools) and its reply, for a client's retry."""
        self.choices: list[tuple[TurnOutput, Any]] = []
        """The last request's choices: (its turn, the message or the whole text the agent
        would send back of it); choice 0 is the one recorded."""
        self.lock = asyncio.Lock()
        self.closed = False


def message_text(content: Any) -> str:
    """An OpenAI message content (a string, None, or a list of text parts) as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


def plain_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: string content; tool calls with their
    arguments as objects (what HF templates render)."""
    out = []
    for m in messages:
        msg: dict[str, Any] = {"role": m["role"], "content": message_text(m.get("content"))}
        if m.get("tool_calls"):
            msg["tool_calls"] = [
                {"type": "function", "id": c.get("id"), "function": {
                    "name": c["function"]["name"],
                    "arguments": _arguments(c["function"].get("arguments"))}}
                for c in m["tool_calls"]]
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                msg[key] = m[key]
        out.append(msg)
    return out


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def comparable(messages: Sequence[dict[str, Any]]) -> list[tuple]:
    """What the text check compares: role, content and each tool call's name and arguments."""
    return [(m["role"], m["content"],
             tuple((c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                   for c in m.get("tool_calls", ())))
            for m in messages]


def last_assistant(messages: Sequence[dict[str, Any]]) -> int | None:
    found = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return found[-1] if found else None


class SessionTokens:
    """The token bookkeeping of agent sessions over one chat format and the episode limits."""

    def __init__(self, chat: ChatFormat, cfg: Any) -> None:
        self.chat, self.cfg = chat, cfg

    def open_chat(self, s: AgentSession, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None) -> None:
        """Before a chat turn: open the episode, or append what the agent added."""
        if s.text is not None:
            raise SessionError(409, f"session {s.sid} was opened with /v1/completions; "
                                    "continue it there")
        if s.episode is None:
            prompt = self.chat.prompt_ids(messages, tools)
            s.episode = Episode.opened(s.index, prompt, s.state)
            return
        self._check_not_over(s)
        last = last_assistant(messages)
        if last is None:
            raise SessionError(400, f"session {s.sid} has turns but the messages hold no "
                                    "assistant message: send the conversation back")
        sent = comparable(messages[last:last + 1])
        taken = self.take_choice(s, lambda message: comparable([message]) == sent)
        if taken is not None:
            s.sent = s.sent[:-1] + [taken]
        self._check_prefix(s, messages[:last + 1], tools)
        self.append(s, self.chat.observation_ids(messages[last + 1:], s.episode.last_generated))

    def open_completion(self, s: AgentSession, prompt: str) -> None:
        """Before a completions turn: open the episode from ``prompt``, or append its new
        suffix (the prompt must continue the session's text)."""
        if s.episode is None:
            ids = self.chat.encode(prompt)
            s.episode = Episode.opened(s.index, ids, s.state)
            s.text = prompt
            return
        if s.text is None:
            raise SessionError(409, f"session {s.sid} was opened with /v1/chat/completions; "
                                    "continue it there")
        self._check_not_over(s)
        taken = self.take_choice(s, prompt.startswith, longest_first=True)
        if taken is not None:
            s.text = taken
        if not prompt.startswith(s.text):
            s.state.text_mismatches += 1
            raise SessionError(409, f"session {s.sid}: the prompt does not continue the "
                                    "session's text (prompt and completions so far)")
        suffix = prompt[len(s.text):]
        self.append(s, self.chat.encode(suffix) if suffix else [])
        s.text = prompt

    def take_choice(self, s: AgentSession, matches: Any, longest_first: bool = False) -> Any:
        """After an ``n`` > 1 request: if the agent went on with a choice other than the
        recorded one (choice 0), record that one as the episode's turn instead. ``matches``
        tells whether a choice's message (or whole text) is what the agent sent back; returns
        the switched-to message or text, or None (choice 0 stays; a choice that matches no
        candidate is the text check's business)."""
        choices, s.choices = s.choices, []
        if len(choices) < 2:
            return None
        order = sorted(choices, key=lambda c: -len(c[1])) if longest_first else choices
        chosen = next((c for c in order if matches(c[1])), None)
        if chosen is None or chosen is choices[0]:
            return None
        unrecord_turn(s.episode, choices[0][0])
        record_turn(s.episode, chosen[0], self.chat.tokenizer)
        s.state.choices_taken += 1
        return chosen[1]

    def _check_prefix(self, s: AgentSession, prefix: list[dict[str, Any]],
                      tools: list[dict[str, Any]] | None) -> None:
        e = s.episode
        if comparable(prefix) != comparable(s.sent):
            s.state.text_mismatches += 1
        rendered = self.chat.encode(self.chat.render(prefix, False, tools))
        recorded = e.ids[:-1] if e.last_generated in self.chat.stop_ids else e.ids
        if rendered[:len(recorded)] != recorded:
            s.state.token_mismatches += 1

    def append(self, s: AgentSession, ids: list[int]) -> None:
        """Append ids the model did not write (loss mask 0), or end the episode, truncated,
        when they leave no room for another turn (SessionError 400)."""
        e, cfg = s.episode, self.cfg
        if e.turns >= cfg.max_turns or e.episode_tokens + len(ids) >= cfg.max_tokens_per_episode:
            e.done = e.truncated = True
            raise SessionError(400, f"session {s.sid} reached its limit (environment.max_turns="
                                    f"{cfg.max_turns}, max_tokens_per_episode="
                                    f"{cfg.max_tokens_per_episode}): the episode is over")
        e.ids += ids
        e.loss_mask += [0] * len(ids)
        e.logprobs += [0.0] * len(ids)

    def _check_not_over(self, s: AgentSession) -> None:
        if s.episode.done:
            raise SessionError(400, f"session {s.sid}: the episode is over (a limit was reached "
                                    "or the engine refused a turn)")

    def budget(self, s: AgentSession, requested: int | None) -> int:
        """max_tokens of the next turn: the request's, capped by the turn and episode limits."""
        self._check_not_over(s)
        if requested is not None and requested < 1:
            raise SessionError(400, f"max_tokens={requested}: expected an integer >= 1")
        left = turn_budget(s.episode, self.cfg)
        return left if requested is None else min(requested, left)
