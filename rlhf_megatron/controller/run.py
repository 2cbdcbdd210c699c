"""`train(cfg)`: everything around the loop, in order.

    validate the config -> run dir -> prompts (tokenised up front) -> rewards -> Ray and pools ->
    worker groups -> resume (or, from a Megatron checkpoint, a first refit) -> the loop -> plot ->
    tear down
Every user error surfaces before Ray starts where it can (bad config, missing dataset field, a
custom reward that does not load, a damaged newest checkpoint, a resume with nothing left to do or
another prompt count); a worker that dies mid-run ends it with a WorkerFailure naming the worker.
Whatever ends the run (its end, an error, a signal, a dead worker), `_teardown` closes the
rewards' process, kills the worker groups, unlinks their refit segments and shuts Ray down.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

from rlhf_megatron.algorithms import build_kl_controller
from rlhf_megatron.cluster.groups import build_groups
from rlhf_megatron.cluster.lifecycle import (
    GracefulStop,
    remove_orphan_segments,
    remove_refit_segments,
)
from rlhf_megatron.cluster.ray_cluster import reserve_pools, start_ray
from rlhf_megatron.config import TrainConfig, config_to_dict, save_config, validate_config
from rlhf_megatron.config.validate import config_warnings
from rlhf_megatron.controller import phases
from rlhf_megatron.controller.loop import restore_checkpoint, save_checkpoint, train_steps
from rlhf_megatron.controller.offline_source import CONSOLE_KEYS, PLOT_KEYS, OfflineData
from rlhf_megatron.controller.phases import Run
from rlhf_megatron.data.offline_datasets import load_examples
from rlhf_megatron.data.prompts import PromptDataset, PromptLoader, PromptRow, tokenize_prompts
from rlhf_megatron.errors import CheckpointError, ConfigError, RlhfMegatronError, say
from rlhf_megatron.models.checkpoint_meta import (
    base_weights_dir,
    check_adapters_base,
    hf_assets_dir,
    is_megatron_checkpoint,
)
from rlhf_megatron.records.checkpoint_store import CONTROLLER_STATE_FILE, CheckpointStore
from rlhf_megatron.records.metrics import build_metrics_logger
from rlhf_megatron.records.plot import plot_metrics
from rlhf_megatron.rewards import RewardManager


def load_prompts(cfg: TrainConfig, tokenizer: Any, files: list[str],
                 limit: int | None = None) -> list[tuple[PromptRow, list[int]]]:
    data = cfg.data
    rows: list[PromptRow] = []
    for file in files:
        rows += PromptDataset.from_file(file, prompt_key=data.prompt_key,
                                        answer_key=data.answer_key,
                                        data_source_key=data.data_source_key,
                                        extra_info_key=data.extra_info_key).rows
    rows = rows[:limit] if limit is not None else rows
    ids = tokenize_prompts(rows, tokenizer, use_chat_template=data.use_chat_template,
                           max_prompt_tokens=data.max_prompt_length)
    return list(zip(rows, ids, strict=True))


def _probe_custom_reward(rewards: RewardManager,
                         items: list[tuple[PromptRow, list[int]]]) -> None:
    """Call a custom reward once before Ray starts, on the first two training rows, as the run
    will call it: a response string (the row's answer when that is a string, else an empty
    one), the row's answer, data source and extra_info as they are. One that raises or returns
    the wrong number of rewards fails in seconds (RewardError), not after the workers have
    started."""
    rows = [row for row, _ in items[:2]]
    rewards.compute([row.answer if isinstance(row.answer, str) else "" for row in rows],
                    [row.answer for row in rows], [row.data_source for row in rows],
                    extra_infos=[row.extra_info for row in rows])
    rewards.take_metrics()


def _check_rule_answers(cfg: TrainConfig, items: list[tuple[PromptRow, list[int]]]) -> None:
    """The rule rewards compare text: a row whose answer is a mapping or a list (verl's
    ``reward_model`` column, named by data.answer_key) would score 0 for every response."""
    if cfg.reward.custom_function or cfg.uses_reward_model or cfg.environment.enabled:
        return
    for row, _ in items:
        if isinstance(row.answer, bool) or not isinstance(row.answer, str | int | float):
            preview = str(row.answer)[:60]
            raise ConfigError(
                f"{row.origin}: data.answer_key={cfg.data.answer_key!r} is a "
                f"{type(row.answer).__name__} ({preview}), but the rule rewards compare text; "
                "name the text field (a dotted key, e.g. reward_model.ground_truth) or set "
                "reward.custom_function")


def train(cfg: TrainConfig) -> Path:
    """Run training as configured; returns the run directory. A signal (SIGTERM, SIGUSR1,
    SIGINT) ends it with StopRequested after a checkpoint of the step reached (lifecycle.py)."""
    stop = GracefulStop()
    stop.install()
    try:
        return _train(cfg, stop)
    finally:
        stop.restore()


def _prepare_run_dir(cfg: TrainConfig) -> Path:
    run_dir = Path(cfg.trainer.run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"trainer.run_dir={run_dir}: cannot create it ({exc.strerror})") \
            from None
    save_config(cfg, run_dir / "config.yaml")
    return run_dir


def _resume_state(cfg: TrainConfig, store: CheckpointStore,
                  path: Path | None) -> dict[str, Any] | None:
    """The controller state of the checkpoint to resume from, checked against the config before
    any worker starts: nothing left to do at total_steps is an error, not a silent exit."""
    if path is None:
        return None
    state = store.load_controller_state(path)
    # A LoRA actor's adapter-only checkpoint on another base than this run's.
    check_adapters_base(path / "actor", base_weights_dir(cfg.model.path))
    if int(state.get("step", 0)) >= cfg.trainer.total_steps:
        raise ConfigError(
            f"checkpoint {path} is at step {state.get('step')}, trainer.total_steps="
            f"{cfg.trainer.total_steps}: nothing left to train; raise trainer.total_steps or "
            "set trainer.resume=never to start over")
    return state


def _check_loader_state(loader: PromptLoader, state: dict[str, Any], path: Path) -> None:
    if not isinstance(state.get("loader"), dict):
        raise CheckpointError(f"cannot resume from {path}: its {CONTROLLER_STATE_FILE} has no "
                              "'loader' entry (the position in the training data)")
    try:
        loader.load_state_dict(state["loader"])
    except ConfigError as exc:
        raise CheckpointError(f"cannot resume from {path}: {exc}") from None


def _stop_point(stop: GracefulStop, run: Run, store: CheckpointStore, step: int,
                saved: Path | None) -> None:
    """After each step: on a pending signal, save the step reached (unless just saved) and stop."""
    if not stop.requested:
        return
    stop.tearing_down = True  # a second signal must not cut the save short
    checkpoint = saved if saved is not None else save_checkpoint(run, store, step)
    raise stop.stop_after(step, checkpoint)


def _teardown(groups: Any, pids: list[int], rewards: RewardManager, logger: Any) -> None:
    """Close everything the run started, whatever ended it; never waits on user code."""
    import ray

    if logger is not None:
        logger.close()
    rewards.close()
    if groups is not None:
        groups.kill()
    # ray.kill skips the workers' finalizers: unlink the refit segments they made.
    remove_refit_segments(pids)
    ray.shutdown()


def _load_data(cfg: TrainConfig, resume_state: dict[str, Any] | None,
               resume_from: Path | None) -> tuple[Any, list, list, PromptLoader, Any]:
    """Tokenizer, training and held-out items, the loader (checked against the checkpoint to
    resume from), and an offline run's dataset (offline_source.OfflineData; else None). An
    offline loader yields example indices."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path
                                              or hf_assets_dir(cfg.model.path))
    offline = None
    if cfg.is_offline:
        alg = cfg.algorithm
        offline = OfflineData(load_examples(alg.name, cfg.data.train_files, tokenizer,
                                            alg.offline, prompt_key=cfg.data.prompt_key,
                                            use_chat_template=cfg.data.use_chat_template))
        train_items, val_items = list(range(len(offline.examples))), []
    else:
        train_items = load_prompts(cfg, tokenizer, cfg.data.train_files)
        val_items = (load_prompts(cfg, tokenizer, cfg.data.val_files, cfg.data.val_max_prompts)
                     if cfg.data.val_files else [])
        _check_rule_answers(cfg, train_items + val_items)
    if cfg.data.prompts_per_step > len(train_items):
        raise ConfigError(
            f"data.prompts_per_step={cfg.data.prompts_per_step} is more than the "
            f"{len(train_items)} training {'examples' if cfg.is_offline else 'prompts'} in "
            "data.train_files: every step takes that many, and a partial last batch is dropped")
    loader = PromptLoader(train_items, batch_size=cfg.data.prompts_per_step, seed=cfg.data.seed)
    if resume_state is not None:
        _check_loader_state(loader, resume_state, resume_from)
    return tokenizer, train_items, val_items, loader, offline


