"""Typed facades over the worker groups: what the controller may ask of each role.

The phases call these methods (`actor.update_policy(batch, settings)`, `rollout.generate(...)`).
A facade calls its workers' methods by reference (`self._dp(MegatronWorker.update_policy, batch,
settings)` runs it on every rank, the batch sharded over DP), so no call site names a method by a
string. The rollout facade names RolloutWorker's methods; AsyncRolloutWorker answers the same ones
(checked below, when this module is imported). A `submit_*` method starts a DP-sharded call and returns
a Pending; `.result()` waits for it (so the actor's and the critic's forwards run at once).
Adding a worker method: define it on the worker class (workers/), add one typed method here that
calls it, and call that from the phases.

Threads follow the work (CPU): a call carries no thread count; each worker knows its share of its
pool's cores (`threads`, set at creation from ray_cluster.worker_threads) and takes it for the
length of a compute call (workers/threads.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from rlhf_megatron.cluster.worker_group import (
    PendingDp,
    WorkerGroup,
    concat_rows,
    remote,
    wait_all,
)
from rlhf_megatron.data.batch import TokenBatch
from rlhf_megatron.errors import WorkerFailure
from rlhf_megatron.rollout import SamplingSettings
from rlhf_megatron.workers import AsyncRolloutWorker, MegatronWorker, RolloutWorker

T = TypeVar("T")


class Pending(Generic[T]):
    """A started DP call; `result()` waits on every worker and combines the DP ranks' parts."""

    def __init__(self, pending: PendingDp, combine: Callable[[list[Any]], T]) -> None:
        self._pending, self._combine = pending, combine

    def result(self) -> T:
        return self._combine(self._pending.collect())


@dataclass
class ActorLogProbs:
    """The actor's forward over a batch: logprobs and entropy (bs, S) aligned with input_ids,
    and the reference's log-probs (bs, S) when the run has a reference (else None)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    ref_logprobs: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None
    """MoE with actor.engine.routing_replay: (bs, S, MoE layers, k) experts of each token."""


@dataclass
class PolicyUpdate:
    """One actor optimizer step: its metrics (reduced over DP) and, after an on-policy update,
    the log-probs and entropy its forward computed before the step (rows in batch order)."""

    metrics: dict[str, float]
    on_policy: ActorLogProbs | None = None


@dataclass
class RefitReport:
    """One refit, over the actor's ranks: the version the engines report, the slowest rank's
    seconds, and bytes/buckets summed over the pipeline stages' senders."""

    version: int
    seconds: float
    bytes: int
    buckets: int


@dataclass
class Generation:
    """One generate call over every rollout engine: rows in prompt-major order
    (batch.prompt_index indexes the prompts), each row's finish reason, the one weight version
    the engines generated with, and the wall-clock seconds."""

    batch: TokenBatch
    finish_reasons: list[str]
    weight_version: int
    seconds: float


class _EachRank:
    """`each(Worker.method, *args)`: that worker method on every worker, waited on; the results
    in rank order (WorkerGroup.call). The method is named by reference, so a rename or a typo
    fails where the facade is read, and a reader (or a call-graph tool) follows it into the
    worker. Only the facades hold one."""

    def __init__(self, group: WorkerGroup) -> None:
        self._group = group

    def __call__(self, method: Callable[..., Any], *args: Any) -> list[Any]:
        return self._group.call(method.__name__, *args)


class _ByDp:
    """`dp(Worker.method, batch, *args)`: that worker method, started with `batch` sharded over
    DP (WorkerGroup.submit_dp); returns the PendingDp."""

    def __init__(self, group: WorkerGroup) -> None:
        self._group = group

    def __call__(self, method: Callable[..., Any], batch: TokenBatch, *args: Any) -> PendingDp:
        return self._group.submit_dp(method.__name__, batch, *args)


class _Facade:
    def __init__(self, workers: WorkerGroup) -> None:
        self.workers = workers
        """The Ray actors behind the facade (for building and tearing down, not for calls)."""
        self._each, self._dp = _EachRank(workers), _ByDp(workers)

    @property
    def names(self) -> list[str]:
        return self.workers.names

    def pids(self) -> list[int]:
        """Each worker's process id, in rank order."""
        return self._each(MegatronWorker.ping)

    def kill(self) -> None:
        self.workers.kill()


