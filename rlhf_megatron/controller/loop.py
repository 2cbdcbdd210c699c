"""The one step loop, for every rollout mode, source and algorithm. It reads top to bottom:
the source (sources.py) hands over the step's batch, each phase is a function in phases.py.

Steps are numbered from 1. A checkpoint taken after step s holds the engines, the prompt loader,
the KL controller and the weight version; resuming from it continues at step s + 1 and, on CPU,
reproduces the uninterrupted run's metrics exactly (sampling seeds depend on (seed, step) only).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlhf_megatron.controller import phases
from rlhf_megatron.controller.async_stream import PromptStream
from rlhf_megatron.controller.dynamic_sampling import DynamicSampling
from rlhf_megatron.controller.offline_source import REFERENCE_FILE, OfflineSource, offline_step
from rlhf_megatron.controller.phases import Run
from rlhf_megatron.controller.sources import EpisodeSource, PromptSource, StepRollout, SyncSource
from rlhf_megatron.controller.stream_source import StreamSource
from rlhf_megatron.errors import CheckpointError
from rlhf_megatron.records.checkpoint_store import CheckpointStore
from rlhf_megatron.records.metrics import MetricsLogger, PhaseTimer


def build_source(run: Run) -> Any:
    """The run's source of batches (sources.py), chosen once from algorithm.name,
    trainer.rollout_mode, environment and algorithm.dynamic_sampling."""
    cfg = run.cfg
    if cfg.is_offline:
        return OfflineSource(run)
    if cfg.trainer.rollout_mode != "sync":
        return StreamSource(run)
    source: SyncSource = EpisodeSource(run) if cfg.environment.enabled else PromptSource(run)
    return DynamicSampling(source) if cfg.algorithm.dynamic_sampling.enabled else source


def rl_step(run: Run, step: int, rollout: StepRollout,
            timer: PhaseTimer) -> tuple[dict[str, float], bool]:
    """The update of an RL step: log-probs, values, rewards and advantages, the critic's and the
    actor's optimizer steps. Returns the metrics, and whether the actor changed (not during
    algorithm.critic_warmup_steps), so the loop refits."""
    metrics: dict[str, float] = {}
    batch = phases.score_and_advantages(run, step, rollout.batch, rollout.scores, timer,
                                        metrics)
    if run.groups.critic is not None:
        with timer.phase("critic_update"):
            metrics.update(phases.update_critic(run, batch))
    if step <= run.cfg.algorithm.critic_warmup_steps:
        return metrics, False
    with timer.phase("actor_update"):
        metrics.update(phases.update_actor(run, batch))
    return metrics, True


def train_steps(run: Run, store: CheckpointStore, logger: MetricsLogger, start_step: int,
                on_step_end: Callable[[int, Path | None], None] | None = None) -> None:
    """Steps start_step..total_steps. `on_step_end(step, checkpoint saved after it or None)` runs
    after each step but the last (run.py stops there after a signal: a safe point)."""
    cfg, trainer = run.cfg, run.cfg.trainer
    source = build_source(run)
    update = offline_step if cfg.is_offline else rl_step
    timer = PhaseTimer()
    if trainer.val_before_train and start_step == 1:
        logger.log(0, phases.validate(run, phases.step_seed(trainer.seed, 0)))
    source.start()
    progress = _progress_bar(cfg, start_step)
    for step in range(start_step, trainer.total_steps + 1):
        timer.reset()
        with timer.phase("generate"):
            rollout = source.next_batch(step)
        trained_version = run.weight_version
        metrics, changed = update(run, step, rollout, timer)
        metrics = {**rollout.metrics, **metrics}
        if changed:
            source.before_refit(timer)
            with timer.phase("refit"):
                metrics.update(phases.refit(run, version=step))
        source.after_step(step, rollout)
        if trainer.val_every and step % trainer.val_every == 0:
            with timer.phase("validate"):
                metrics.update(phases.validate(run, phases.step_seed(trainer.seed, 0)))
        metrics.update(timer.metrics())
        if run.groups.rollout is not None:
            metrics["weight_version"] = float(run.weight_version)
        logger.log(step, metrics)
        if run.groups.rollout is not None:
            phases.check_logprob_drift(run, step, metrics, trained_version)
        if progress is not None:
            progress.update(1)
            shown = "reward/mean" if "reward/mean" in metrics else "loss"
            progress.set_postfix({shown: f"{metrics[shown]:.3f}"})
        last = step == trainer.total_steps
        saved = None
        if (trainer.save_every and step % trainer.save_every == 0) or last:
            saved = save_checkpoint(run, store, step)
        if on_step_end is not None and not last:
            on_step_end(step, saved)
    if progress is not None:
        progress.close()


def _progress_bar(cfg: Any, start_step: int) -> Any:
    if not cfg.metrics.progress_bar:
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.trainer.total_steps, initial=start_step - 1, desc="train",
                unit="step", dynamic_ncols=True)


def save_checkpoint(run: Run, store: CheckpointStore, step: int) -> Path:
    """Engines write into a temp dir; the store renames it into place once all is written."""
    temp = store.begin(step)
    run.groups.actor.save_checkpoint(str(temp / "actor"), step)
    if run.groups.critic is not None:
        run.groups.critic.save_checkpoint(str(temp / "critic"), step)
    state: dict[str, Any] = {"step": step, "loader": run.loader.state_dict()}
    if run.offline is not None:  # SFT/DPO/KTO: what the step's losses need besides the weights
        state["algorithm"] = run.cfg.algorithm.name
        if run.offline.reference is not None:
            torch.save(run.offline.reference, temp / REFERENCE_FILE)
    else:
        state.update(kl_coef=run.kl_controller.value, weight_version=run.weight_version)
    if run.stream is not None:  # async modes: the prompts not yet trained (async_stream.py)
        state["async_stream"] = run.stream.state_dict()
    return store.commit(step, temp, state)


def restore_checkpoint(run: Run, store: CheckpointStore, path: Path) -> int:
    """Load engines and controller state from `path`, push the restored weights to vLLM, and
    return the next step to run."""
    state = store.load_controller_state(path)
    if run.offline is not None and state.get("algorithm") != run.cfg.algorithm.name:
        raise CheckpointError(f"{path} was written by algorithm {state.get('algorithm')!r}, "
                              f"this run is {run.cfg.algorithm.name!r}")
    run.groups.actor.load_checkpoint(str(path / "actor"))
    if run.groups.critic is not None:
        run.groups.critic.load_checkpoint(str(path / "critic"))
    run.loader.load_state_dict(state["loader"])
    if run.offline is not None:
        if run.cfg.algorithm.name != "sft":
            if not (path / REFERENCE_FILE).is_file():
                raise CheckpointError(f"{path} has no {REFERENCE_FILE} (the reference "
                                      "log-probs)")
            run.offline.reference = torch.load(path / REFERENCE_FILE)
        return int(state["step"]) + 1
    run.kl_controller.value = float(state["kl_coef"])
    if "async_stream" in state:
        run.stream = PromptStream(run.loader)
        run.stream.load_state_dict(state["async_stream"])
    phases.refit(run, version=int(state["weight_version"]))
    return int(state["step"]) + 1
