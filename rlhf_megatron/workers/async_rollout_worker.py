"""AsyncRolloutWorker: one AsyncRolloutEngine (rollout/async_engine.py) as a Ray actor, for trainer.rollout_mode
one_step_off / async. It answers the same refit protocol as the synchronous RolloutWorker
(begin_weight_update, load_bucket(handle), finish_weight_update(version)), so refit/ drives it
unchanged; buckets arrive as transport handles and are handed to vLLM's worker process as such.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from rlhf_megatron.rollout.async_batch import groups_to_result
from rlhf_megatron.rollout.async_engine import AsyncRolloutEngine, RolloutGroup
from rlhf_megatron.rollout.async_episodes import EpisodeGroups, run_episodes
from rlhf_megatron.rollout.config import RolloutConfig, SamplingSettings
from rlhf_megatron.workers.threads import set_threads


class AsyncRolloutWorker:
    def __init__(self, name: str, hf_dir: str, config: RolloutConfig, threads: int = 1,
                 capacity: int = 64) -> None:
        self.name = name
        self.threads = threads
        """Intra-op threads of vLLM's engine process: it generates continuously on its own pool
        (split pools only), so it keeps them (workers/threads.py)."""
        os.environ["OMP_NUM_THREADS"] = str(threads)  # inherited by vLLM's EngineCore process
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # Ray placed us already
        set_threads(threads)
        self.engine = AsyncRolloutEngine(hf_dir, config, capacity=capacity)
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
                 first_prompt: int = 0) -> Any:
        """The synchronous engine's generate (validation): a RolloutResult, prompt-major, its
        prompts numbered (seeded, prompt_index) from `first_prompt`."""
        groups = self.engine.generate_groups(prompts, sampling, sampling.seed,
                                             first_key=first_prompt)
        return groups_to_result(groups, self.engine.weight_version, first_prompt)

    def run_episodes(self, samples: list[dict], env_cfg: Any, sampling: SamplingSettings,
                     first_prompt: int = 0) -> Any:
        """Multi-turn episodes, each its own task on the engine's loop
        (rollout/async_episodes.py): (TokenBatch, metrics)."""
        return run_episodes(self.engine, env_cfg, samples, sampling, first_prompt)

    # refit ----------------------------------------------------------------------
    def begin_weight_update(self) -> bool:
        return self.engine.begin_weight_update()

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

    # the synchronous worker's remaining surface -----------------------------------
    def sleep(self) -> None:
        """Free vLLM's memory while a colocated trainer runs (sync-mode episodes); a no-op on CPU
        and on split pools, where nothing calls it."""
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
