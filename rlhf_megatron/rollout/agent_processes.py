"""Agents in processes of their own (``environment.agent.processes`` > 0, issue 27 item 4).

By default an agent runs on an event loop in a thread of the rollout engine's process (see
rollout/agent_episodes.AgentLoop): cheap, but the agent's Python shares the engine's GIL (an
agent framework's CPU slows the endpoint and vLLM's output handling) and its process (an agent
that calls ``os._exit`` or crashes the interpreter ends the rollout worker). With ``processes: N``
the episodes go round-robin to N spawned processes, each running the agent function on its own
event loop; the endpoint, the engine and the trainer never run the agent's code.

A pool is started at the first rollout that needs it and kept for the life of the process that
owns the engine (one per agent path, kwargs and size), so a step pays no process start. A
process that dies fails the episodes it was running (reward 0, logged once each, as for an agent
that raised) and is started again for the next ones. A process ends when the pool is closed
(a stop message), or when its pipe closes because its owner died, even by kill -9.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import json
import logging
import multiprocessing
import threading
from typing import Any

from rlhf_megatron.environments.loader import load_agent
from rlhf_megatron.rewards.errors import one_line

log = logging.getLogger(__name__)


class AgentFailed(Exception):
    """An episode's agent failed in its process: the one-line reason (its exception, or the
    process's death)."""


class NotAReward:
    """What an agent returned that is not a number or None, as its repr (the value itself may
    not survive the pipe)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _reply_of(task: asyncio.Task) -> tuple[str, Any]:
    if task.cancelled():
        return "error", "cancelled (the episode's time limit)"
    exc = task.exception()
    if exc is not None:
        return "error", f"{type(exc).__name__}: {one_line(str(exc))}"
    value = task.result()
    if value is None or isinstance(value, (bool, int, float)):
        return "ok", value
    return "repr", repr(value)[:200]


def _process_main(conn: Any, spec: str, kwargs: dict[str, Any]) -> None:
    """A pool process: run ``("run", job, base_url, api_key, sample)`` messages as tasks of one
    event loop, answer ``(job, kind, value)``, cancel on ``("cancel", job)``; exit on
    ``("stop",)`` or when the pipe closes (its owner died)."""
    agent = load_agent(spec)
    loop = asyncio.new_event_loop()
    tasks: dict[int, asyncio.Task] = {}
    send_lock = threading.Lock()

    def done(job: int, task: asyncio.Task) -> None:
        tasks.pop(job, None)
        kind, value = _reply_of(task)
        with send_lock:
            conn.send((job, kind, value))

    def handle(message: tuple) -> None:
        if message[0] == "run":
            _, job, base_url, api_key, sample = message
            task = loop.create_task(agent(base_url, api_key, sample, **kwargs))
            tasks[job] = task
            task.add_done_callback(lambda t, job=job: done(job, t))
        elif message[0] == "cancel" and message[1] in tasks:
            tasks[message[1]].cancel()
        elif message[0] == "stop":
            loop.stop()

    def read() -> None:
        try:
            while True:
                loop.call_soon_threadsafe(handle, conn.recv())
        except (EOFError, OSError):  # the pool closed its end, or its owner died
            loop.call_soon_threadsafe(loop.stop)

    threading.Thread(target=read, name="agent-pipe", daemon=True).start()
    loop.run_forever()


class _JobFuture(concurrent.futures.Future):
    """An episode's future; cancelling it (the episode's time limit) cancels the agent's task
    in its process."""

    def __init__(self, job: int, proc: _Process) -> None:
        super().__init__()
        self.job, self.proc = job, proc

    def cancel(self) -> bool:
        if not self.done():
            try:
                self.proc.send(("cancel", self.job))
            except (OSError, ValueError):  # the process is gone: nothing left to cancel
                pass
        return super().cancel()


class _Process:
    """One pool process, its pipe and the futures of the jobs it runs."""

    def __init__(self, spec: str, kwargs: dict[str, Any], name: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_process_main, args=(child, spec, kwargs), name=name)
        self.process.start()
        child.close()
        self.pending: dict[int, concurrent.futures.Future] = {}
        self.lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, name=f"{name}-replies", daemon=True)
        self.reader.start()

    @property
    def alive(self) -> bool:
        return self.reader.is_alive()

    def send(self, message: tuple) -> None:
        with self.lock:
            self.conn.send(message)

    def _read(self) -> None:
        try:
            while True:
                job, kind, value = self.conn.recv()
                future = self.pending.pop(job, None)
                if future is None or future.done():
                    continue
                if kind == "ok":
                    future.set_result(value)
                elif kind == "repr":
                    future.set_result(NotAReward(value))
                else:
                    future.set_exception(AgentFailed(value))
        except (EOFError, OSError):
            pass
        self.process.join(timeout=5)
        reason = f"the agent's process died (exit code {self.process.exitcode})"
        for future in list(self.pending.values()):
            if not future.done():
                future.set_exception(AgentFailed(reason))
        self.pending.clear()

    def close(self) -> None:
        """Ask the process to stop (closing this end alone would not wake the reader thread's
        pending recv, so the process would never see the pipe close), then make sure."""
        try:
            self.send(("stop",))
        except (OSError, ValueError):
            pass
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        self.conn.close()


class AgentProcessPool:
    """``processes`` processes running the agent ``spec`` (see the module docstring)."""

    def __init__(self, spec: str, kwargs: dict[str, Any], processes: int) -> None:
        self.spec, self.kwargs = spec, dict(kwargs)
        self.slots: list[_Process | None] = [None] * processes
        self.jobs = itertools.count()
        """Job numbers; job j goes to slot j mod processes (round-robin)."""
        self.lock = threading.Lock()

    def submit(self, base_url: str, api_key: str, sample: dict[str, Any]
               ) -> concurrent.futures.Future:
        """Run one episode's agent; its future holds the return value (NotAReward for anything
        but a number or None) or raises AgentFailed; cancelling it cancels the agent."""
        with self.lock:
            job = next(self.jobs)
            proc = self._process(job % len(self.slots))
            future = proc.pending[job] = _JobFuture(job, proc)
        try:
            proc.send(("run", job, base_url, api_key, sample))
        except (OSError, ValueError) as exc:  # it died between the check and the send
            proc.pending.pop(job, None)
            future.set_exception(AgentFailed(f"the agent's process is gone ({exc})"))
        return future

    def _process(self, slot: int) -> _Process:
        proc = self.slots[slot]
        if proc is None or not proc.alive:
            if proc is not None:
                log.warning("agent process %d of %s died; starting it again", slot, self.spec)
            proc = self.slots[slot] = _Process(self.spec, self.kwargs, f"agent-{slot}")
        return proc

    def close(self) -> None:
        with self.lock:
            for proc in self.slots:
                if proc is not None:
                    proc.close()
            self.slots = [None] * len(self.slots)


_POOLS: dict[str, AgentProcessPool] = {}
_POOLS_LOCK = threading.Lock()


def agent_pool(spec: str, kwargs: dict[str, Any], processes: int) -> AgentProcessPool:
    """The process's pool for this agent, kwargs and size, started once and closed at exit."""
    key = json.dumps([spec, kwargs, processes], sort_keys=True, default=repr)
    with _POOLS_LOCK:
        if key not in _POOLS:
            if not _POOLS:
                atexit.register(close_pools)
            _POOLS[key] = AgentProcessPool(spec, kwargs, processes)
        return _POOLS[key]


def close_pools() -> None:
    """Close every agent pool of this process (their processes end)."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.close()
