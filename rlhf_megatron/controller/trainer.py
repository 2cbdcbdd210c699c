"""The PPO/GRPO loop. It reads top to bottom; each phase is a function in phases.py.

Steps are numbered from 1. A checkpoint taken after step s holds the engines, the prompt loader,
the KL controller and the weight version; resuming from it continues at step s + 1 and, on CPU,
reproduces the uninterrupted run's metrics exactly (sampling seeds depend on (seed, step) only).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlhf_megatron.controller import dynamic_sampling, phases
from rlhf_megatron.controller.checkpoint_store import CheckpointStore
from rlhf_megatron.controller.metrics import MetricsLogger, PhaseTimer
from rlhf_megatron.controller.phases import Run


def train_steps(run: Run, store: CheckpointStore, logger: MetricsLogger, start_step: int,
                on_step_end: Callable[[int, Path | None], None] | None = None) -> None:
    """Steps start_step..total_steps. `on_step_end(step, checkpoint saved after it or None)` runs
    after each step (run.py stops there after a signal: a safe point)."""
    cfg = run.cfg
    trainer = cfg.trainer
    if trainer.rollout_mode != "sync":
        from rlhf_megatron.controller.async_loop import train_steps_async

        return train_steps_async(run, store, logger, start_step, on_step_end)
    timer = PhaseTimer()
    if trainer.val_before_train and start_step == 1:
        logger.log(0, phases.validate(run, phases.step_seed(trainer.seed, 0)))
    progress = _progress_bar(cfg, start_step)
    for step in range(start_step, trainer.total_steps + 1):
        timer.reset()
        metrics: dict[str, float] = {}
        seed = phases.step_seed(trainer.seed, step)

        with timer.phase("generate"):
            if cfg.algorithm.dynamic_sampling.enabled:  # DAPO: rounds until the batch is full
                batch, scores, m = dynamic_sampling.generate_full_batch(run, seed)
            elif cfg.environment.enabled:  # multi-turn episodes (issue 15)
                rows, _ = phases.next_prompts(run)
                metrics.update(phases.before_generate(run))
                batch, episode_scores, m = phases.generate_episodes(run, rows, seed)
                metrics.update(phases.after_generate(run))
                scores = phases._Done(episode_scores)
            else:
                rows, prompts = phases.next_prompts(run)
                metrics.update(phases.before_generate(run))
                batch, m = phases.generate(run, prompts, cfg.rollout.sampling, seed)
                metrics.update(phases.after_generate(run))
            metrics.update(m)
        if not cfg.algorithm.dynamic_sampling.enabled and not cfg.environment.enabled:
            scores = phases.score_async(run, batch, rows)

        batch = phases.score_and_advantages(run, step, batch, scores, timer, metrics)

        if run.groups.critic is not None:
            with timer.phase("critic_update"):
                metrics.update(phases.update_critic(run, batch))
        if step > cfg.algorithm.critic_warmup_steps:
            with timer.phase("actor_update"):
                metrics.update(phases.update_actor(run, batch))
            with timer.phase("refit"):
                metrics.update(phases.refit(run, version=step))

        if trainer.val_every and step % trainer.val_every == 0:
            with timer.phase("validate"):
                metrics.update(phases.validate(run, phases.step_seed(trainer.seed, 0)))
        metrics.update(timer.metrics())
        metrics["weight_version"] = float(run.weight_version)
        logger.log(step, metrics)
        phases.check_logprob_drift(run, step, metrics)  # the weights the last refit sent
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
        from rlhf_megatron.controller.async_stream import PromptStream

        run.stream = PromptStream(run.loader)
        run.stream.load_state_dict(state["async_stream"])
    phases.refit(run, version=int(state["weight_version"]))
    return int(state["step"]) + 1
