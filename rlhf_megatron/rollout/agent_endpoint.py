"""The OpenAI-compatible HTTP endpoint agents talk to during a rollout (issue 27 item 1).

    POST {base}/chat/completions   POST {base}/completions   GET {base}/models

``base`` is ``http://HOST:PORT/sessions/<session>/v1``, what an agent is given as its base URL,
so that any client (the ``openai`` SDK, LangGraph, the Agents SDK) names its session without
custom headers; ``http://HOST:PORT/v1`` with an ``X-Session-Id`` header works too. Every request
carries ``Authorization: Bearer <the run's key>``. It listens on loopback unless
``environment.agent.host`` says otherwise, on a free port, for one rollout, on the rollout
engine's event loop (a turn is one request of the engine, like an environment's turn).

Request bodies are validated with vLLM's own OpenAI protocol models (``ChatCompletionRequest``,
``CompletionRequest``). A request is one turn of its session (rollout/agent_sessions.py), one at a
time per session. Refused, each as a one-line JSON ``{"error": {"message", "type", "code"}}``:
a wrong key (401), an unknown or finished session (404, 410), a malformed body (400), ``n`` or
``top_logprobs`` out of range, a ``temperature`` or ``top_p`` other than the run's or a
``tool_choice`` that forces a call (the trainer's log-probs are of the run's own sampling), a
prompt the engine refuses (past its ``max_model_len``) or a turn past the episode's limits (400).

``n`` > 1 generates that many choices of the turn from the same ids (seeds differ per choice).
The session records choice 0 as its turn and switches to another choice when the agent sends
that one back (agent_sessions.SessionTokens.take_choice): the episode is always the token stream
the agent went on with.

``stream: true`` is answered as server-sent events as the tokens are generated: a content chunk
per batch of new text (held back where a ``stop`` string may still begin; a vLLM tool parser
sees the whole turn first, so its content comes at the end), then each choice's log-probs, tool
calls and finish, the usage (``stream_options.include_usage``) and ``[DONE]``. A turn is a task of
its own: a client that loses its connection mid-turn (a timeout, a disconnect, mid-stream) stops
the events, not the turn, and the same request sent again is answered with the turn already
generated (``agent/replays``), as the ``openai`` SDK's own retries expect.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import Coroutine, Sequence
from typing import Any

from rlhf_megatron.rewards.errors import one_line
from rlhf_megatron.rollout.agent_replies import (
    Choice,
    ChunkShapes,
    TextStream,
    TurnDeltas,
    chat_reply,
    cut_at_stop,
    reply_text,
    sse,
    text_reply,
)
from rlhf_megatron.rollout.agent_sessions import (
    AgentSession,
    SessionError,
    SessionTokens,
    plain_messages,
)
from rlhf_megatron.rollout.agent_tools import ToolCallParser
from rlhf_megatron.rollout.episodes import ChatFormat, TurnGenerator, TurnOptions, record_turn

log = logging.getLogger(__name__)

SESSION_HEADER = "X-Session-Id"
MAX_BODY_BYTES = 8 * 2**20
MAX_CHOICES = 16
MAX_TOP_LOGPROBS = 20
"""vLLM's default ``max_logprobs``, and OpenAI's own limit."""


class AgentEndpoint:
    """The endpoint over ``sessions`` (session id -> AgentSession), generating with ``turn``.

    Args:
        chat: the policy's ChatFormat.
        cfg: the ``environment:`` section (limits; ``agent.host`` and ``agent.tool_parser``).
        turn: the TurnGenerator of the rollout engine.
        sampling: the run's SamplingSettings (requests may not change temperature or top_p).
    """

    def __init__(self, chat: ChatFormat, cfg: Any, turn: TurnGenerator, sampling: Any,
                 sessions: dict[str, AgentSession]) -> None:
        self.chat, self.cfg, self.turn, self.sampling = chat, cfg, turn, sampling
        self.sessions = sessions
        self.tokens = SessionTokens(chat, cfg)
        self.parser = ToolCallParser(cfg.agent.tool_parser, chat.tokenizer)
        self.api_key = secrets.token_urlsafe(24)
        self.http_errors = 0
        self.port: int | None = None
        self._runner: Any = None

    def base_url(self, sid: str) -> str:
        return f"http://{self.cfg.agent.host}:{self.port}/sessions/{sid}/v1"

    async def start(self) -> None:
        from aiohttp import web

        app = web.Application(middlewares=[self._middleware], client_max_size=MAX_BODY_BYTES)
        for prefix in ("/sessions/{sid}/v1", "/v1"):
            app.router.add_post(f"{prefix}/chat/completions", self._chat)
            app.router.add_post(f"{prefix}/completions", self._completion)
            app.router.add_get(f"{prefix}/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.agent.host, 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- requests -------------------------------------------------------------------------

    @property
    def _middleware(self) -> Any:
        from aiohttp import web

        @web.middleware
        async def middleware(request: Any, handler: Any) -> Any:
            try:
                if request.headers.get("Authorization") != f"Bearer {self.api_key}":
                    raise SessionError(401, "missing or wrong API key (Authorization: Bearer)",
                                       "authentication_error")
                return await handler(request)
            except SessionError as exc:
                return self._error(request, exc.status, str(exc), exc.kind)
            except web.HTTPException as exc:
                return self._error(request, exc.status, exc.reason, "invalid_request_error")
            except Exception as exc:  # the endpoint's own bug: one line, and it keeps serving
                log.exception("agent endpoint: %s %s failed", request.method, request.path)
                return self._error(request, 500, f"{type(exc).__name__}: {one_line(str(exc))}",
                                   "server_error")
        return middleware

    def _error(self, request: Any, status: int, message: str, kind: str) -> Any:
        from aiohttp import web

        session = self.sessions.get(self._session_id(request) or "")
        if session is not None:
            session.state.http_errors += 1
        else:
            self.http_errors += 1
        return web.json_response(
            {"error": {"message": message, "type": kind, "code": status}}, status=status)

    def _session_id(self, request: Any) -> str | None:
        return request.match_info.get("sid") or request.headers.get(SESSION_HEADER)

    def _session(self, request: Any) -> AgentSession:
        sid = self._session_id(request)
        if not sid:
            raise SessionError(400, f"no session: use the base URL the agent was given, or "
                                    f"send the {SESSION_HEADER} header")
        session = self.sessions.get(sid)
        if session is None:
            raise SessionError(404, f"unknown session {sid!r}", "not_found_error")
        if session.closed:
            raise SessionError(410, f"session {sid!r} is over (its agent returned or timed out)",
                               "not_found_error")
        return session

    async def _body(self, request: Any, model: type) -> Any:
        from pydantic import ValidationError

        try:
            body = await request.json()
        except ValueError as exc:
            raise SessionError(400, f"the body is not JSON: {one_line(str(exc))}") from None
        if not isinstance(body, dict):
            raise SessionError(400, "the body is not a JSON object")
        try:
            return body, model.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise SessionError(400, f"invalid request: {where}: {first.get('msg')}") from None

    def _choices(self, req: Any) -> tuple[int, int]:
        """The request's ``n`` and top log-probs count, checked; its temperature and top_p must
        be the run's (the trainer's log-probs are of the run's sampling)."""
        n = 1 if req.n is None else int(req.n)
        if not 1 <= n <= MAX_CHOICES:
            raise SessionError(400, f"n={req.n}: expected 1 to {MAX_CHOICES} choices")
        for name in ("temperature", "top_p"):
            value, run_value = getattr(req, name), getattr(self.sampling, name)
            if value is not None and abs(float(value) - float(run_value)) > 1e-6:
                raise SessionError(400, f"{name}={value} differs from the run's "
                                        f"rollout.sampling.{name}={run_value}: the trainer's "
                                        "log-probs are of the run's sampling")
        chat = hasattr(req, "messages")  # chat: logprobs true + top_logprobs; text: logprobs k
        top = int((req.top_logprobs if req.logprobs else 0) if chat else (req.logprobs or 0))
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise SessionError(400, f"top_logprobs={top}: expected 0 to {MAX_TOP_LOGPROBS}")
        return n, top

    async def _generate(self, s: AgentSession, n: int, max_tokens: int, options: TurnOptions,
                        deltas: TurnDeltas | None) -> list[Choice]:
        """The request's ``n`` choices, generated together after the session's ids; choice 0
        is recorded as the episode's turn (the session takes another if the agent goes on with
        it, agent_sessions.SessionTokens.take_choice)."""
        start = time.perf_counter()
        e = s.episode
        try:
            outs = await asyncio.gather(*(self.turn(e, max_tokens, dataclasses.replace(
                options, choice=j, on_tokens=None if deltas is None else deltas.sink(j)))
                for j in range(n)))
        except Exception as exc:
            if not _engine_refused(exc):
                raise
            e.done = e.truncated = True
            raise SessionError(400, f"the engine refused the turn: {one_line(str(exc))}") from None
        s.state.generate_seconds += time.perf_counter() - start
        record_turn(e, outs[0], self.chat.tokenizer)
        return [Choice(out, cut_at_stop(self.chat.tokenizer.decode(
            out.token_ids, skip_special_tokens=True), options.stop)) for out in outs]

    async def _chat(self, request: Any) -> Any:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        s = self._session(request)
        body, req = await self._body(request, ChatCompletionRequest)
        n, top = self._choices(req)
        tools = body.get("tools") or None
        if req.tool_choice not in (None, "auto", "none"):
            forced = getattr(getattr(req.tool_choice, "function", None), "name", req.tool_choice)
            raise SessionError(400, f"tool_choice={forced!r}: forcing a tool call would constrain "
                                    "sampling, and the trainer learns from the policy's own "
                                    "samples: send 'auto' or 'none'")
        messages = plain_messages(req.messages)
        parsed = bool(tools) and req.tool_choice != "none" and self.parser.parser_cls is not None
        deltas = TurnDeltas(n) if req.stream and not parsed else None
        options = TurnOptions(stop=tuple(_stops(req.stop)), top_logprobs=top)
        return await self._answer(request, s, req, self._chat_turn(
            s, req, messages, tools, n, options, deltas), deltas, ChunkShapes(True, req.model))

    async def _answer(self, request: Any, s: AgentSession, req: Any, turn: Coroutine,
                      deltas: TurnDeltas | None, shapes: ChunkShapes) -> Any:
        """Run ``turn`` as a task of its own (a client that goes away mid-turn leaves it to
        finish and be recorded) and answer with its reply, whole or as server-sent events."""
        task = asyncio.ensure_future(turn)
        if req.stream:
            return await self._stream(request, s, task, deltas, shapes, _stops(req.stop), req)
        from aiohttp import web

        return web.json_response(await asyncio.shield(task))

    async def _chat_turn(self, s: AgentSession, req: Any, messages: list[dict[str, Any]],
                         tools: Any, n: int, options: TurnOptions,
                         deltas: TurnDeltas | None) -> dict[str, Any]:
        """One chat turn of session ``s``, under its lock: its reply."""
        async with s.lock:
            if s.last_reply is not None and s.last_request == (messages, tools):
                # The same request again: a client that timed out or lost the connection
                # retries; it gets the turn already generated (a session is one token stream).
                s.state.replays += 1
                return s.last_reply
            start = time.perf_counter()
            self.tokens.open_chat(s, messages, tools)
            budget = self.tokens.budget(s, req.max_completion_tokens or req.max_tokens)
            choices = await self._generate(s, n, budget, options, deltas)
            for c in choices:
                content, c.calls = (c.text, []) if req.tool_choice == "none" else \
                    self.parser.parse(c.text, req, tools or [])
                c.message = {"role": "assistant", "content": content}
                if c.calls:
                    c.message["tool_calls"] = c.calls
            s.state.tool_stats.calls += len(choices[0].calls)
            s.sent = messages + plain_messages([choices[0].message])
            s.choices = [(c.out, plain_messages([c.message])[0]) for c in choices]
            s.state.requests += 1
            s.state.handler_seconds += time.perf_counter() - start
            prompt_tokens = len(s.episode.ids) - len(choices[0].out.token_ids)
            reply = chat_reply(req.model or "policy", prompt_tokens, choices,
                               self.chat.tokenizer, bool(req.logprobs))
            s.last_request, s.last_reply = (messages, tools), reply
            return reply

    async def _stream(self, request: Any, s: AgentSession, turn: asyncio.Future,
                      deltas: TurnDeltas | None, shapes: ChunkShapes, stop: Sequence[str],
                      req: Any) -> Any:
        """The reply as server-sent events: each choice's text as it is generated (unless a
        vLLM tool parser must see the whole turn first), then the rest of each choice, its tool
        calls and finish, and ``[DONE]``. Nothing is sent before the first token, so a refused
        turn is still an HTTP error. A client that goes away stops the events, not the turn."""
        from aiohttp import web

        texts = [TextStream(self.chat.tokenizer, stop) for _ in range(deltas.n if deltas else 0)]
        response: Any = None
        try:
            while deltas is not None and not turn.done():
                await deltas.wait(turn)
                pieces = [(j, texts[j].push(ids)) for j, ids in deltas.take()]
                if response is None and any(piece for _, piece in pieces):
                    response = await self._open_stream(request)
                for j, piece in pieces:
                    if piece:
                        await response.write(sse(shapes.piece(j, piece)))
            if response is None:
                reply = await asyncio.shield(turn)  # refused: the middleware's HTTP error
                response = await self._open_stream(request)
            else:
                try:
                    reply = await asyncio.shield(turn)
                except SessionError as exc:  # after the first token: an error event
                    await response.write(sse({"error": {"message": str(exc), "type": exc.kind,
                                                        "code": exc.status}}))
                    await response.write_eof()
                    return response
            rests = [texts[j].rest(reply_text(c)) if texts else reply_text(c)
                     for j, c in enumerate(reply["choices"])]
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            for chunk in shapes.ending(reply, rests, include_usage):
                await response.write(sse(chunk))
            await response.write(sse("[DONE]"))
            await response.write_eof()
        except (ConnectionResetError, ConnectionError) as exc:  # the client went away
            s.state.http_errors += 1
            log.warning("agent endpoint: session %s disconnected mid-stream (%s)", s.sid,
                        type(exc).__name__)
        return response if response is not None else web.Response(status=499)

    async def _open_stream(self, request: Any) -> Any:
        from aiohttp import web

        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        return response

    async def _completion(self, request: Any) -> Any:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        s = self._session(request)
        body, req = await self._body(request, CompletionRequest)
        n, top = self._choices(req)
        if not isinstance(req.prompt, str):
            raise SessionError(400, "prompt: a session's completion prompt is one string")
        if req.echo or req.suffix:
            raise SessionError(400, "echo and suffix are not served: a session's text is "
                                    "its prompt followed by the completions")
        deltas = TurnDeltas(n) if req.stream else None
        options = TurnOptions(stop=tuple(_stops(req.stop)), top_logprobs=top)
        return await self._answer(request, s, req, self._completion_turn(
            s, req, n, options, deltas), deltas, ChunkShapes(False, req.model))

    async def _completion_turn(self, s: AgentSession, req: Any, n: int, options: TurnOptions,
                               deltas: TurnDeltas | None) -> dict[str, Any]:
        async with s.lock:
            start = time.perf_counter()
            self.tokens.open_completion(s, req.prompt)
            choices = await self._generate(s, n, self.tokens.budget(s, req.max_tokens),
                                           options, deltas)
            s.text = req.prompt + choices[0].text
            s.choices = [(c.out, req.prompt + c.text) for c in choices]
            s.state.requests += 1
            s.state.handler_seconds += time.perf_counter() - start
            return text_reply(req.model or "policy",
                              len(s.episode.ids) - len(choices[0].out.token_ids), choices,
                              self.chat.tokenizer, req.logprobs is not None)

    async def _models(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"object": "list", "data": [
            {"id": "policy", "object": "model", "created": 0, "owned_by": "rlhf_megatron"}]})


def _stops(stop: Any) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _engine_refused(exc: Exception) -> bool:
    """vLLM refused the request itself (a prompt past ``max_model_len``): its client errors
    (``VLLMClientError``, which is not a ValueError) and the ValueError of its older checks."""
    if isinstance(exc, ValueError):
        return True
    from vllm.exceptions import VLLMClientError

    return isinstance(exc, VLLMClientError)
