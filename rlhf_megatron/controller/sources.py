"""Where a step's batch comes from: the rollout sources of the one step loop (loop.py).

A source hands the loop one StepRollout per step: the batch as generated (token ids, masks,
behaviour log-probs, per-row sampling settings, and in the async modes per-token versions),
its (bs,) sequence rewards as a Future, and the generation metrics. The loop never asks how.

    PromptSource        single-turn prompts: generate on the engines, then score
    EpisodeSource       multi-turn episodes with an environment (rollout/episodes.py); each
                        episode's reward comes back with it
    DynamicSampling     DAPO's filter over either of them: rounds until the batch is full
                        (dynamic_sampling.py)
    StreamSource        trainer.rollout_mode one_step_off / async: groups from the engines'
                        buffers, stale ones dropped (stream_source.py)
    OfflineSource       SFT / DPO / KTO: dataset batches, no generation (offline_source.py)

`loop.build_source(run)` makes the choice once, when the run starts. A source's hooks around the
update: `before_refit` (one_step_off lets the next batch finish on the old weights) and
`after_step` (the async stream marks the step's prompts trained).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from rlhf_megatron.controller import phases
from rlhf_megatron.controller.phases import Run
from rlhf_megatron.data.batch import TokenBatch
from rlhf_megatron.records.metrics import PhaseTimer


@dataclass
class StepRollout:
    """One step's batch, its (bs,) sequence rewards (a Future) and the generation metrics."""

    batch: TokenBatch
    scores: Future | None
    """None for an offline batch (no rewards)."""
    metrics: dict[str, float]
    keys: list[int] = field(default_factory=list)
    """StreamSource: the prompt keys of the batch's groups (async_stream.PromptStream)..."""
    dropped: list[int] = field(default_factory=list)
    """... and of the groups dropped as too stale while it was collected."""
    spec: Any = None
    """OfflineSource: the batch's engines.offline_update.OfflineStepSpec."""


class SyncSource:
    """A source that generates a step's batch when asked, with the step's seed (nothing runs
    ahead, so the hooks around the update have nothing to do)."""

    def __init__(self, run: Run) -> None:
        self.run = run

    def start(self) -> None:
        """Nothing to submit ahead of the first step."""

    def next_batch(self, step: int) -> StepRollout:
        return self.produce(phases.step_seed(self.run.cfg.trainer.seed, step))

    def produce(self, seed: int) -> StepRollout:
        """A batch on the loader's next prompts, sampled with `seed`."""
        raise NotImplementedError

    def before_refit(self, timer: PhaseTimer) -> None:
        """Nothing is generating during the update."""

    def after_step(self, step: int, rollout: StepRollout) -> None:
        """Nothing to record."""


class PromptSource(SyncSource):
    """Single-turn prompts: the engines generate rollout.sampling.n responses per prompt; the
    rule or custom rewards score them on the reward manager's threads while the loop goes on."""

    def produce(self, seed: int) -> StepRollout:
        run = self.run
        rows, prompts = phases.next_prompts(run)
        metrics = dict(phases.before_generate(run))
        batch, generated = phases.generate(run, prompts, run.cfg.rollout.sampling, seed)
        metrics.update(phases.after_generate(run))
        metrics.update(generated)
        return StepRollout(batch, phases.score_async(run, batch, rows), metrics)


class EpisodeSource(SyncSource):
    """Multi-turn episodes (environment section): each episode's reward is its turns' sum, and
    each turn's reward stays on its last token (batch field episode_rewards)."""

    def produce(self, seed: int) -> StepRollout:
        run = self.run
        rows, _ = phases.next_prompts(run)
        metrics = dict(phases.before_generate(run))
        batch, scores, generated = phases.generate_episodes(run, rows, seed)
        metrics.update(phases.after_generate(run))
        metrics.update(generated)
        return StepRollout(batch, phases.score_episodes(run, batch, rows, scores), metrics)
