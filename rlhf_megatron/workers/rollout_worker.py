"""RolloutWorker: one RolloutEngine (rollout/engine.py) as a Ray actor, in every rollout mode.

The sync step and validation call `generate` / `run_episodes` (generate now, at one version);
the off-policy modes stream groups through `submit` / `submit_episodes` and `take`. Refit drives
it through begin_weight_update, load_bucket(handle) and finish_weight_update(version); buckets
arrive as transport handles and are handed to vLLM's worker process as such. Outside Ray (the
refit tests' rollout server, refit/rollout_server.py) the same object serves a connection.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from rlhf_megatron.data.batch import TokenBatch
from rlhf_megatron.rollout.async_batch import RolloutResult, groups_to_result
from rlhf_megatron.rollout.async_episodes import EpisodeGroups, run_episodes
from rlhf_megatron.rollout.config import RolloutConfig, SamplingSettings
from rlhf_megatron.rollout.engine import RolloutEngine, RolloutGroup
from rlhf_megatron.workers.threads import set_threads


class RolloutWorker:
    def __init__(self, name: str, hf_dir: str, config: RolloutConfig, threads: int = 1,
                 capacity: int = 64) -> None:
        self.name = name
        self.threads = threads
        """Intra-op threads of vLLM's engine process, fixed when it starts (workers/threads.py):
        on split pools it generates continuously on its own cores; in the hybrid layout it idles
        (its queue empty) while the trainer has the cores."""
        os.environ["OMP_NUM_THREADS"] = str(threads)  # inherited by vLLM's EngineCore process
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # Ray placed us already
        set_threads(threads)
        self.engine = RolloutEngine(hf_dir, config, capacity=capacity)
        self._broadcast: dict[tuple[str, int], Any] = {}
        self._episodes: EpisodeGroups | None = None

    # generation -----------------------------------------------------------------
    def submit(self, items: Sequence[tuple[int, Sequence[int]]], sampling: SamplingSettings,
               seed: int | None) -> int:
        self.engine.submit(items, sampling, seed)
        return len(items)

    def submit_episodes(self, items: Sequence[tuple[int, dict]], env_cfg: Any,
                        sampling: SamplingSettings, seed: int | None) -> int:
        """Multi-turn episode groups into the buffer (rollout/async_episodes.EpisodeGroups; the
        environment class and the chat template are loaded on the first call)."""
        if self._episodes is None:
            self._episodes = EpisodeGroups(self.engine, env_cfg)
        self.engine.submit_episodes(items, self._episodes, sampling, seed)
        return len(items)

    def take(self, count: int, timeout: float | None = None) -> list[RolloutGroup]:
        return self.engine.take(count, timeout)

    def counts(self) -> dict[str, int]:
        return self.engine.counts()

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings,
                 first_prompt: int = 0) -> RolloutResult:
        """Generate now (the sync step, validation): a RolloutResult, prompt-major, its prompts
        numbered (seeded, prompt_index) from `first_prompt`, so the split over engines changes
        neither."""
        groups = self.engine.generate_groups(prompts, sampling, sampling.seed,
                                             first_key=first_prompt)
        return groups_to_result(groups, self.engine.weight_version, first_prompt)

    def run_episodes(self, samples: list[dict], env_cfg: Any, sampling: SamplingSettings,
                     first_prompt: int = 0) -> Any:
        """Multi-turn episodes, each its own task on the engine's loop
        (rollout/async_episodes.py): (TokenBatch, metrics)."""
        return run_episodes(self.engine, env_cfg, samples, sampling, first_prompt)

    def score_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """(bs, S) log-probs of the batch's tokens under the rollout weights (refit checks)."""
        return self.engine.score_logprobs(batch)

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    # refit ----------------------------------------------------------------------
    def begin_weight_update(self) -> None:
        self.engine.begin_weight_update()

    def load_bucket(self, handle: Any) -> int:
        from rlhf_megatron.refit.transports import BroadcastHandle, BroadcastReceiver

        if isinstance(handle, BroadcastHandle):  # another node: receive here, stage locally
            address = tuple(handle.address)
            if address not in self._broadcast:
                self._broadcast[address] = BroadcastReceiver(address)
            tensors = self._broadcast[address].receive(handle)
            self.engine.load_weights(tensors)
            return len(tensors)
        return self.engine.load_bucket(handle)

    def finish_weight_update(self, version: int) -> int:
        return self.engine.finish_weight_update(version)

    # memory and identity ---------------------------------------------------------
    def sleep(self) -> None:
        """Free vLLM's memory while a colocated trainer runs; a no-op on CPU and on split pools,
        where nothing calls it."""
        self.engine.sleep()

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.engine.wake_up(tags)

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def ping(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        self.engine.shutdown()
