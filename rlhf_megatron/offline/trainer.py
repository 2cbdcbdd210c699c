"""`train_offline(cfg)`: SFT / DPO / KTO on the actor worker group, no rollout engines.

    validate -> run dir -> dataset (tokenised up front) -> Ray, one pool -> actor group
    -> resume, or the reference pass (DPO/KTO: sequence log-probs of every row under the
       initial weights, computed once and stored with each checkpoint) -> steps -> plot

A step: the next `data.prompts_per_step` examples (PromptLoader: shuffled per epoch, resumable)
-> [KTO: the policy's log-probs of the mismatched rows, z0] -> one `offline_update` per worker
(offline/steps.py). Checkpoints are the RL path's (CheckpointStore + engine save), so
`trainer.resume` and `rlhf-convert mcore-to-hf <run>/checkpoints/step_N/actor` work the same.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from rlhf_megatron.config import TrainConfig, config_to_dict, save_config
from rlhf_megatron.controller.checkpoint_store import CheckpointStore
from rlhf_megatron.controller.metrics import (
    ConsoleSink,
    JsonlSink,
    MetricsLogger,
    PhaseTimer,
    TensorBoardSink,
    WandbSink,
)
from rlhf_megatron.data.prompts import PromptLoader
from rlhf_megatron.errors import CheckpointError
from rlhf_megatron.models.checkpoint_meta import hf_assets_dir
from rlhf_megatron.offline.datasets import OfflineExample, load_examples, rows_to_batch
from rlhf_megatron.offline.facade import OfflineActorGroup
from rlhf_megatron.offline.losses import kto_reference_point
from rlhf_megatron.offline.steps import OfflineStepSpec
from rlhf_megatron.offline.validate import ROWS_PER_EXAMPLE, validate_offline_config

REFERENCE_FILE = "offline_reference.pt"
CONSOLE_KEYS = ("loss", "rewards/margin", "rewards/accuracy", "kl", "actor/grad_norm",
                "time/step")
PLOT_KEYS = {"sft": ("loss",), "dpo": ("loss", "rewards/margin", "rewards/accuracy"),
             "kto": ("loss", "rewards/margin", "kl")}


@dataclass
class OfflineRun:
    cfg: TrainConfig
    group: OfflineActorGroup
    examples: list[OfflineExample]
    loader: PromptLoader
    reference: torch.Tensor | None = None
    """(N, rows per example) reference sequence log-probs (DPO: chosen, rejected; KTO:
    completion, mismatched); None for SFT."""


def _say(message: str) -> None:
    print(f"[rlhf_megatron] {message}", file=sys.stderr, flush=True)


def _sequence_logprobs(run: OfflineRun, rows: list[Any]) -> torch.Tensor:
    """(len(rows),) summed log-probs under the actor's current weights, in chunks of one step's
    rows (padded with repeats so DP and micro-batch sizes divide)."""
    chunk = run.cfg.data.prompts_per_step * ROWS_PER_EXAMPLE[run.cfg.algorithm.name]
    out = []
    for start in range(0, len(rows), chunk):
        part = rows[start:start + chunk]
        padded = part + [part[i % len(part)] for i in range(chunk - len(part))]
        values = run.group.sequence_logprobs(rows_to_batch(padded))
        out.append(values[: len(part)])
    return torch.cat(out).float()


def reference_pass(run: OfflineRun) -> torch.Tensor:
    """Reference sequence log-probs of every row of every example, (N, rows per example)."""
    width = len(run.examples[0].rows)
    rows = [row for example in run.examples for row in example.rows]
    return _sequence_logprobs(run, rows).view(len(run.examples), width)


def step_batch(run: OfflineRun, indices: list[int]) -> tuple[Any, OfflineStepSpec, dict]:
    """The step's TokenBatch, its OfflineStepSpec and controller-side metrics."""
    cfg, s = run.cfg, run.cfg.algorithm.offline
    name = cfg.algorithm.name
    examples = [run.examples[i] for i in indices]
    common = dict(beta=s.beta, dpo_loss=s.dpo_loss, lambda_d=s.kto_lambda_d,
                  lambda_u=s.kto_lambda_u)
    if name == "sft":
        batch = rows_to_batch([e.rows[0] for e in examples])
        return batch, OfflineStepSpec("sft", float(batch.loss_mask.sum()), **common), {}
    ref = run.reference[indices]
    if name == "dpo":
        rows = [row for e in examples for row in e.rows]  # chosen, rejected, chosen, ...
        batch = rows_to_batch(rows, ref_seq_logps=ref.reshape(-1))
        return batch, OfflineStepSpec("dpo", float(len(examples)), **common), {}
    mismatched = _sequence_logprobs(run, [e.rows[1] for e in examples])
    z0 = kto_reference_point(mismatched, ref[:, 1])
    desirable = torch.tensor([float(e.desirable) for e in examples])
    batch = rows_to_batch([e.rows[0] for e in examples], ref_seq_logps=ref[:, 0],
                          desirable=desirable)
    good = float(desirable.sum())
    spec = OfflineStepSpec("kto", float(len(examples)), kl_ref=z0, global_desirable=good,
                           global_undesirable=len(examples) - good, **common)
    return batch, spec, {"kl": z0, "data/desirable_fraction": good / len(examples)}


