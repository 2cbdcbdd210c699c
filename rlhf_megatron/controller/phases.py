"""The phases of one PPO/GRPO step, each a named function of the run's state.

Each phase talks to the workers through the typed group facades (cluster/facades.py:
`run.groups.actor.update_policy(batch, settings)`, ...) and reads/adds named batch fields
(`batch.old_logprobs`, data/batch.py BATCH_FIELDS).

    rows, prompts = next_prompts(run)
    batch, m = generate(run, prompts, run.cfg.rollout.sampling, seed)    # vLLM engines
    scores    = score_async(run, batch, rows)                             # off the critical path
    batch, m = compute_logprobs_and_values(run, batch)                   # actor, reference, critic
    batch, m = compute_advantages_phase(run, batch, scores.result())     # rewards, KL, advantages
    m = update_critic(run, batch);  m = update_actor(run, batch)
    m = refit(run, version)                                              # actor -> vLLM weights
The loop itself is in controller/loop.py, the batch's sources in sources.py.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhf_megatron.algorithms import (
    AdvantageInputs,
    KLController,
    apply_kl_penalty,
    compute_advantages,
    compute_kl,
    masked_mean,
    shape_overlong,
)
from rlhf_megatron.cluster.facades import ActorLogProbs
from rlhf_megatron.cluster.groups import RunGroups
from rlhf_megatron.config import TrainConfig
from rlhf_megatron.data.batch import TokenBatch
from rlhf_megatron.data.prompts import PromptLoader, PromptRow
from rlhf_megatron.engines.actor import PolicyUpdateSettings
from rlhf_megatron.rewards import RewardManager
from rlhf_megatron.rollout import SamplingSettings
from rlhf_megatron.rollout.async_batch import logprob_diff_by_lag
from rlhf_megatron.rollout.drift import LogprobDriftAlarm, default_max_logprob_diff
from rlhf_megatron.rollout.metrics import rollout_logprob_diff


@dataclass
class Run:
    """What the phases share: config, worker groups, data, rewards and controller state."""

    cfg: TrainConfig
    groups: RunGroups
    tokenizer: Any
    rewards: RewardManager
    kl_controller: KLController
    """The only owner of the KL coefficient, in both kl_modes (built from algorithm.kl_coef)."""
    loader: PromptLoader
    """Yields (PromptRow, prompt token ids) pairs."""
    val_items: list[tuple[PromptRow, list[int]]]
    weight_version: int = 0
    stream: Any = None
    """rollout_mode one_step_off/async: the keyed prompt stream (controller/async_stream.py),
    saved in checkpoints; None in sync mode."""
    drift_alarm: LogprobDriftAlarm | None = None
    """Built by the first check_logprob_drift (rollout.max_logprob_diff, on_logprob_drift)."""
    offline: Any = None
    """SFT/DPO/KTO: the dataset and reference log-probs (offline_source.OfflineData); None in
    RL, where `loader` yields prompts."""


def done(value: torch.Tensor) -> Future:
    """`value` as a finished Future (scores computed on the spot, like a reward model's)."""
    future: Future = Future()
    future.set_result(value)
    return future


def next_prompts(run: Run) -> tuple[list[PromptRow], list[list[int]]]:
    items = run.loader.next_batch()
    return [row for row, _ in items], [ids for _, ids in items]


def step_seed(base: int, step: int) -> int:
    """Sampling seed of a step: a function of (run seed, step) only, so a resumed run samples
    exactly what the uninterrupted one did."""
    return (base * 1_000_003 + step * 7919) % (2**31 - 1)


def generate(run: Run, prompts: Sequence[list[int]], sampling: SamplingSettings,
             seed: int) -> tuple[TokenBatch, dict[str, float]]:
    """Responses to `prompts` from the rollout engines, in prompt-major order; `prompt_index`
    indexes `prompts`. `seed` is the step's: each prompt's own seed is the engine's rule."""
    result = run.groups.rollout.generate(prompts, dataclasses.replace(sampling, seed=seed))
    batch, finish = result.batch, result.finish_reasons
    lengths = batch.loss_mask.sum(-1).float()
    tokens = float(lengths.sum())
    return batch, {
        "rollout/weight_version": float(result.weight_version),
        "rollout/tokens_per_s": tokens / max(result.seconds, 1e-9),
        "batch/tokens": float(batch.attention_mask.sum()),
        "batch/sequences": float(len(batch)),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/clip_ratio": sum(f == "length" for f in finish) / max(len(finish), 1),
    }


def generate_episodes(run: Run, rows: Sequence[PromptRow],
                      seed: int) -> tuple[TokenBatch, torch.Tensor, dict[str, float]]:
    """Multi-turn episodes (environment: section, rollout/episodes.py) for the step's prompt rows:
    the batch (loss_mask 1 on generated tokens only, per-turn rewards in field
    "episode_rewards"), the (bs,) episode rewards and the episode/* metrics."""
    sampling = dataclasses.replace(run.cfg.rollout.sampling, seed=seed)
    samples = [{"prompt": r.prompt, "answer": r.answer, "data_source": r.data_source,
                "extra_info": r.extra_info}
               for r in rows]
    start = time.perf_counter()
    batch, metrics = run.groups.rollout.run_episodes(samples, run.cfg.environment, sampling)
    scores = batch.fields.pop("scores")
    batch = batch.with_fields(episode_rewards=batch.fields.pop("token_level_rewards"))
    metrics["rollout/tokens_per_s"] = float(batch.loss_mask.sum()) / max(
        time.perf_counter() - start, 1e-9)
    metrics["batch/sequences"] = float(len(batch))
    return batch, scores, metrics


def score_episodes(run: Run, batch: TokenBatch, rows: Sequence[PromptRow],
                   scores: torch.Tensor) -> Future:
    """An episode batch's (bs,) rewards as a Future: ``scores`` as its drivers gave them, and,
    for the rows whose agent left the reward to the configured one (batch field
    ``episode_scored`` False, rollout/agent_episodes.py), the ``reward:`` section's score of
    the episode's generated text (score_async on those rows; ``rows`` indexed by
    prompt_index). compute_advantages_phase puts those at the episode's last generated token."""
    scored = batch.fields.get("episode_scored")
    if scored is None or bool(scored.all()):
        return done(scores)
    unscored = torch.nonzero(~scored).flatten()
    pending = score_async(run, batch.select(unscored), rows)
    result: Future = Future()

    def fill(f: Future) -> None:
        if f.exception() is not None:
            result.set_exception(f.exception())
            return
        full = scores.clone().float()
        full[unscored] = f.result().float()
        result.set_result(full)

    pending.add_done_callback(fill)
    return result


def decode_responses(run: Run, batch: TokenBatch) -> list[str]:
    texts = []
    for ids, mask in zip(batch.input_ids, batch.loss_mask, strict=True):
        texts.append(run.tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=True))
    return texts


