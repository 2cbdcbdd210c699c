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
a wrong key (401), an unknown or finished session (404, 410), a malformed body (400), ``n`` other
than 1 (a session is one token stream), a ``temperature`` or ``top_p`` other than the run's (the
trainer's log-probs are of the run's sampling), a turn past the episode's limits (400).
``stream: true`` is answered as server-sent events, after the turn is generated (one content
chunk, one tool-call chunk, the finish chunk, ``[DONE]``). A client that loses its connection
mid-turn (a timeout, a disconnect) and sends the same request again is answered with the turn
already generated (``agent/replays``), as the ``openai`` SDK's own retries expect.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
import uuid
from typing import Any

from rlhf_megatron.rewards.errors import one_line
from rlhf_megatron.rollout.agent_sessions import (
    AgentSession,
    SessionError,
    SessionTokens,
    plain_messages,
)
from rlhf_megatron.rollout.agent_tools import ToolCallParser
from rlhf_megatron.rollout.episodes import ChatFormat, TurnGenerator, TurnOutput, record_turn

log = logging.getLogger(__name__)

SESSION_HEADER = "X-Session-Id"
MAX_BODY_BYTES = 8 * 2**20


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

    def _check_sampling(self, req: Any) -> None:
        if req.n not in (None, 1):
            raise SessionError(400, f"n={req.n}: a session is one token stream; open one "
                                    "session per sample (rollout.sampling.n of them per prompt)")
        for name in ("temperature", "top_p"):
            value, run_value = getattr(req, name), getattr(self.sampling, name)
            if value is not None and abs(float(value) - float(run_value)) > 1e-6:
                raise SessionError(400, f"{name}={value} differs from the run's "
                                        f"rollout.sampling.{name}={run_value}: the trainer's "
                                        "log-probs are of the run's sampling")

    async def _generate(self, s: AgentSession, max_tokens: int, stop: list[str]
                        ) -> tuple[TurnOutput, str]:
        start = time.perf_counter()
        try:
            out = await self.turn(s.episode, max_tokens, tuple(stop))
        except ValueError as exc:  # vLLM refuses the request (a prompt past max_model_len)
            s.episode.done = s.episode.truncated = True
            raise SessionError(400, f"the engine refused the turn: {one_line(str(exc))}") from None
        s.state.generate_seconds += time.perf_counter() - start
        text = record_turn(s.episode, out, self.chat.tokenizer)
        cut = [text.find(x) for x in stop if x and x in text]
        return out, text[:min(cut)] if cut else text

    def _logprobs(self, out: TurnOutput) -> list[dict[str, Any]]:
        texts = [self.chat.tokenizer.decode([i]) for i in out.token_ids]
        return [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in zip(texts, out.logprobs, strict=True)]

    async def _chat(self, request: Any) -> Any:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        s = self._session(request)
        body, req = await self._body(request, ChatCompletionRequest)
        self._check_sampling(req)
        tools = body.get("tools") or None
        messages = plain_messages(req.messages)
        async with s.lock:
            if s.last_reply is not None and s.last_request == (messages, tools):
                # The same request again: a client that timed out or lost the connection
                # retries; it gets the turn already generated (a session is one token stream).
                s.state.replays += 1
                return await self._send(request, s, s.last_reply, req.stream)
            start = time.perf_counter()
            self.tokens.open_chat(s, messages, tools)
            budget = self.tokens.budget(s, req.max_completion_tokens or req.max_tokens)
            out, text = await self._generate(s, budget, _stops(req.stop))
            content, calls = (text, []) if req.tool_choice == "none" else self.parser.parse(
                text, req, tools or [])
            s.state.tool_stats.calls += len(calls)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            s.sent = messages + plain_messages([message])
            s.state.requests += 1
            s.state.handler_seconds += time.perf_counter() - start
        finish = "tool_calls" if calls else ("length" if out.finish_reason == "length" else "stop")
        choice = {"index": 0, "message": message, "finish_reason": finish,
                  "logprobs": {"content": self._logprobs(out)} if req.logprobs else None}
        usage = {"prompt_tokens": len(s.episode.ids) - len(out.token_ids),
                 "completion_tokens": len(out.token_ids), "total_tokens": len(s.episode.ids)}
        reply = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                 "created": int(time.time()), "model": req.model or "policy",
                 "choices": [choice], "usage": usage}
        s.last_request, s.last_reply = (messages, tools), reply
        return await self._send(request, s, reply, req.stream)

    async def _send(self, request: Any, s: AgentSession, reply: dict[str, Any],
                    stream: bool) -> Any:
        if stream:
            return await self._stream(request, s, reply)
        from aiohttp import web

        return web.json_response(reply)

    async def _stream(self, request: Any, s: AgentSession, reply: dict[str, Any]) -> Any:
        """The chat reply as server-sent events: content, tool calls, finish, [DONE]."""
        from aiohttp import web

        choice = reply["choices"][0]
        head = {k: reply[k] for k in ("id", "created", "model")}
        head["object"] = "chat.completion.chunk"
        deltas = [{"role": "assistant", "content": choice["message"]["content"] or ""}]
        if choice["message"].get("tool_calls"):
            deltas.append({"tool_calls": [{"index": i, **c} for i, c in
                                          enumerate(choice["message"]["tool_calls"])]})
        chunks = [{**head, "choices": [{"index": 0, "delta": d, "finish_reason": None,
                                        "logprobs": choice["logprobs"] if i == 0 else None}]}
                  for i, d in enumerate(deltas)]
        chunks.append({**head, "choices": [{"index": 0, "delta": {},
                                            "finish_reason": choice["finish_reason"]}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        try:
            await response.prepare(request)
            for chunk in chunks:
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except (ConnectionResetError, ConnectionError) as exc:  # the client went away
            s.state.http_errors += 1
            log.warning("agent endpoint: session %s disconnected mid-stream (%s)", s.sid,
                        type(exc).__name__)
        return response

    async def _completion(self, request: Any) -> Any:
        from aiohttp import web
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        s = self._session(request)
        body, req = await self._body(request, CompletionRequest)
        self._check_sampling(req)
        if req.stream:
            raise SessionError(400, "stream=true is served on /v1/chat/completions only")
        if not isinstance(req.prompt, str):
            raise SessionError(400, "prompt: a session's completion prompt is one string")
        async with s.lock:
            start = time.perf_counter()
            self.tokens.open_completion(s, req.prompt)
            out, text = await self._generate(s, self.tokens.budget(s, req.max_tokens),
                                             _stops(req.stop))
            s.text = req.prompt + text
            s.state.requests += 1
            s.state.handler_seconds += time.perf_counter() - start
        lps = self._logprobs(out)
        logprobs = None if req.logprobs is None else {
            "tokens": [x["token"] for x in lps], "token_logprobs": [x["logprob"] for x in lps],
            "top_logprobs": None, "text_offset": None}
        return web.json_response({
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": req.model or "policy",
            "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                         "finish_reason": "length" if out.finish_reason == "length" else "stop"}],
            "usage": {"prompt_tokens": len(s.episode.ids) - len(out.token_ids),
                      "completion_tokens": len(out.token_ids),
                      "total_tokens": len(s.episode.ids)}})

    async def _models(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"object": "list", "data": [
            {"id": "policy", "object": "model", "created": 0, "owned_by": "rlhf_megatron"}]})


def _stops(stop: Any) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)
