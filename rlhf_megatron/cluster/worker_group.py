"""Worker groups: N Ray actors of one role, called together.

`dispatch_dp` splits a batch into one shard per data-parallel rank, sends each shard to every rank
of that DP replica (TP/PP/CP peers get the same rows) and gathers the results of one rank per
replica, in DP order. Every call waits on all workers, so a dead worker surfaces at once as a
WorkerFailure naming it (its peers, stuck in a collective, are killed with the group), never a hang.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rlhf_megatron.cluster.lifecycle import actor_death_reason
from rlhf_megatron.cluster.ray_cluster import DevicePool
from rlhf_megatron.data.batch import TokenBatch
from rlhf_megatron.errors import RlhfMegatronError, WorkerFailure


def wait_all(refs: Sequence[Any], names: Sequence[str], call: str, *,
             timeout_s: float | None = None) -> list[Any]:
    """ray.get of every ref, failing fast on the first worker that died or raised."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    index = {ref: i for i, ref in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    pending = list(refs)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        wait_s = 5.0 if deadline is None else max(0.0, min(5.0, deadline - time.monotonic()))
        ready, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
        if not ready and deadline is not None and time.monotonic() >= deadline:
            stuck = ", ".join(names[index[r]] for r in pending)
            raise WorkerFailure(f"{call}: no answer from {stuck} within {timeout_s:g}s")
        for ref in ready:
            name = names[index[ref]]
            try:
                results[index[ref]] = ray.get(ref)
            except RayActorError as exc:

                reason = actor_death_reason(exc)
                raise WorkerFailure(f"worker {name} died during {call}: {reason}") from None
            except RayTaskError as exc:
                cause = exc.cause if getattr(exc, "cause", None) is not None else exc
                if isinstance(cause, RlhfMegatronError):
                    raise type(cause)(f"{name}: {cause}") from None
                last = str(cause).strip().splitlines()[-1] if str(cause).strip() else ""
                raise WorkerFailure(f"worker {name} failed in {call}: {type(cause).__name__}: "
                                    f"{last}{_innermost_frame(exc)}") from None
    return results


def _innermost_frame(exc: Exception) -> str:
    """' (at file.py:123)' of the worker-side frame that raised, from Ray's traceback text."""
    frames = re.findall(r'File "([^"]+)", line (\d+)', str(exc))
    if not frames:
        return ""
    path, line = frames[-1]
    return f" (at {path.rsplit('/', 1)[-1]}:{line})"


class WorkerGroup:
    """Ray actors `handles[i]` named `names[i]` (rank i of the group)."""

    def __init__(self, role: str, handles: list[Any], names: list[str],
                 spawn: Callable[[int], Any] | None = None) -> None:
        self.role, self.handles, self.names = role, handles, names
        self.dp_rank: list[int] = [0] * len(handles)
        self.collector: list[bool] = [True] * len(handles)
        self.dp_size = 1
        self._spawn = spawn
        self._replacements: list[Any] = []  # respawned actors, killed with the group

    def respawn(self, rank: int, old: Any) -> Any:
        """Kill `old` (an actor of rank `rank`) and start a new actor for that rank, on its
        bundle and with its arguments. The caller decides when it joins `handles`."""
        import ray

        assert self._spawn is not None, f"{self.role}: a group not made by create()"
        try:
            ray.kill(old, no_restart=True)
        except Exception:  # already gone
            pass
        handle = self._spawn(rank)
        self._replacements.append(handle)
        return handle

    @classmethod
    def create(cls, role: str, actor_class: type, pool: DevicePool, bundles: Sequence[int],
               make_args: Callable[[int], tuple]) -> WorkerGroup:
        import ray

        remote = ray.remote(actor_class)
        bundles = list(bundles)

        def spawn(rank: int) -> Any:
            return remote.options(**pool.options(bundles[rank])).remote(*make_args(rank))

        return cls(role, [spawn(rank) for rank in range(len(bundles))],
                   [f"{role}[{rank}]" for rank in range(len(bundles))], spawn)

    def call(self, method: str, *args: Any, timeout_s: float | None = None,
             **kwargs: Any) -> list[Any]:
        """The same call on every worker; results in rank order."""
        refs = [getattr(h, method).remote(*args, **kwargs) for h in self.handles]
        return wait_all(refs, self.names, f"{self.role}.{method}", timeout_s=timeout_s)

    def set_parallel_ranks(self, ranks: Sequence[dict[str, int]]) -> None:
        self.dp_rank = [r["dp_rank"] for r in ranks]
        self.collector = [bool(r["collector"]) for r in ranks]
        self.dp_size = ranks[0]["dp_size"]

    def submit_dp(self, method: str, batch: TokenBatch, *args: Any) -> PendingDp:
        """Shard `batch` over DP and start `method(shard, *args)` on every worker."""
        import ray

        shards = [ray.put(shard) for shard in batch.chunk(self.dp_size)]
        refs = [getattr(h, method).remote(shards[self.dp_rank[i]], *args)
                for i, h in enumerate(self.handles)]
        return PendingDp(self, refs, f"{self.role}.{method}")

    def dispatch_dp(self, method: str, batch: TokenBatch, *args: Any) -> list[Any]:
        """submit_dp(...).collect(): one result per DP rank, in DP order."""
        return self.submit_dp(method, batch, *args).collect()

    def kill(self) -> None:
        import ray

        for handle in [*self.handles, *self._replacements]:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # already gone
                pass


class PendingDp:
    """A started DP-dispatched call; `collect()` waits on every worker."""

    def __init__(self, group: WorkerGroup, refs: list[Any], call: str) -> None:
        self.group, self.refs, self.call = group, refs, call

    def collect(self) -> list[Any]:
        group = self.group
        results = wait_all(self.refs, group.names, self.call)
        by_dp = {group.dp_rank[i]: r for i, r in enumerate(results) if group.collector[i]}
        return [by_dp[d] for d in range(group.dp_size)]


def concat_rows(parts: Sequence[Any]) -> Any:
    """Concatenate per-DP results along the batch dim (tensors or dicts of tensors)."""
    if isinstance(parts[0], dict):
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    return torch.cat(list(parts))


def remote(handle: Any, method: Callable[..., Any], *args: Any) -> Any:
    """Start `method` (a worker class's function, named by reference) on the Ray actor `handle`;
    returns its ObjectRef."""
    return getattr(handle, method.__name__).remote(*args)