def score_async(run: Run, batch: TokenBatch, rows: Sequence[PromptRow]) -> Any:
    """(bs,) sequence rewards, as a Future: rule/custom rewards run on the reward manager's
    thread pool while the driver waits on the engines; a reward model scores on its group."""
    if run.groups.reward_model is not None:
        return done(run.groups.reward_model.score(batch))
    index = batch.prompt_index.tolist()
    answers = [rows[i].answer for i in index]
    sources = [rows[i].data_source for i in index]
    future: Future = run.rewards.compute_async(decode_responses(run, batch), answers, sources,
                                               extra_infos=[rows[i].extra_info for i in index])
    return future


def on_policy_shortcut(cfg: TrainConfig) -> bool:
    """Whether the actor's "old" log-prob forward is skipped: the batch gets exactly one
    optimizer step (algorithm.mini_batches == 1), so the old policy is the current one, and
    nothing needs the old log-probs before the update (no KL-as-reward penalty, no rollout
    correction or TIS weight, which compare them with the behaviour policy's). The update then
    uses its own detached log-probs as the old ones (engines/actor.py)."""
    alg = cfg.algorithm
    correction = getattr(alg, "rollout_correction", None)
    return (alg.mini_batches == 1 and alg.kl_mode != "reward"
            and not cfg.actor.engine.routing_replay  # MoE replay records in that forward
            and not getattr(correction, "enabled", False)
            and alg.policy_loss_config.tis_cap is None)