def _first_step(run: Run, store: CheckpointStore, resume_from: Path | None) -> int:
    """Restore the checkpoint (or refit vLLM from a Megatron model.path); the step to run next."""
    if resume_from is not None:
        try:
            start_step = restore_checkpoint(run, store, resume_from)
        except (RlhfMegatronError, OSError) as exc:
            raise CheckpointError(f"loading checkpoint {resume_from} failed: {exc}") from None
        say(f"resumed from {resume_from} at step {start_step}")
        return start_step
    if run.groups.rollout is not None and is_megatron_checkpoint(run.cfg.model.path):
        # vLLM started on placeholder weights (a dist-checkpoint has no HF weights).
        phases.refit(run, version=0)
        say(f"rollout weights sent from the actor (loaded from {run.cfg.model.path})")
    return 1


def _train(cfg: TrainConfig, stop: GracefulStop) -> Path:

    plan = validate_config(cfg)
    for warning in config_warnings(cfg):
        say(f"warning: {warning}")
    run_dir = _prepare_run_dir(cfg)
    store = CheckpointStore(run_dir / "checkpoints", keep_last=cfg.trainer.keep_last,
                            verify=cfg.trainer.checkpoint_verify)
    store.cleanup_stale()
    resume_from = store.resolve_resume(cfg.trainer.resume)
    resume_state = _resume_state(cfg, store, resume_from)
    for path in remove_orphan_segments():
        say(f"removed {path}, left behind by a process that no longer exists")

    tokenizer, train_items, val_items, loader, offline = _load_data(cfg, resume_state,
                                                                    resume_from)
    alg = cfg.algorithm
    kl_controller = build_kl_controller(alg.kl_controller, alg.kl_coef, alg.kl_target,
                                        alg.kl_horizon)
    rewards = RewardManager(cfg.reward)
    start = time.perf_counter()
    groups = None
    logger = None
    pids: list[int] = []
    try:
        if offline is not None:
            say(f"{cfg.algorithm.name.upper()}: {len(train_items)} examples; run dir {run_dir}")
        else:
            if rewards.custom is not None and not cfg.uses_reward_model:
                _probe_custom_reward(rewards, train_items)
            say(f"{len(train_items)} training prompts, {len(val_items)} held out; run dir "
                f"{run_dir}")
        start_ray(cfg, plan)
        stop.install()  # after Ray's own SIGTERM handler
        pools = reserve_pools(cfg, plan, cfg.ray.startup_timeout_s)
        say(f"pools {dict(plan.pools)} ({cfg.resources.mode}); starting workers")
        groups = build_groups(cfg, plan, pools)
        pids = groups.pids()
        say(f"workers ready in {time.perf_counter() - start:.1f}s")
        run = Run(cfg, groups, tokenizer, rewards, kl_controller, loader, val_items,
                  offline=offline)
        start_step = _first_step(run, store, resume_from)
        logger = build_metrics_logger(
            run_dir, console=cfg.metrics.console, tensorboard=cfg.metrics.tensorboard,
            wandb_project=cfg.metrics.wandb_project, run_name=cfg.trainer.run_name or run_dir.name,
            config_dict=config_to_dict(cfg), resume_step=start_step,
            console_keys=CONSOLE_KEYS if offline is not None else None)
        stop.in_loop = True
        if stop.requested:  # a signal during start-up that did not interrupt it
            raise stop.stop_after(start_step - 1, resume_from)
        train_steps(run, store, logger, start_step,
                    on_step_end=functools.partial(_stop_point, stop, run, store))
    finally:
        stop.in_loop, stop.tearing_down = False, True
        _teardown(groups, pids, rewards, logger)
    if cfg.metrics.plot:

        plot_metrics(run_dir / "metrics.jsonl", run_dir / "plot.png",
                     **({"keys": PLOT_KEYS[cfg.algorithm.name]} if offline is not None else {}))
    say(f"done in {time.perf_counter() - start:.1f}s; metrics in {run_dir / 'metrics.jsonl'}")
    return run_dir
