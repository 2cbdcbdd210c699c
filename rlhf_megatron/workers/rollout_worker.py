"""RolloutWorker: one vLLM engine as a Ray actor (a thin shell over VllmRolloutEngine), also the
receiving end of refit (buckets arrive as transport handles, see refit/fanout.py)."""

from __future__ import annotations

import os
from typing import Any

from rlhf_megatron.data.batch import TokenBatch
from rlhf_megatron.rollout import RolloutConfig, SamplingSettings
from rlhf_megatron.workers.threads import on_cores


class RolloutWorker:
    def __init__(self, name: str, hf_dir: str, config: RolloutConfig, threads: int = 1) -> None:
        from rlhf_megatron.refit.rollout_server import RolloutService
        from rlhf_megatron.rollout import VllmRolloutEngine

        self.name = name
        self.threads = threads
        """Intra-op threads while generating or scoring (workers/threads.py)."""
        self.engine = VllmRolloutEngine(hf_dir, config)
        self.service = RolloutService(self.engine)

    @on_cores
    def generate(self, prompts: list[list[int]], sampling: SamplingSettings,
                 first_prompt: int = 0) -> Any:
        return self.engine.generate(prompts, sampling, first_prompt)

    @on_cores
    def score_logprobs(self, batch: TokenBatch) -> Any:
        return self.engine.score_logprobs(batch)

    def begin_weight_update(self) -> bool:
        return self.service.begin_weight_update()

    def load_bucket(self, handle: Any) -> int:
        return self.service.load_bucket(handle)

    def finish_weight_update(self, version: int) -> int:
        return self.service.finish_weight_update(version)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.engine.wake_up(tags)

    def node_ip(self) -> str:
        from rlhf_megatron.platform.net import node_ip

        return node_ip()

    def ping(self) -> int:
        return os.getpid()