def compute_logprobs_and_values(run: Run, batch: TokenBatch) -> tuple[TokenBatch, dict]:
    """Old log-probs (+ entropy) from the actor, reference log-probs, critic values: all at once.
    Under the on-policy shortcut only the reference's (and the critic's) forward runs."""
    actor, critic = run.groups.actor, run.groups.critic
    shortcut = on_policy_shortcut(run.cfg)
    if shortcut:
        ref = actor.submit_ref_logprobs(batch) if run.cfg.uses_reference else None
    else:
        old = actor.submit_logprobs(batch)
    values = critic.submit_values(batch) if critic is not None else None
    mask = batch.loss_mask.float()
    fields: dict[str, torch.Tensor] = {}
    metrics: dict[str, float] = {}
    if shortcut:
        if ref is not None:
            fields["ref_logprobs"] = ref.result()
    else:
        out = old.result()
        fields["old_logprobs"] = out.logprobs
        if out.ref_logprobs is not None:
            fields["ref_logprobs"] = out.ref_logprobs
        if out.routed_experts is not None:  # MoE routing replay (models/moe_replay.py)
            fields["routed_experts"] = out.routed_experts
        metrics.update(policy_forward_metrics(run, batch.with_fields(**fields), out))
    if values is not None:
        fields["values"] = values.result()
        metrics["critic/values_mean"] = float(masked_mean(fields["values"], mask))
    return batch.with_fields(**fields), metrics


def policy_forward_metrics(run: Run, batch: TokenBatch, out: ActorLogProbs) -> dict[str, float]:
    """What the actor's forward on the rollout's weights shows: its entropy, the KL to the
    reference, and how far vLLM's log-probs are from it (a missed refit or a stale cache shows
    in rollout/logprob_diff_max). From the old-log-prob forward, or under the on-policy shortcut
    from the update's own forward (the same weights, before the step)."""
    mask = batch.loss_mask.float()
    metrics = {"actor/entropy_rollout": float(masked_mean(out.entropy, mask))}
    if batch.ref_logprobs is not None:
        kl = compute_kl(out.logprobs, batch.ref_logprobs, mask, kind=run.cfg.algorithm.kl_kind)
        metrics["kl"] = float(masked_mean(kl, mask))
    metrics.update(rollout_logprob_diff(batch.rollout_logprobs, out.logprobs, mask))
    metrics["rollout/logprob_diff"] = metrics["rollout/logprob_diff_mean"]
    # Async modes: the same difference per version lag (batch field token_versions).
    metrics.update(logprob_diff_by_lag(batch, out.logprobs, run.weight_version))
    return metrics


def check_logprob_drift(run: Run, step: int, metrics: dict[str, float],
                        trained_version: int) -> None:
    """The drift alarm (rollout/drift.py) on step `step`'s rollout-vs-trainer difference, which
    judges the weights the last refit sent; the loop calls it once a step, after logging the
    step's metrics. `trained_version` is the weight version the trainer computed the step's
    log-probs with. Async modes judge only the tokens sampled by those weights (lag 0); a sync
    step's tokens all come from rollout/weight_version."""
    rollout, sync = run.cfg.rollout, run.cfg.trainer.rollout_mode == "sync"
    if run.drift_alarm is None:
        threshold = rollout.max_logprob_diff or default_max_logprob_diff(
            run.cfg.actor.engine.dtype, rollout.engine.dtype)
        run.drift_alarm = LogprobDriftAlarm(threshold, rollout.on_logprob_drift)
    version = int(metrics.get("rollout/weight_version", trained_version)) if sync \
        else trained_version
    run.drift_alarm.check(step, version, metrics, per_token_versions=not sync)


