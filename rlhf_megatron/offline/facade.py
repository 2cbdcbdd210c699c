"""OfflineActorGroup: the typed facade of an offline run's actor (OfflineWorkers), as
controller/facades.py gives the RL roles theirs: the trainer calls these methods, each calls the
worker method of the same Python name, so no call site names a worker method by a string.
Checkpoints (save/load) and kill/pids come from the RL facades' Megatron base."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from rlhf_megatron.config import TrainConfig
from rlhf_megatron.controller.facades import _MegatronFacade
from rlhf_megatron.controller.worker_group import WorkerGroup, concat_rows, wait_all
from rlhf_megatron.data.batch import TokenBatch


class OfflineActorGroup(_MegatronFacade):
    """The policy on its Megatron layout; no reference engine (the reference log-probs are
    computed once by the trainer and travel in the batch)."""

    @classmethod
    def build(cls, cfg: TrainConfig, pool: Any) -> OfflineActorGroup:
        """The actor's OfflineWorkers on `pool`, set up (torch.distributed + ActorEngine)."""
        from rlhf_megatron.offline.worker import OfflineWorker
        from rlhf_megatron.workers.megatron_worker import EngineSpec

        world, seed = cfg.actor.layout.world_size, cfg.trainer.seed
        group = cls(WorkerGroup.create("actor", OfflineWorker, pool, range(world),
                                       lambda rank: (f"actor[{rank}]", rank, world)))
        timeout = cfg.ray.startup_timeout_s
        ip, port, _ = wait_all([group.workers.handles[0].address.remote()], ["actor[0]"],
                               "address", timeout_s=timeout)[0]
        spec = EngineSpec("actor", cfg.model.path, cfg.actor.layout,
                          replace(cfg.actor.engine, seed=seed), with_reference=False, seed=seed)
        group.workers.set_parallel_ranks(group._each.setup(spec, ip, port, timeout_s=timeout))
        return group

    def sequence_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """(bs,) summed log-probs of each row's loss tokens under the current weights."""
        return concat_rows(self._dp.sequence_logprobs(batch).collect())

    def update(self, batch: TokenBatch, spec: Any) -> list[dict[str, Any]]:
        """One optimizer step of the offline loss (offline/steps.OfflineStepSpec); one result
        per DP rank ({'metrics', and 'logprobs' when spec.return_logprobs})."""
        return self._dp.offline_update(batch, spec).collect()
