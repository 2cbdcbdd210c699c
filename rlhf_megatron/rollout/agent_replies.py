"""The OpenAI-shaped bodies the agent endpoint sends (rollout/agent_endpoint.py): log-probs,
choices and usage of chat and text completions, their server-sent-event chunks, and the text of
a turn as it streams (TextStream)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlhf_megatron.rollout.episodes import TurnOutput


@dataclass
class Choice:
    """One generated choice of a request: the engine's turn, its text (cut at the first
    ``stop`` string) and, for chat, the assistant message the agent should send back."""

    out: TurnOutput
    text: str
    message: dict[str, Any] = field(default_factory=dict)
    calls: list[dict[str, Any]] = field(default_factory=list)

    @property
    def finish_reason(self) -> str:
        if self.calls:
            return "tool_calls"
        return "length" if self.out.finish_reason == "length" else "stop"


class TurnDeltas:
    """The new ids of a streamed request's ``n`` choices, handed over by the turn generator's
    ``on_tokens`` on the engine's loop (the endpoint's loop too) and taken by the SSE writer."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.new: list[list[int]] = [[] for _ in range(n)]
        self.event = asyncio.Event()

    def sink(self, index: int) -> Any:
        """The ``on_tokens`` of choice ``index``."""
        def on_tokens(ids: list[int]) -> None:
            self.new[index] += ids
            self.event.set()
        return on_tokens

    async def wait(self, turn: asyncio.Future) -> None:
        """Until new ids arrive or ``turn`` is done."""
        waiter = asyncio.ensure_future(self.event.wait())
        try:
            await asyncio.wait({turn, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        self.event.clear()

    def take(self) -> list[tuple[int, list[int]]]:
        """(choice, its new ids) for each choice with new ids since the last take."""
        out = [(j, ids) for j, ids in enumerate(self.new) if ids]
        self.new = [[] for _ in range(self.n)]
        return out


def reply_text(choice: dict[str, Any]) -> str:
    """A reply choice's text: a chat message's content or a text completion's text."""
    if "message" in choice:
        return choice["message"]["content"] or ""
    return choice["text"]


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """``text`` up to the first occurrence of any ``stop`` string (OpenAI's ``stop``)."""
    cuts = [text.find(x) for x in stop if x and x in text]
    return text[:min(cuts)] if cuts else text


class TextStream:
    """A turn's text as its ids stream in: each call of :meth:`push` returns the new text that
    is safe to send. It holds back the last character (a tokenizer may still merge or clean it
    up), a partial UTF-8 character, and anything that could still become a ``stop`` string, and
    sends nothing from the first ``stop`` string on, so what it sent is a prefix of the final
    text (:func:`cut_at_stop` of the whole decode).

    Each push decodes only the ids since the last decoded one, behind CONTEXT ids already
    decoded (the text they add is the difference of the two decodes: a decoder that drops a
    leading space or starts mid-character does so in both), so a turn of n tokens costs O(n)
    decoding, not O(n^2) (vLLM's incremental detokenizer works from the same two offsets)."""

    CONTEXT = 4

    def __init__(self, tokenizer: Any, stop: Sequence[str]) -> None:
        self.tokenizer, self.stop = tokenizer, [x for x in stop if x]
        self.hold = max((len(x) for x in self.stop), default=1)
        self.ids: list[int] = []
        self.decoded = 0  # ids[:decoded] are in `text`
        self.text = ""
        self.sent = ""
        self.diverged = False  # what was sent is no prefix of the text: send nothing more

    def push(self, ids: Sequence[int]) -> str:
        self.ids += ids
        if not self._decode_new():
            return ""
        # A stop string can start no earlier than `hold` characters before what was sent.
        start = max(len(self.sent) - self.hold, 0)
        cuts = [i for i in (self.text.find(x, start) for x in self.stop) if i >= 0]
        safe_end = min(cuts) if cuts else max(len(self.text) - self.hold, 0)
        if safe_end <= len(self.sent):
            return ""
        piece = self.text[len(self.sent):safe_end]
        self.sent += piece
        return piece

    def _decode_new(self) -> bool:
        """Bring `text` up to every id; False while the ids end in a partial character, or once
        the text no longer extends what was sent (:meth:`rest` then sends nothing more)."""
        anchor = max(self.decoded - self.CONTEXT, 0)
        before = self.tokenizer.decode(self.ids[anchor:self.decoded], skip_special_tokens=True)
        after = self.tokenizer.decode(self.ids[anchor:], skip_special_tokens=True)
        if after.endswith("\ufffd"):
            return False
        if after.startswith(before):
            self.text += after[len(before):]
        else:  # a decoder that cleans up across the window's edge (rare): the whole turn again
            self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            self.diverged = self.diverged or not self.text.startswith(self.sent)
        self.decoded = len(self.ids)
        return not self.diverged

    def rest(self, final: str) -> str:
        """What is left to send of the ``final`` text ('' if what was sent is not its prefix,
        which the tokenizer's decode would have to break)."""
        return final[len(self.sent):] if final.startswith(self.sent) else ""


def chat_logprobs(tokenizer: Any, out: TurnOutput) -> list[dict[str, Any]]:
    """A turn's ``logprobs.content``: each generated token, its log-prob and, when the request
    asked for them, its ``top_logprobs``."""
    tops = out.top_logprobs or [[] for _ in out.token_ids]
    return [{**_entry(tokenizer, i, lp),
             "top_logprobs": [_entry(tokenizer, t, tlp) for t, tlp in top]}
            for i, lp, top in zip(out.token_ids, out.logprobs, tops, strict=True)]


def _entry(tokenizer: Any, token_id: int, logprob: float) -> dict[str, Any]:
    text = tokenizer.decode([token_id])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def text_logprobs(tokenizer: Any, out: TurnOutput) -> dict[str, Any]:
    """A text completion's ``logprobs`` (the legacy completions shape)."""
    entries = chat_logprobs(tokenizer, out)
    return {"tokens": [x["token"] for x in entries],
            "token_logprobs": [x["logprob"] for x in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in x["top_logprobs"]}
                             for x in entries] if out.top_logprobs is not None else None,
            "text_offset": None}


def usage(prompt_tokens: int, choices: Sequence[Choice]) -> dict[str, int]:
    completion = sum(len(c.out.token_ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


def chat_reply(model: str, prompt_tokens: int, choices: Sequence[Choice], tokenizer: Any,
               logprobs: bool) -> dict[str, Any]:
    """A ``chat.completion`` body."""
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": model,
            "choices": [{"index": j, "message": c.message, "finish_reason": c.finish_reason,
                         "logprobs": {"content": chat_logprobs(tokenizer, c.out)}
                         if logprobs else None} for j, c in enumerate(choices)],
            "usage": usage(prompt_tokens, choices)}


def text_reply(model: str, prompt_tokens: int, choices: Sequence[Choice], tokenizer: Any,
               logprobs: bool) -> dict[str, Any]:
    """A ``text_completion`` body."""
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": model,
            "choices": [{"index": j, "text": c.text, "finish_reason": c.finish_reason,
                         "logprobs": text_logprobs(tokenizer, c.out) if logprobs else None}
                        for j, c in enumerate(choices)],
            "usage": usage(prompt_tokens, choices)}


class ChunkShapes:
    """The chunks of one streamed reply: a content piece as it is generated, then the rest of
    each choice (content left, tool calls, log-probs) and its finish, from the whole reply."""

    def __init__(self, chat: bool, model: str | None) -> None:
        self.chat = chat
        self.head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                     "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": int(time.time()), "model": model or "policy"}
        self.opened: set[int] = set()

    def piece(self, index: int, text: str, logprobs: Any = None) -> dict[str, Any]:
        if not self.chat:
            return self._chunk({"index": index, "text": text, "logprobs": logprobs,
                                "finish_reason": None})
        delta: dict[str, Any] = {"content": text}
        if index not in self.opened:
            delta["role"] = "assistant"
            self.opened.add(index)
        return self._chunk({"index": index, "delta": delta, "logprobs": logprobs,
                            "finish_reason": None})

    def ending(self, reply: dict[str, Any], rests: Sequence[str], with_usage: bool
               ) -> list[dict[str, Any]]:
        """The chunks after the streamed pieces: per choice, the content not yet sent with the
        choice's log-probs, its tool calls, its finish reason; then the usage if the request
        asked for it (``stream_options.include_usage``)."""
        chunks = []
        for j, choice in enumerate(reply["choices"]):
            chunks.append(self.piece(j, rests[j], choice["logprobs"]))
            calls = (choice.get("message") or {}).get("tool_calls")
            if calls:
                chunks.append(self._chunk({"index": j, "delta": {"tool_calls": [
                    {"index": k, **c} for k, c in enumerate(calls)]}, "finish_reason": None}))
            end = {"index": j, "finish_reason": choice["finish_reason"]}
            chunks.append(self._chunk({**end, "delta": {}} if self.chat else {**end, "text": ""}))
        if with_usage:
            chunks.append({**self.head, "choices": [], "usage": reply["usage"]})
        return chunks

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {**self.head, "choices": [choice]}


def sse(chunk: dict[str, Any] | str) -> bytes:
    """One server-sent event (``data: <json>``; ``[DONE]`` as it is)."""
    return f"data: {chunk if isinstance(chunk, str) else json.dumps(chunk)}\n\n".encode()