def compute_advantages_phase(run: Run, batch: TokenBatch,
                             scores: torch.Tensor) -> tuple[TokenBatch, dict]:
    """Sequence rewards -> token-level rewards (last response token), the KL penalty when KL is
    a reward, then the configured advantage estimator."""
    cfg = run.cfg.algorithm
    mask = batch.loss_mask.float()
    last = batch.lengths() - 1
    token_scores = torch.zeros_like(mask)
    shaped, shaping = shape_overlong(scores, batch.loss_mask.sum(-1), cfg.overlong_shaping,
                                     run.cfg.rollout.sampling.max_tokens)  # DAPO; off: as is
    token_scores[torch.arange(len(batch)), last] = shaped.float()
    if batch.fields.get("episode_rewards") is not None:  # multi-turn: each turn's own reward
        token_scores = batch.fields["episode_rewards"].float().clone()
        left = ~batch.fields.get("episode_scored", torch.ones(len(batch), dtype=torch.bool))
        if bool(left.any()):  # the configured reward, at the last generated token
            width = torch.arange(mask.shape[1])
            last_generated = (width * batch.loss_mask.long()).max(-1).values
            token_scores[left, last_generated[left]] = scores[left].float()
    metrics = {"reward/mean": float(scores.mean()), "reward/std": float(scores.std()) if
               len(scores) > 1 else 0.0, "reward/max": float(scores.max()),
               "reward/min": float(scores.min()), **shaping}
    rewards = token_scores
    if cfg.kl_mode == "reward":
        penalty = apply_kl_penalty(token_scores, batch.old_logprobs, batch.ref_logprobs, mask,
                                   run.kl_controller.value, kind=cfg.kl_kind)
        rewards = penalty.token_level_rewards
        metrics["kl/coef"] = run.kl_controller.value
        run.kl_controller.update(penalty.current_kl, len(batch))
    advantages, returns = compute_advantages(
        run.cfg.estimator,
        AdvantageInputs(token_level_rewards=rewards, response_mask=mask,
                        values=batch.values, group_ids=batch.prompt_index),
        cfg.advantage)
    metrics["advantages/mean"] = float(masked_mean(advantages, mask))
    metrics["returns/mean"] = float(masked_mean(returns, mask))
    return batch.with_fields(advantages=advantages, returns=returns,
                             token_level_rewards=rewards), metrics


def score_and_advantages(run: Run, step: int, batch: TokenBatch, scores: Any, timer: Any,
                         metrics: dict[str, float]) -> TokenBatch:
    """The part of a step every rollout mode shares: old/reference log-probs and values, the
    (bs,) sequence rewards from `scores` (a Future), then the advantages; `timer` (a
    PhaseTimer) times each phase and `metrics` receives theirs. Dumps the batch on the
    trainer.dump_batch_steps."""
    with timer.phase("logprobs"):
        batch, m = compute_logprobs_and_values(run, batch)
        metrics.update(m)
    with timer.phase("reward"):
        sequence_rewards = scores.result()
    metrics.update(run.rewards.take_metrics())  # a custom reward's extra keys, reward/<key>
    with timer.phase("advantages"):
        batch, m = compute_advantages_phase(run, batch, sequence_rewards)
        metrics.update(m)
    if step in run.cfg.trainer.dump_batch_steps:
        dump_batch(run, step, batch, sequence_rewards)
    return batch


def dump_batch(run: Run, step: int, batch: TokenBatch,
               scores: torch.Tensor | None = None) -> Path:
    """trainer.dump_batch_steps: save the batch as the update saw it (token ids, masks and its
    fields) and the (bs,) sequence scores of an RL step to <run_dir>/batches/step_<N>.pt."""
    path = Path(run.cfg.trainer.run_dir) / "batches" / f"step_{step:08d}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
              "loss_mask": batch.loss_mask, "fields": dict(batch.fields)}
    if scores is not None:
        record["scores"] = scores.float()
    torch.save(record, path)
    return path


def _mini_batches(run: Run, batch: TokenBatch) -> list[TokenBatch]:
    return batch.chunk(run.cfg.algorithm.mini_batches)


def _average(parts: list[dict[str, float]], prefix: str) -> dict[str, float]:
    keys = parts[0].keys()
    return {f"{prefix}{k}": sum(p[k] for p in parts) / len(parts) for k in keys}