class _MegatronFacade(_Facade):
    """What every Megatron role has: checkpoints."""

    def save_checkpoint(self, directory: str, step: int) -> None:
        self._each(MegatronWorker.save_checkpoint, directory, step)

    def load_checkpoint(self, directory: str) -> None:
        self._each(MegatronWorker.load_checkpoint, directory)


class ActorGroup(_MegatronFacade):
    """The policy (and its frozen reference) on its Megatron layout."""

    def submit_logprobs(self, batch: TokenBatch) -> Pending[ActorLogProbs]:
        """Actor log-probs + entropy, and reference log-probs, in one round trip."""
        def combine(parts: list[Any]) -> ActorLogProbs:
            out = concat_rows(parts)
            return ActorLogProbs(out["logprobs"], out["entropy"], out.get("ref_logprobs"),
                                 out.get("routed_experts"))
        return Pending(self._dp(MegatronWorker.compute_old_and_ref_logprobs, batch), combine)

    def compute_logprobs(self, batch: TokenBatch) -> ActorLogProbs:
        return self.submit_logprobs(batch).result()

    def submit_ref_logprobs(self, batch: TokenBatch) -> Pending[torch.Tensor]:
        """(bs, S) reference log-probs alone (the on-policy shortcut skips the actor's)."""
        return Pending(self._dp(MegatronWorker.compute_ref_logprobs, batch),
                       lambda parts: concat_rows(parts)["logprobs"])

    def update_policy(self, batch: TokenBatch, settings: Any) -> PolicyUpdate:
        """One optimizer step on `batch` (a mini-batch, sharded over DP) with
        engines.actor.PolicyUpdateSettings. Without batch.old_logprobs (the on-policy shortcut)
        the update's own forward values come back as `on_policy`."""
        parts = self._dp(MegatronWorker.update_policy, batch, settings).collect()
        on_policy = None
        if "logprobs" in parts[0]:
            on_policy = ActorLogProbs(torch.cat([p["logprobs"] for p in parts]),
                                      torch.cat([p["entropy"] for p in parts]))
        return PolicyUpdate(parts[0]["metrics"], on_policy)

    def offline_update(self, batch: TokenBatch, spec: Any) -> list[dict[str, Any]]:
        """One optimizer step of an offline loss (engines.offline_update.OfflineStepSpec); one
        result per DP rank ({'metrics', and 'logprobs' when spec.return_logprobs})."""
        return self._dp(MegatronWorker.offline_update, batch, spec).collect()

    def sequence_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """(bs,) summed log-probs of each row's loss tokens under the current weights."""
        return concat_rows(self._dp(MegatronWorker.sequence_logprobs, batch).collect())

    def connect_rollout(self, rollout: RolloutGroup, *, bucket_bytes: int,
                        transport: str) -> None:
        """Once, when the groups are built: every rank connects to the rollout engines
        (refit/fanout.py chooses each engine's transport)."""
        self._each(MegatronWorker.connect_rollout, list(rollout.workers.handles), bucket_bytes,
                   transport)

    def refit(self, version: int) -> RefitReport:
        """Send the current weights to every rollout engine as `version`."""
        stats = self._each(MegatronWorker.refit, version)
        reported = stats[0]["version"]
        if reported != version:  # what vLLM reports after finish_weight_update
            raise WorkerFailure(f"refit to version {version}: the rollout engines report "
                                f"{reported}")
        return RefitReport(reported, max(s["seconds"] for s in stats),
                           sum(s["bytes"] for s in stats), sum(s["buckets"] for s in stats))

    def offload(self) -> dict[str, float]:
        """Move the training state off the device; sums over ranks of {'bytes', 'freed'}."""
        ranks = self._each(MegatronWorker.offload)
        return {"bytes": float(sum(r["bytes"] for r in ranks)),
                "freed": float(sum(r["freed"] for r in ranks))}

    def onload(self) -> float:
        """Bring it back; the rise in resident memory summed over ranks."""
        return float(sum(r["restored"] for r in self._each(MegatronWorker.onload)))


