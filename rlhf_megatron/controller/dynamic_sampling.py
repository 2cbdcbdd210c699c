"""DAPO dynamic sampling (Yu et al. 2025, arXiv:2503.14476; verl ``recipe/dapo``): generation
rounds until the step's batch holds ``data.prompts_per_step`` informative groups. A filter over a
synchronous source (sources.py: single-turn prompts or multi-turn episodes), itself a source.

Each round is the inner source's batch on ``data.prompts_per_step`` new prompts, scored; the
groups whose scores are all equal (``algorithms.dapo.informative_groups``) are set aside. Rounds
stop as soon as enough informative groups are in hand, or after
``algorithm.dynamic_sampling.max_rounds``; then the first ``prompts_per_step`` informative groups,
in generation order, form the batch. If the rounds ran out, dropped groups top it up (their group
advantage is 0), so the batch size never changes. Round r samples with the step seed plus
r * 1_000_003 (round 0 is exactly the inner source's batch), so a resumed run repeats the rounds of
the uninterrupted one.

Metrics (``dynamic_sampling/``): ``rounds``, ``drop_rate`` (dropped / generated groups over all
rounds), ``kept_groups`` (informative groups in the batch), ``filled_groups`` (dropped groups
used to top it up), ``reward_mean_generated`` (mean score over everything generated).
"""

from __future__ import annotations

import torch

from rlhf_megatron.algorithms.dapo import informative_groups
from rlhf_megatron.controller import phases
from rlhf_megatron.controller.sources import StepRollout, SyncSource
from rlhf_megatron.data.batch import TokenBatch

ROUND_SEED_STRIDE = 1_000_003


def select_groups(
    group_ids: torch.Tensor, informative: torch.Tensor, target: int
) -> tuple[torch.Tensor, int, int]:
    """Row indices of the first `target` informative groups in generation order, topped up with
    the first dropped groups when there are too few. Returns (rows, kept, filled)."""
    order = list(dict.fromkeys(group_ids.tolist()))  # groups in generation order
    kept_ids: list[int] = []
    dropped_ids: list[int] = []
    good = {int(g) for g in group_ids[informative].tolist()}
    for gid in order:
        (kept_ids if gid in good else dropped_ids).append(gid)
    chosen = kept_ids[:target]
    filled = dropped_ids[: target - len(chosen)]
    wanted = set(chosen + filled)
    rows = torch.tensor([i for i, g in enumerate(group_ids.tolist()) if g in wanted],
                        dtype=torch.long)
    return rows, len(chosen), len(filled)


class DynamicSampling(SyncSource):
    """DAPO's rounds over `inner` (module docstring)."""

    def __init__(self, inner: SyncSource) -> None:
        super().__init__(inner.run)
        self.inner = inner

    def produce(self, seed: int) -> StepRollout:
        """The batch (prompt_index renumbered 0..groups-1), its scores and the metrics of the
        last round plus the dynamic-sampling ones; batch/* and response/length_* describe the
        final batch."""
        run = self.run
        target = run.cfg.data.prompts_per_step
        batches, all_scores, informative = [], [], []
        metrics: dict[str, float] = {}
        groups = kept = rounds = 0
        for rounds in range(1, run.cfg.algorithm.dynamic_sampling.max_rounds + 1):
            rollout = self.inner.produce((seed + (rounds - 1) * ROUND_SEED_STRIDE) % (2**31 - 1))
            # group ids made unique across rounds
            batch = rollout.batch.with_fields(prompt_index=rollout.batch.prompt_index + groups)
            scores, metrics = rollout.scores.result(), rollout.metrics
            good = informative_groups(scores, batch.prompt_index)
            groups += len(torch.unique(batch.prompt_index))
            kept += len(torch.unique(batch.prompt_index[good]))
            batches.append(batch)
            all_scores.append(scores)
            informative.append(good)
            if kept >= target:
                break
        batch, scores = TokenBatch.concat(batches), torch.cat(all_scores)
        rows, kept_groups, filled = select_groups(batch.prompt_index, torch.cat(informative),
                                                  target)
        out = batch.select(rows)
        _, renumbered = torch.unique(out.prompt_index, return_inverse=True)
        out = out.with_fields(prompt_index=renumbered)
        lengths = out.loss_mask.sum(-1).float()
        metrics.update({
            "batch/tokens": float(out.attention_mask.sum()),
            "batch/sequences": float(len(out)),
            "response/length_mean": float(lengths.mean()),
            "response/length_max": float(lengths.max()),
            "dynamic_sampling/rounds": float(rounds),
            "dynamic_sampling/drop_rate": (groups - kept) / max(groups, 1),
            "dynamic_sampling/kept_groups": float(kept_groups),
            "dynamic_sampling/filled_groups": float(filled),
            "dynamic_sampling/reward_mean_generated": float(scores.float().mean()),
        })
        return StepRollout(out, phases.done(scores[rows]), metrics)
