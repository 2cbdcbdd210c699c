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

from rlhf_megatron.controller import phases
from rlhf_megatron.controller.async_stream import PromptStream
from rlhf_megatron.controller.checkpoint_store import CheckpointStore
from rlhf_megatron.controller.dynamic_sampling import DynamicSampling
from rlhf_megatron.controller.metrics import MetricsLogger, PhaseTimer
from rlhf_megatron.controller.phases import Run
from rlhf_megatron.controller.sources import EpisodeSource, PromptSource, SyncSource
from rlhf_megatron.controller.stream_source import StreamSource


def build_source(run: Run) -> Any:
    """The run's source of batches (sources.py), chosen once from trainer.rollout_mode,
    environment and algorithm.dynamic_sampling."""
    cfg = run.cfg
    if cfg.trainer.rollout_mode != "sync":
        return StreamSource(run)
    source: SyncSource = EpisodeSource(run) if cfg.environment.enabled else PromptSource(run)
    return DynamicSampling(source) if cfg.algorithm.dynamic_sampling.enabled else source


def train_steps(run: Run, store: CheckpointStore, logger: MetricsLogger, start_step: int,
                on_step_end: Callable[[int, Path | None], None] | None = None) -> None:
    """Steps start_step..total_steps. `on_step_end(step, checkpoint saved after it or None)` runs
    after each step but the last (run.py stops there after a signal: a safe point)."""
    cfg, trainer = run.cfg, run.cfg.trainer
    source = build_source(run)
    timer = PhaseTimer()
    if trainer.val_before_train and start_step == 1:
        logger.log(0, phases.validate(run, phases.step_seed(trainer.seed, 0)))
    source.start()
    progress = _progress_bar(cfg, start_step)
    for step in range(start_step, trainer.total_steps + 1):
        timer.reset()
        with timer.phase("generate"):
            rollout = source.next_batch(step)
        metrics = dict(rollout.metrics)
        trained_version = run.weight_version
        batch = phases.score_and_advantages(run, step, rollout.batch, rollout.scores, timer,
                                            metrics)
        if run.groups.critic is not None:
            with timer.phase("critic_update"):
                metrics.update(phases.update_critic(run, batch))
        if step > cfg.algorithm.critic_warmup_steps:
            with timer.phase("actor_update"):
                metrics.update(phases.update_actor(run, batch))
            source.before_refit(timer)
            with timer.phase("refit"):
                metrics.update(phases.refit(run, version=step))
        source.after_step(step, rollout)
        if trainer.val_every and step % trainer.val_every == 0:
            with timer.phase("validate"):
                metrics.update(phases.validate(run, phases.step_seed(trainer.seed, 0)))
        metrics.update(timer.metrics())
        metrics["weight_version"] = float(run.weight_version)
        logger.log(step, metrics)
        phases.check_logprob_drift(run, step, metrics, trained_version)
        if progress is not None:
            progress.update(1)
            progress.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
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
    state = {"step": step, "loader": run.loader.state_dict(),
             "kl_coef": run.kl_controller.value, "weight_version": run.weight_version}
    if run.stream is not None:  # async modes: the prompts not yet trained (async_stream.py)
        state["async_stream"] = run.stream.state_dict()
    return store.commit(step, temp, state)


def restore_checkpoint(run: Run, store: CheckpointStore, path: Path) -> int:
    """Load engines and controller state from `path`, push the restored weights to vLLM, and
    return the next step to run."""
    state = store.load_controller_state(path)
    run.groups.actor.load_checkpoint(str(path / "actor"))
    if run.groups.critic is not None:
        run.groups.critic.load_checkpoint(str(path / "critic"))
    run.loader.load_state_dict(state["loader"])
    run.kl_controller.value = float(state["kl_coef"])
    if "async_stream" in state:
        run.stream = PromptStream(run.loader)
        run.stream.load_state_dict(state["async_stream"])
    phases.refit(run, version=int(state["weight_version"]))
    return int(state["step"]) + 1
