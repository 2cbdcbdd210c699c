"""DAPO dynamic sampling (Yu et al. 2025, arXiv:2503.14476; verl ``recipe/dapo``): generation
rounds until the step's batch holds ``data.prompts_per_step`` informative groups.

    batch, scores, metrics = generate_full_batch(run, seed)     # replaces generate + score

Each round is the plain path on ``data.prompts_per_step`` new prompts (before_generate,
generate, after_generate, score); the groups whose scores are all equal
(``algorithms.dapo.informative_groups``) are set aside. Rounds stop as soon as enough
informative groups are in hand, or after ``algorithm.dynamic_sampling.max_rounds``; then the
first ``prompts_per_step`` informative groups, in generation order, form the batch. If the rounds
ran out, dropped groups top it up (their group advantage is 0), so the batch size never changes.
Round r samples with the step seed plus r * 1_000_003 (round 0 is exactly the plain path), so a
resumed run repeats the rounds of the uninterrupted one.

Metrics (``dynamic_sampling/``): ``rounds``, ``drop_rate`` (dropped / generated groups over all
rounds), ``kept_groups`` (informative groups in the batch), ``filled_groups`` (dropped groups
used to top it up), ``reward_mean_generated`` (mean score over everything generated).
"""

from __future__ import annotations

import torch

from rlhf_megatron.algorithms.dapo import informative_groups
from rlhf_megatron.controller import phases
from rlhf_megatron.controller.phases import Run
from rlhf_megatron.data.batch import TokenBatch

ROUND_SEED_STRIDE = 1_000_003


class _Scores:
    """The (bs,) scores as the Future-like value the loop expects (``.result()``)."""

    def __init__(self, value: torch.Tensor) -> None:
        self._value = value

    def result(self) -> torch.Tensor:
        return self._value


def _one_round(run: Run, seed: int, first_group: int) -> tuple[TokenBatch, torch.Tensor, dict]:
    """The plain generate + score path on the loader's next prompts; group ids made unique
    across rounds by offsetting prompt_index with `first_group`."""
    rows, prompts = phases.next_prompts(run)
    metrics = dict(phases.before_generate(run))
    batch, generated = phases.generate(run, prompts, run.cfg.rollout.sampling, seed)
    metrics.update(phases.after_generate(run))
    metrics.update(generated)
    scores = phases.score_async(run, batch, rows).result()
    batch = batch.with_fields(prompt_index=batch.prompt_index + first_group)
    return batch, scores, metrics


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


def generate_full_batch(run: Run, seed: int) -> tuple[TokenBatch, _Scores, dict[str, float]]:
    """Rounds of generation until the batch is full (module docstring). Returns the batch
    (prompt_index renumbered 0..groups-1), its scores and the metrics of the last round plus
    the dynamic-sampling ones; batch/* and response/length_* describe the final batch."""
    target = run.cfg.data.prompts_per_step
    batches, all_scores, informative = [], [], []
    metrics: dict[str, float] = {}
    groups = kept = rounds = 0
    for rounds in range(1, run.cfg.algorithm.dynamic_sampling.max_rounds + 1):
        round_seed = (seed + (rounds - 1) * ROUND_SEED_STRIDE) % (2**31 - 1)
        batch, scores, metrics = _one_round(run, round_seed, groups)
        good = informative_groups(scores, batch.prompt_index)
        groups += len(torch.unique(batch.prompt_index))
        kept += len(torch.unique(batch.prompt_index[good]))
        batches.append(batch)
        all_scores.append(scores)
        informative.append(good)
        if kept >= target:
            break
    batch, scores = TokenBatch.concat(batches), torch.cat(all_scores)
    rows, kept_groups, filled = select_groups(batch.prompt_index, torch.cat(informative), target)
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
    return out, _Scores(scores[rows]), metrics