def update_critic(run: Run, batch: TokenBatch) -> dict[str, float]:
    cfg = run.cfg.algorithm
    parts = [run.groups.critic.update(mini, value_clip=cfg.value_clip,
                                      aggregation=cfg.aggregation)
             for mini in _mini_batches(run, batch)]
    return _average(parts, "critic/")


def policy_settings(cfg: TrainConfig, kl: KLController) -> PolicyUpdateSettings:
    """The actor update's settings; the KL-loss coefficient is the KL controller's (its only
    owner), used when algorithm.kl_mode == 'loss'."""
    alg = cfg.algorithm
    return PolicyUpdateSettings(
        loss=alg.policy_loss, loss_config=alg.policy_loss_config, aggregation=alg.aggregation,
        entropy_coeff=alg.entropy_coeff,
        kl_loss_coeff=kl.value if alg.kl_mode == "loss" else 0.0, kl_loss_kind=alg.kl_kind,
        rollout_correction=alg.rollout_correction)


def update_actor(run: Run, batch: TokenBatch) -> dict[str, float]:
    settings = policy_settings(run.cfg, run.kl_controller)
    updates = [run.groups.actor.update_policy(mini, settings)
               for mini in _mini_batches(run, batch)]
    metrics = _average([u.metrics for u in updates], "actor/")
    metrics["actor/clipfrac"] = metrics.get("actor/pg_clipfrac", 0.0)
    if updates[0].on_policy is not None:  # the shortcut: one update, its forward's values
        metrics.update(policy_forward_metrics(run, batch, updates[0].on_policy))
    return metrics


def refit(run: Run, version: int) -> dict[str, float]:
    """Send the actor's weights to every rollout engine (after every update); the connection
    (transports, bucket size) was made once when the groups were built."""
    groups = run.groups
    if run.cfg.resources.mode == "colocated":
        # Weights only: the KV cache stays free until the actor is offloaded (before_generate),
        # so refit's peak is the actor's training state plus vLLM's weights.
        groups.rollout.wake_up(["weights"])
    report = groups.actor.refit(version)
    run.weight_version = report.version
    # Every pipeline stage's sender sends its own layers: bytes and buckets add up over ranks.
    return {"refit/seconds": report.seconds, "refit/bytes": float(report.bytes),
            "refit/buckets": float(report.buckets)}


def before_generate(run: Run) -> dict[str, float]:
    """Hybrid layout: free the actor's device memory for vLLM (when configured), then give vLLM
    its KV cache back. Offload metrics are sums over the actor's ranks: `actor/offload_bytes`
    moved out, `actor/offload_freed_bytes` the drop in resident memory (device memory on GPU,
    RSS on CPU)."""
    metrics: dict[str, float] = {}
    if run.cfg.actor.offload_during_rollout:
        moved = run.groups.actor.offload()
        metrics["actor/offload_bytes"] = moved["bytes"]
        metrics["actor/offload_freed_bytes"] = moved["freed"]
    if run.cfg.resources.mode == "colocated":
        run.groups.rollout.wake_up(["kv_cache"])
    return metrics


def after_generate(run: Run) -> dict[str, float]:
    """Hybrid layout: vLLM sleeps (KV cache freed) while the engines train; the actor comes back
    (`actor/onload_restored_bytes`: the rise in resident memory, summed over ranks)."""
    if run.cfg.resources.mode == "colocated":
        run.groups.rollout.sleep()
    if run.cfg.actor.offload_during_rollout:
        return {"actor/onload_restored_bytes": run.groups.actor.onload()}
    return {}


def validate(run: Run, seed: int) -> dict[str, float]:
    """Greedy (rollout.val_sampling) responses to the held-out prompts, scored by the rewards."""
    if not run.val_items:
        return {}
    rows = [row for row, _ in run.val_items]
    prompts = [ids for _, ids in run.val_items]
    before_generate(run)  # vLLM's KV cache is asleep after a refit in the hybrid layout
    batch, gen = generate(run, prompts, run.cfg.rollout.val_sampling, seed)
    after_generate(run)
    scores = score_async(run, batch, rows).result()
    return {"val/reward/mean": float(scores.mean()),
            "val/response/length_mean": gen["response/length_mean"]}