def offline_step(run: OfflineRun, step: int) -> dict[str, float]:
    from rlhf_megatron.controller.worker_group import concat_rows

    batch, spec, metrics = step_batch(run, run.loader.next_batch())
    dump = step in run.cfg.trainer.dump_batch_steps
    spec = replace(spec, return_logprobs=dump)
    results = run.group.update(batch, spec)
    for key, value in results[0]["metrics"].items():
        name = key if "/" in key or key == "loss" else f"actor/{key}"
        metrics[name] = value
    if "rewards/chosen" in metrics and "rewards/margin" not in metrics:
        metrics["rewards/margin"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    metrics["data/tokens"] = float(batch.attention_mask.sum())
    if dump:
        out = Path(run.cfg.trainer.run_dir) / "batches" / f"step_{step}.pt"
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
                    "loss_mask": batch.loss_mask, **batch.fields,
                    "logprobs": concat_rows([r["logprobs"] for r in results])}, out)
    return metrics


def save_checkpoint(run: OfflineRun, store: CheckpointStore, step: int) -> Path:
    temp = store.begin(step)
    run.group.save_checkpoint(str(temp / "actor"), step)
    if run.reference is not None:
        torch.save(run.reference, temp / REFERENCE_FILE)
    return store.commit(step, temp, {"step": step, "loader": run.loader.state_dict(),
                                     "algorithm": run.cfg.algorithm.name})


def restore_checkpoint(run: OfflineRun, store: CheckpointStore, path: Path) -> int:
    state = store.load_controller_state(path)
    if state.get("algorithm") != run.cfg.algorithm.name:
        raise CheckpointError(f"{path} was written by algorithm {state.get('algorithm')!r}, this "
                              f"run is {run.cfg.algorithm.name!r}")
    run.group.load_checkpoint(str(path / "actor"))
    run.loader.load_state_dict(state["loader"])
    if run.cfg.algorithm.name != "sft":
        if not (path / REFERENCE_FILE).is_file():
            raise CheckpointError(f"{path} has no {REFERENCE_FILE} (the reference log-probs)")
        run.reference = torch.load(path / REFERENCE_FILE)
    return int(state["step"]) + 1


def _logger(cfg: TrainConfig, run_dir: Path, start_step: int) -> MetricsLogger:
    m = cfg.metrics
    sinks: list[Any] = [JsonlSink(run_dir / "metrics.jsonl", resume_step=start_step)]
    if m.console:
        sinks.append(ConsoleSink(keys=CONSOLE_KEYS))
    if m.tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard"))
    if m.wandb_project:
        sinks.append(WandbSink(m.wandb_project, cfg.trainer.run_name or run_dir.name,
                               config_to_dict(cfg)))
    return MetricsLogger(sinks)


def train_offline(cfg: TrainConfig) -> Path:
    """Run SFT, DPO or KTO as configured; returns the run directory."""
    import ray
    from transformers import AutoTokenizer

    from rlhf_megatron.controller.ray_cluster import reserve_pools, start_ray

    plan = validate_offline_config(cfg)
    alg, trainer = cfg.algorithm, cfg.trainer
    run_dir = Path(trainer.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    store = CheckpointStore(run_dir / "checkpoints", keep_last=trainer.keep_last)
    store.cleanup_stale()
    resume_from = store.resolve_resume(trainer.resume)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path
                                              or hf_assets_dir(cfg.model.path))
    examples = load_examples(alg.name, cfg.data.train_files, tokenizer, alg.offline,
                             prompt_key=cfg.data.prompt_key,
                             use_chat_template=cfg.data.use_chat_template)
    loader = PromptLoader(list(range(len(examples))), batch_size=cfg.data.prompts_per_step,
                          seed=cfg.data.seed)
    _say(f"{alg.name.upper()}: {len(examples)} examples; run dir {run_dir}")
    start, group, logger = time.perf_counter(), None, None
    try:
        start_ray(cfg, plan)
        pools = reserve_pools(cfg, plan, cfg.ray.startup_timeout_s)
        group = OfflineActorGroup.build(cfg, pools["shared"])
        run = OfflineRun(cfg, group, examples, loader)
        _say(f"workers ready in {time.perf_counter() - start:.1f}s")
        start_step = 1
        if resume_from is not None:
            start_step = restore_checkpoint(run, store, resume_from)
            _say(f"resumed from {resume_from} at step {start_step}")
        elif alg.name != "sft":
            run.reference = reference_pass(run)
            _say(f"reference log-probs of {run.reference.numel()} rows computed")
        logger = _logger(cfg, run_dir, start_step)
        timer = PhaseTimer()
        for step in range(start_step, trainer.total_steps + 1):
            timer.reset()
            with timer.phase("update"):
                metrics = offline_step(run, step)
            logger.log(step, {**metrics, **timer.metrics()})
            if (trainer.save_every and step % trainer.save_every == 0) \
                    or step == trainer.total_steps:
                save_checkpoint(run, store, step)
    finally:
        if logger is not None:
            logger.close()
        if group is not None:
            group.kill()
        ray.shutdown()
    if cfg.metrics.plot:
        from rlhf_megatron.controller.plot import plot_metrics

        plot_metrics(run_dir / "metrics.jsonl", run_dir / "plot.png", keys=PLOT_KEYS[alg.name])
    _say(f"done in {time.perf_counter() - start:.1f}s; metrics in {run_dir / 'metrics.jsonl'}")
    return run_dir
