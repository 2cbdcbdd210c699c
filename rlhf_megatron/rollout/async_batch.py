"""Completed rollout groups -> the trainer's TokenBatch, and the staleness bookkeeping.

A group's staleness at training time is `trainer_version - oldest_version`: how many weight
versions the actor moved since the oldest of its tokens was sampled (the actor at step s trains
with version s - 1 and becomes version s).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlhf_megatron.data.batch import TokenBatch
from rlhf_megatron.data.sampling import sampling_fields
from rlhf_megatron.rollout.async_engine import RolloutGroup
from rlhf_megatron.rollout.vllm_engine import RolloutResult

TOKEN_VERSIONS = "token_versions"
"""Batch field (bs, S) int64: the weight version that sampled each response token (-1 elsewhere)."""


def groups_to_batch(groups: Sequence[RolloutGroup]) -> TokenBatch:
    """Rows prompt-major (group i's samples are rows i*n .. i*n+n-1), right-padded.

    A multi-turn episode's record holds its whole token stream (the group's prompt is empty),
    and its loss_mask marks the generated tokens.
    fields: rollout_logprobs (bs, S) aligned with input_ids (0 outside the response),
    prompt_index (bs,) = the group's position in `groups`, token_versions (bs, S), and the
    rows' sampling settings temperature / top_p / top_k (bs,) (groups that carry them).
    """
    rows = [(g.prompt, s, i) for i, g in enumerate(groups) for s in g.samples]
    width = max(len(p) + len(s.tokens) for p, s, _ in rows)
    bs = len(rows)
    ids = torch.zeros(bs, width, dtype=torch.long)
    attn = torch.zeros(bs, width, dtype=torch.long)
    loss = torch.zeros(bs, width, dtype=torch.long)
    lps = torch.zeros(bs, width, dtype=torch.float32)
    versions = torch.full((bs, width), -1, dtype=torch.long)
    for row, (prompt, sample, _) in enumerate(rows):
        p, r = len(prompt), len(sample.tokens)
        ids[row, : p + r] = torch.tensor(prompt + sample.tokens, dtype=torch.long)
        attn[row, : p + r] = 1
        loss[row, p : p + r] = 1 if sample.loss_mask is None else torch.tensor(
            sample.loss_mask, dtype=torch.long)
        if r:
            lps[row, p : p + r] = torch.tensor(sample.logprobs, dtype=torch.float32)
            versions[row, p : p + r] = torch.tensor(sample.versions, dtype=torch.long)
    index = torch.tensor([i for _, _, i in rows], dtype=torch.long)
    batch = TokenBatch(ids, attn, loss, {"rollout_logprobs": lps, "prompt_index": index,
                                         TOKEN_VERSIONS: versions})
    return batch.with_fields(**groups_sampling_fields(groups)) if any(
        g.sampling for g in groups) else batch


def episode_scores(groups: Sequence[RolloutGroup], width: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Episode groups (rollout/async_episodes.py): the (bs,) episode rewards, the (bs, width)
    per-turn rewards at each turn's last generated token and the (bs,) bool ``episode_scored``
    (False where the reward is left to the configured one: 0 here), rows as groups_to_batch
    lays them."""
    samples = [(len(g.prompt), s) for g in groups for s in g.samples]
    turn = torch.zeros(len(samples), width, dtype=torch.float32)
    for row, (p, sample) in enumerate(samples):
        for pos, reward in sample.turn_rewards:
            turn[row, p + pos] += reward
    scores = torch.tensor([float(s.reward or 0.0) for _, s in samples], dtype=torch.float32)
    scored = torch.tensor([s.reward is not None for _, s in samples], dtype=torch.bool)
    return scores, turn, scored


def group_metrics(groups: Sequence[RolloutGroup]) -> dict[str, float]:
    """The groups' own metrics (episode/*), averaged weighted by their sample counts."""
    weighted = [(len(g.samples), g.metrics) for g in groups if g.metrics]
    total = sum(n for n, _ in weighted)
    if not total:
        return {}
    return {k: sum(n * m[k] for n, m in weighted) / total for k in weighted[0][1]}


def groups_sampling_fields(groups: Sequence[RolloutGroup]) -> dict[str, torch.Tensor]:
    """Per-row temperature / top_p / top_k of the groups' samples (data/sampling.py)."""
    if any(g.sampling is None for g in groups):
        raise ValueError("rollout groups without their sampling settings cannot be trained on")
    per_group = [sampling_fields(len(g.samples), g.sampling) for g in groups]
    return {name: torch.cat([f[name] for f in per_group]) for name in per_group[0]}


def groups_to_result(groups: Sequence[RolloutGroup], weight_version: int,
                     first_prompt: int = 0) -> RolloutResult:
    """The synchronous engine's RolloutResult for groups generated at one version (prompt_index
    counted from `first_prompt`)."""
    batch = groups_to_batch(groups)
    finish = [s.finish_reason or "length" for g in groups for s in g.samples]
    fields = {k: v for k, v in batch.fields.items() if k != TOKEN_VERSIONS}
    fields["prompt_index"] = fields["prompt_index"] + first_prompt
    return RolloutResult(TokenBatch(batch.input_ids, batch.attention_mask, batch.loss_mask,
                                    fields), finish, weight_version)


@dataclass
class StalenessSplit:
    """Groups kept for training, groups dropped for being too stale, and the metrics."""

    kept: list[RolloutGroup]
    dropped: list[RolloutGroup]
    metrics: dict[str, float]


def split_by_staleness(groups: Sequence[RolloutGroup], trainer_version: int,
                       max_staleness: int) -> StalenessSplit:
    """Keep groups whose oldest token is at most `max_staleness` versions behind the trainer.

    metrics: async/staleness_<k> (fraction of the taken groups k versions behind, k = 0..max
    seen), async/staleness_mean, async/dropped_groups, async/partial_frac (groups whose samples
    span more than one version: they crossed a refit)."""
    lags = [trainer_version - g.oldest_version for g in groups]
    kept = [g for g, lag in zip(groups, lags) if lag <= max_staleness]
    dropped = [g for g, lag in zip(groups, lags) if lag > max_staleness]
    metrics: dict[str, float] = {
        "async/dropped_groups": float(len(dropped)),
        "async/staleness_mean": sum(lags) / max(len(lags), 1),
        "async/partial_frac": sum(g.versions_spanned > 1 for g in groups) / max(len(groups), 1),
    }
    for lag in range(0, max(lags, default=0) + 1):
        metrics[f"async/staleness_{lag}"] = sum(x == lag for x in lags) / max(len(lags), 1)
    return StalenessSplit(kept, dropped, metrics)


def logprob_diff_by_lag(batch: TokenBatch, trainer_logprobs: torch.Tensor,
                        trainer_version: int) -> dict[str, float]:
    """`rollout/logprob_diff_lag<k>`: mean |behaviour - trainer| log-prob over the response
    tokens sampled k versions behind the trainer (`trainer_logprobs` (bs, S): the actor's, at
    `trainer_version`). Empty for batches without per-token versions (sync mode)."""
    versions = batch.fields.get(TOKEN_VERSIONS)
    if versions is None:
        return {}
    diff = (batch.rollout_logprobs - trainer_logprobs).abs()
    mask = batch.loss_mask.bool()
    lag = trainer_version - versions
    out = {}
    for k in sorted(set(lag[mask].tolist())):
        sel = mask & (lag == k)
        out[f"rollout/logprob_diff_lag{k}"] = float(diff[sel].mean())
    return out
