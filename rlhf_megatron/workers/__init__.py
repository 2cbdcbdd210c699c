"""Thin Ray actor shells over the engines (one class per role); no logic of their own. The
controller reaches them only through its typed group facades (cluster/facades.py)."""

from rlhf_megatron.workers.async_rollout_worker import AsyncRolloutWorker
from rlhf_megatron.workers.megatron_worker import EngineSpec, MegatronWorker
from rlhf_megatron.workers.rollout_worker import RolloutWorker

__all__ = ["AsyncRolloutWorker", "EngineSpec", "MegatronWorker", "RolloutWorker"]
