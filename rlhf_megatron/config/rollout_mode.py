"""How far the rollout of trainer.rollout_mode one_step_off / async runs ahead of the trainer,
and the buffer that bounds it: the stream (controller/stream_source.py) and the workers' build
(cluster/groups.py) both read it."""

from __future__ import annotations

from rlhf_megatron.config.schema import TrainConfig


def pipeline_depth(mode: str, max_staleness: int) -> int:
    """Batches submitted ahead of the one being trained (trainer.rollout_mode one_step_off or
    async)."""
    return 1 if mode == "one_step_off" else max_staleness


def buffer_capacity(cfg: TrainConfig) -> int:
    """Groups one engine may hold in flight plus buffered: the batch being taken and the batches
    ahead, plus replacements for dropped groups (a bound, not a target)."""
    depth = pipeline_depth(cfg.trainer.rollout_mode, cfg.trainer.max_staleness)
    return (depth + 2) * cfg.data.prompts_per_step
