"""AsyncRollout: the async rollout engines as one stream of completed groups, which survives the
death of an engine (issue 26, item 6).

Prompts are spread over the live engines by key, and completed groups are collected from
whichever engine has them. Every key submitted and not yet taken is remembered with the request
that made it. An engine is dead when its vLLM process is gone, its Ray actor died, or it gave no
answer within CALL_TIMEOUT_S. Then:
- its groups in flight or buffered, which nobody took, are submitted again to the live engines
  (same key, same seed). None is lost, and none is trained twice: a taken group is no longer
  anybody's;
- its actor is killed and a replacement starts on its devices. The replacement joins the refit
  fanout at the next refit (`before_refit`) and takes work once that refit has given it the
  trainer's weights (`after_refit`). If no engine is left alive, the run waits for the
  replacement and refits it at once, at the current version;
- rollout/engine_deaths, rollout/requeued_groups and rollout/engines_live count it.

rollout.engine_restarts bounds the replacements in a run. The death after that ends the run with
the engine's one-line error, as a dead trainer worker does. A death in the middle of a refit
also ends it (the refit reaches every engine it started with, or fails).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rlhf_megatron.cluster.worker_group import WorkerGroup, remote, wait_all
from rlhf_megatron.errors import WorkerFailure, say
from rlhf_megatron.rollout import SamplingSettings
from rlhf_megatron.rollout.async_engine import RolloutGroup
from rlhf_megatron.workers import AsyncRolloutWorker

CALL_TIMEOUT_S = 60.0
"""No answer from a rollout engine within this long: it is dead (never a hang)."""

LIVE, STARTING, READY, JOINING = "live", "starting", "ready", "joining"
"""An engine's states: takes work / replacement starting vLLM / started, weights not yet sent /
in the refit fanout, work after that refit."""


@dataclass(eq=False)
class _Engine:
    rank: int
    """Its slot in the worker group: bundle, name and engine seed (groups._rollout_workers)."""
    handle: Any
    name: str
    state: str = LIVE
    started: Any = None
    """A replacement's ping, until it answers."""


@dataclass(frozen=True)
class _Request:
    """How a key was submitted, to submit it again: the worker call, the key's item (prompt
    ids, or an episode's sample), and the call's other arguments (one tuple per submit call)."""

    call: Callable[..., Any]
    item: Any
    args: tuple


