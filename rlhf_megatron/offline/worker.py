"""OfflineWorker: a MegatronWorker (same setup, checkpoints, engines) with the two calls the
offline trainer needs. Only the actor role is built; no reference engine, no rollout."""

from __future__ import annotations

from typing import Any

import torch

from rlhf_megatron.data.batch import TokenBatch
from rlhf_megatron.workers.megatron_worker import MegatronWorker


class OfflineWorker(MegatronWorker):
    def offline_update(self, batch: TokenBatch, spec: Any) -> dict[str, Any]:
        from rlhf_megatron.offline.steps import offline_update

        return offline_update(self.engine, batch, spec)

    def sequence_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        from rlhf_megatron.offline.steps import sequence_logprobs

        return sequence_logprobs(self.engine, batch)