class CriticGroup(_MegatronFacade):
    """The value model (PPO)."""

    def submit_values(self, batch: TokenBatch) -> Pending[torch.Tensor]:
        """(bs, S) value estimates."""
        return Pending(self._dp(MegatronWorker.compute_values, batch), concat_rows)

    def update(self, batch: TokenBatch, *, value_clip: float | None,
               aggregation: str) -> dict[str, float]:
        """One optimizer step of the value loss on `batch` (a mini-batch)."""
        return self._dp(MegatronWorker.update_critic, batch, value_clip, aggregation).collect()[0]


class RewardModelGroup(_MegatronFacade):
    """A sequence-classification reward model."""

    def score(self, batch: TokenBatch) -> torch.Tensor:
        """(bs,) scores."""
        return concat_rows(self._dp(MegatronWorker.score, batch).collect())


class RolloutGroup(_Facade):
    """The vLLM engines (one worker per engine)."""

    def generate(self, prompts: Sequence[list[int]], sampling: SamplingSettings) -> Generation:
        """Split the prompts over the engines (contiguous, in order); each engine seeds and
        numbers its prompts from its first prompt's place in `prompts` (the engine owns the
        per-prompt seed rule, rollout.vllm_engine.prompt_seed)."""
        handles, names = self.workers.handles, self.workers.names
        bounds = [round(i * len(prompts) / len(handles)) for i in range(len(handles) + 1)]
        refs, used = [], []
        start = time.perf_counter()
        for engine, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            if hi > lo:
                refs.append(remote(handles[engine], RolloutWorker.generate, list(prompts[lo:hi]), sampling, lo))
                used.append(names[engine])
        results = wait_all(refs, used, "rollout.generate")
        seconds = time.perf_counter() - start
        versions = {name: r.weight_version for r, name in zip(results, used, strict=True)}
        if len(set(versions.values())) != 1:  # one engine missed a refit
            raise WorkerFailure(f"rollout engines generated with different weight versions "
                                f"{versions}")
        return Generation(TokenBatch.concat([r.batch for r in results]),
                          [f for r in results for f in r.finish_reasons],
                          next(iter(versions.values())), seconds)

    def run_episodes(self, samples: Sequence[dict], env_cfg: Any,
                     sampling: SamplingSettings) -> tuple[TokenBatch, dict[str, float]]:
        """Multi-turn episodes (issue 15), samples split over the engines like generate(); the
        engines' metrics are averaged weighted by their episode counts."""
        handles, names = self.workers.handles, self.workers.names
        bounds = [round(i * len(samples) / len(handles)) for i in range(len(handles) + 1)]
        refs, used = [], []
        for engine, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            if hi > lo:
                refs.append(remote(handles[engine], AsyncRolloutWorker.run_episodes,
                    list(samples[lo:hi]), env_cfg, sampling, lo))
                used.append(names[engine])
        results = wait_all(refs, used, "rollout.run_episodes")
        total = sum(len(b) for b, _ in results)
        metrics = {k: sum(m[k] * len(b) for b, m in results) / total for k in results[0][1]}
        return TokenBatch.concat([b for b, _ in results]), metrics

    def sleep(self) -> None:
        """Free the KV cache (GPU) while the trainer runs."""
        self._each(RolloutWorker.sleep)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore `tags` ("weights", "kv_cache"; None: all)."""
        self._each(RolloutWorker.wake_up, tags)


# Both rollout workers answer every call the rollout facade and the refit make.
_ROLLOUT_CALLS = (RolloutWorker.generate, RolloutWorker.sleep,
                  RolloutWorker.wake_up, RolloutWorker.ping, RolloutWorker.begin_weight_update,
                  RolloutWorker.load_bucket, RolloutWorker.finish_weight_update,
                  RolloutWorker.node_ip)
_MISSING = [m.__name__ for m in _ROLLOUT_CALLS if not callable(getattr(AsyncRolloutWorker,
                                                                        m.__name__, None))]
assert not _MISSING, f"AsyncRolloutWorker lacks {_MISSING}"
