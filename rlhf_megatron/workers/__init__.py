"""Thin Ray actor shells over the engines (one class per role); no logic of their own."""

from rlhf_megatron.workers.megatron_worker import EngineSpec, MegatronWorker
from rlhf_megatron.workers.rollout_client import FanoutTransport, RayRolloutFanout
from rlhf_megatron.workers.rollout_worker import RolloutWorker

__all__ = ["EngineSpec", "MegatronWorker", "FanoutTransport", "RayRolloutFanout", "RolloutWorker"]