class AsyncRollout:
    """The run's AsyncRolloutWorkers (module docstring). `connect()` reconnects the actor's
    refit to `workers.handles` (the live and joining engines); `refit_now()` refits them at the
    current weight version."""

    def __init__(self, workers: WorkerGroup, restarts: int, connect: Callable[[], None],
                 refit_now: Callable[[], None], startup_timeout_s: float) -> None:
        self.workers = workers
        self.engines = [_Engine(rank, h, n)
                        for rank, (h, n) in enumerate(zip(workers.handles, workers.names))]
        self.restarts_left = restarts
        self._connect, self._refit_now = connect, refit_now
        self.startup_timeout_s = startup_timeout_s
        self._requests: dict[int, _Request] = {}
        self._owner: dict[int, _Engine] = {}
        self._orphans: list[int] = []  # keys of a dead engine, until an engine is live
        self.deaths = 0
        self.requeued = 0

    # ------------------------------------------------------------------ submitting
    def submit(self, items: Sequence[tuple[int, list[int]]], sampling: SamplingSettings,
               seed: int) -> None:
        """Groups of `sampling.n` responses to (key, prompt ids)."""
        args = (sampling, seed)
        self._send([self._remember(key, AsyncRolloutWorker.submit, ids, args)
                    for key, ids in items])

    def submit_episodes(self, items: Sequence[tuple[int, dict]], env_cfg: Any,
                        sampling: SamplingSettings, seed: int) -> None:
        """Groups of `sampling.n` multi-turn episodes of (key, sample)."""
        args = (env_cfg, sampling, seed)
        self._send([self._remember(key, AsyncRolloutWorker.submit_episodes, sample, args)
                    for key, sample in items])

    def _remember(self, key: int, call: Callable[..., Any], item: Any, args: tuple) -> int:
        self._requests[key] = _Request(call, item, args)
        return key

    def _send(self, keys: list[int]) -> None:
        """Submit `keys` to the live engines, each to engine (key mod live engines); with none
        live they wait for a replacement."""
        live = self._live()
        if not live:
            self._orphans += keys
            return
        calls: dict[tuple[int, int], list[int]] = {}  # (engine, request's args) -> keys
        for key in keys:
            engine = live[key % len(live)]
            calls.setdefault((live.index(engine), id(self._requests[key].args)), []).append(key)
            self._owner[key] = engine
        batch = []
        for (engine_index, _), share in calls.items():
            request = self._requests[share[0]]
            items = [(key, self._requests[key].item) for key in share]
            batch.append((live[engine_index], request.call, (items, *request.args)))
        self._gather(batch, "rollout.submit")

    # ------------------------------------------------------------------ the buffers
    def counts(self) -> list[dict[str, int]]:
        """Each live engine's {in_flight, buffered, weight_version}, after handling any death."""
        while True:
            live = self._live()
            results = self._gather([(e, AsyncRolloutWorker.counts, ()) for e in live],
                                   "rollout.counts")
            if all(r is not None for r in results):
                return results

    def take(self, count: int, *, timeout_s: float) -> list[RolloutGroup]:
        """`count` completed groups, oldest first per engine, polling every engine."""
        taken: list[RolloutGroup] = []
        deadline = time.monotonic() + timeout_s
        while len(taken) < count:
            if not self._live():
                self._await_replacement()
            self._poll_started()
            counts = self.counts()  # handles any death first: then these are the live engines
            for engine, c in zip(self._live(), counts, strict=True):
                need = min(count - len(taken), c["buffered"])
                if need:
                    got = self._gather([(engine, AsyncRolloutWorker.take, (need, 0))],
                                       "rollout.take")[0]
                    for group in got or []:
                        self._requests.pop(group.key, None)
                        self._owner.pop(group.key, None)
                    taken += got or []
            if len(taken) < count:
                if self._live() and not self._orphans and sum(
                        c["in_flight"] + c["buffered"] for c in self.counts()) == 0:
                    raise WorkerFailure(f"rollout: waiting for {count - len(taken)} groups, "
                                        "but none is being generated")
                if time.monotonic() > deadline:
                    raise WorkerFailure(f"rollout: {len(taken)} of {count} groups after "
                                        f"{timeout_s:g}s")
                time.sleep(0.02)
        return taken

    def wait_idle(self, *, timeout_s: float) -> None:
        """Until no engine has a request in flight (one_step_off refits only then)."""
        deadline = time.monotonic() + timeout_s
        while self._orphans or sum(c["in_flight"] for c in self.counts()) > 0:
            if not self._live():
                self._await_replacement()
            if time.monotonic() > deadline:
                raise WorkerFailure(f"rollout: still generating after {timeout_s:g}s")
            time.sleep(0.02)

    def outstanding(self) -> int:
        """Groups submitted and not yet taken (a dead engine's wait in `_orphans`)."""
        return sum(c["in_flight"] + c["buffered"] for c in self.counts()) + len(self._orphans)

    def metrics(self) -> dict[str, float]:
        return {"rollout/engine_deaths": float(self.deaths),
                "rollout/requeued_groups": float(self.requeued),
                "rollout/engines_live": float(len(self._live()))}

    # ------------------------------------------------------------------ refits and replacements
    def before_refit(self) -> None:
        """Find dead engines now rather than in the refit, and put the replacements that have
        started into the refit fanout (they take work after it, `after_refit`)."""
        self.counts()
        if not self._live():  # the last one died since the batch was taken
            self._await_replacement()
        self._poll_started()
        for engine in self.engines:
            if engine.state == READY:
                engine.state = JOINING
        self._publish()

    def after_refit(self) -> None:
        """The refit reached the joining engines: they take work, the orphans first."""
        joined = [e for e in self.engines if e.state == JOINING]
        for engine in joined:
            engine.state = LIVE
            say(f"{engine.name}: the replacement engine has the trainer's weights and takes work")
        if joined or self._orphans:
            self._send_orphans()

    def _await_replacement(self) -> None:
        """No engine is live: wait for a replacement, refit it at the current version, and give
        it the orphans."""
        deadline = time.monotonic() + self.startup_timeout_s
        while not any(e.state == READY for e in self.engines):
            if not any(e.state == STARTING for e in self.engines):
                raise WorkerFailure("rollout: every engine is dead and none is starting")
            if time.monotonic() > deadline:
                raise WorkerFailure(f"rollout: no replacement engine started within "
                                    f"{self.startup_timeout_s:g}s")
            time.sleep(0.5)
            self._poll_started()
        for engine in self.engines:
            if engine.state == READY:
                engine.state = JOINING
        self._publish()
        self._refit_now()
        self.after_refit()

    def _send_orphans(self) -> None:
        keys, self._orphans = self._orphans, []
        self._send(keys)

    def _poll_started(self) -> None:
        """Replacements whose vLLM has started become READY (a failed start is another death)."""
        import ray

        for engine in self.engines:
            if engine.state != STARTING:
                continue
            done, _ = ray.wait([engine.started], timeout=0)
            if not done:
                continue
            try:
                wait_all(done, [engine.name], "rollout.start", timeout_s=CALL_TIMEOUT_S)
            except WorkerFailure as exc:
                self._died(engine, exc)
                continue
            engine.state, engine.started = READY, None

    def _publish(self) -> None:
        """The worker group's handles are the live and joining engines (validation generates on
        them, the refit fans out to them); reconnect the actor when that set changed."""
        active = [e for e in self.engines if e.state in (LIVE, JOINING)]
        handles = [e.handle for e in active]
        if handles == self.workers.handles:
            return
        self.workers.handles[:] = handles
        self.workers.names[:] = [e.name for e in active]
        if handles:
            self._connect()

    # ------------------------------------------------------------------ calls and deaths
    def _live(self) -> list[_Engine]:
        return [e for e in self.engines if e.state == LIVE]

    def _gather(self, calls: list[tuple[_Engine, Callable[..., Any], tuple]],
                what: str) -> list[Any]:
        """Start every call, then wait on each; an engine that died answers None (and its keys
        go to the others)."""
        refs = [remote(engine.handle, call, *args) for engine, call, args in calls]
        results: list[Any] = []
        dead: list[tuple[_Engine, WorkerFailure]] = []
        for (engine, _, _), ref in zip(calls, refs, strict=True):
            try:
                results.append(wait_all([ref], [engine.name], what,
                                        timeout_s=CALL_TIMEOUT_S)[0])
            except WorkerFailure as exc:
                results.append(None)
                dead.append((engine, exc))
        for engine, exc in dead:
            self._died(engine, exc)
        return results

    def _died(self, engine: _Engine, exc: WorkerFailure) -> None:
        """Replace `engine` and submit its keys again (module docstring), or end the run with
        its error once rollout.engine_restarts are used."""
        if self.restarts_left <= 0:
            raise exc
        self.restarts_left -= 1
        self.deaths += 1
        keys = sorted(k for k, owner in self._owner.items() if owner is engine)
        for key in keys:
            del self._owner[key]
        engine.handle = self.workers.respawn(engine.rank, engine.handle)
        engine.state, engine.started = STARTING, remote(engine.handle, AsyncRolloutWorker.ping)
        self._publish()
        self.requeued += len(keys)
        say(f"{exc}; its {len(keys)} groups go to the other engines and a replacement starts "
            f"({self.restarts_left} more allowed: rollout.engine_restarts)")
        self._send(keys)
