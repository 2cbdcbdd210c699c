"""`train(cfg)`: everything around the loop, in order.

    validate the config -> run dir -> prompts (tokenised up front) -> rewards -> Ray and pools ->
    worker groups -> resume (or, from a Megatron checkpoint, a first refit) -> the loop -> plot ->
    tear down
Every user error surfaces before Ray starts where it can (bad config, missing dataset field, a
custom reward that does not load); a worker that dies mid-run ends it with a WorkerFailure
naming the worker.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from rlhf_megatron.algorithms import build_kl_controller
from rlhf_megatron.config import TrainConfig, config_to_dict, save_config, validate_config
from rlhf_megatron.controller import phases
from rlhf_megatron.controller.checkpoint_store import CheckpointStore
from rlhf_megatron.controller.metrics import build_metrics_logger
from rlhf_megatron.controller.phases import Run
from rlhf_megatron.controller.trainer import restore_checkpoint, train_steps
from rlhf_megatron.data.prompts import PromptDataset, PromptLoader, PromptRow, tokenize_prompts
from rlhf_megatron.models.checkpoint_meta import hf_assets_dir, is_megatron_checkpoint
from rlhf_megatron.rewards import RewardManager


def load_prompts(cfg: TrainConfig, tokenizer: Any, files: list[str],
                 limit: int | None = None) -> list[tuple[PromptRow, list[int]]]:
    data = cfg.data
    rows: list[PromptRow] = []
    for file in files:
        rows += PromptDataset.from_file(file, prompt_key=data.prompt_key,
                                        answer_key=data.answer_key,
                                        data_source_key=data.data_source_key).rows
    rows = rows[:limit] if limit is not None else rows
    ids = tokenize_prompts(rows, tokenizer, use_chat_template=data.use_chat_template,
                           max_prompt_tokens=data.max_prompt_length)
    return list(zip(rows, ids, strict=True))


def _probe_custom_reward(rewards: RewardManager,
                         items: list[tuple[PromptRow, list[int]]]) -> None:
    """Call a custom reward once before Ray starts, on the first two training rows with their
    own answers as the responses, so one that raises or returns the wrong number of rewards
    fails in seconds (RewardError), not after the workers have started."""
    rows = [row for row, _ in items[:2]]
    rewards.compute([row.answer for row in rows], [row.answer for row in rows],
                    [row.data_source for row in rows])


def _say(message: str) -> None:
    print(f"[rlhf_megatron] {message}", file=sys.stderr, flush=True)


def train(cfg: TrainConfig) -> Path:
    """Run training as configured; returns the run directory."""
    import ray
    from transformers import AutoTokenizer

    from rlhf_megatron.controller.groups import build_groups
    from rlhf_megatron.controller.ray_cluster import reserve_pools, start_ray

    plan = validate_config(cfg)
    run_dir = Path(cfg.trainer.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    store = CheckpointStore(run_dir / "checkpoints", keep_last=cfg.trainer.keep_last)
    store.cleanup_stale()
    resume_from = store.resolve_resume(cfg.trainer.resume)

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path
                                              or hf_assets_dir(cfg.model.path))
    train_items = load_prompts(cfg, tokenizer, cfg.data.train_files)
    val_items = (load_prompts(cfg, tokenizer, cfg.data.val_files, cfg.data.val_max_prompts)
                 if cfg.data.val_files else [])
    loader = PromptLoader(train_items, batch_size=cfg.data.prompts_per_step, seed=cfg.data.seed)
    rewards = RewardManager(cfg.reward)
    if rewards.custom is not None and not cfg.uses_reward_model:
        _probe_custom_reward(rewards, train_items)
    alg = cfg.algorithm
    kl_controller = build_kl_controller(alg.kl_controller, alg.kl_coef, alg.kl_target,
                                        alg.kl_horizon)
    _say(f"{len(train_items)} training prompts, {len(val_items)} held out; run dir {run_dir}")

    start = time.perf_counter()
    groups = None
    logger = None
    try:
        start_ray(cfg, plan)
        pools = reserve_pools(cfg, plan, cfg.ray.startup_timeout_s)
        _say(f"pools {dict(plan.pools)} ({cfg.resources.mode}); starting workers")
        groups = build_groups(cfg, plan, pools)
        _say(f"workers ready in {time.perf_counter() - start:.1f}s")
        run = Run(cfg, groups, tokenizer, rewards, kl_controller, loader, val_items)
        start_step = 1
        if resume_from is not None:
            start_step = restore_checkpoint(run, store, resume_from)
            _say(f"resumed from {resume_from} at step {start_step}")
        elif is_megatron_checkpoint(cfg.model.path):
            # vLLM started on placeholder weights (a dist-checkpoint has no HF weights).
            phases.refit(run, version=0)
            _say(f"rollout weights sent from the actor (loaded from {cfg.model.path})")
        logger = build_metrics_logger(
            run_dir, console=cfg.metrics.console, tensorboard=cfg.metrics.tensorboard,
            wandb_project=cfg.metrics.wandb_project, run_name=cfg.trainer.run_name or run_dir.name,
            config_dict=config_to_dict(cfg), resume_step=start_step)
        train_steps(run, store, logger, start_step)
    finally:
        if logger is not None:
            logger.close()
        rewards.close()
        if groups is not None:
            groups.kill()
        ray.shutdown()
    if cfg.metrics.plot:
        from rlhf_megatron.controller.plot import plot_metrics

        plot_metrics(run_dir / "metrics.jsonl", run_dir / "plot.png")
    _say(f"done in {time.perf_counter() - start:.1f}s; metrics in {run_dir / 'metrics.jsonl'}")
    return run_dir
