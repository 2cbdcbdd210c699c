"""The offline algorithms (SFT, DPO, KTO) in the one step loop (loop.py): a source of dataset
batches, and the update that takes the step. No rollout engines, no refit, no validation pass.

    OfflineSource.start       DPO/KTO: the reference pass, once: sequence log-probs of every row
                              under the initial weights (a resumed run restored them instead,
                              from the checkpoint's REFERENCE_FILE)
    OfflineSource.next_batch  the next data.prompts_per_step examples (PromptLoader: shuffled per
                              epoch, resumable) -> the step batch and its OfflineStepSpec
                              [KTO: the policy's log-probs of the mismatched rows, z0]
    offline_step              one offline_update per worker (engines/offline_update.py)
Checkpoints, resume, SIGTERM, trainer.checkpoint_verify and batch dumps are the RL path's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from rlhf_megatron.algorithms.preference import kto_reference_point
from rlhf_megatron.cluster.worker_group import concat_rows
from rlhf_megatron.config.offline_validate import ROWS_PER_EXAMPLE
from rlhf_megatron.controller import phases
from rlhf_megatron.controller.phases import Run
from rlhf_megatron.controller.sources import StepRollout
from rlhf_megatron.data.offline_datasets import OfflineExample, rows_to_batch
from rlhf_megatron.engines.offline_update import OfflineStepSpec
from rlhf_megatron.errors import say
from rlhf_megatron.records.metrics import PhaseTimer

REFERENCE_FILE = "offline_reference.pt"
"""In a checkpoint of a DPO/KTO run: the reference log-probs (run.offline.reference)."""
CONSOLE_KEYS = ("loss", "rewards/margin", "rewards/accuracy", "kl", "actor/grad_norm",
                "time/step")
PLOT_KEYS = {"sft": ("loss",), "dpo": ("loss", "rewards/margin", "rewards/accuracy"),
             "kto": ("loss", "rewards/margin", "kl")}


@dataclass
class OfflineData:
    """An offline run's dataset and its reference log-probs (run.offline)."""

    examples: list[OfflineExample]
    reference: torch.Tensor | None = None
    """(N, rows per example) reference sequence log-probs (DPO: chosen, rejected; KTO:
    completion, mismatched); None for SFT, and until the reference pass."""


def _sequence_logprobs(run: Run, rows: list[Any]) -> torch.Tensor:
    """(len(rows),) summed log-probs under the actor's current weights, in chunks of one step's
    rows (padded with repeats so DP and micro-batch sizes divide)."""
    chunk = run.cfg.data.prompts_per_step * ROWS_PER_EXAMPLE[run.cfg.algorithm.name]
    out = []
    for start in range(0, len(rows), chunk):
        part = rows[start:start + chunk]
        padded = part + [part[i % len(part)] for i in range(chunk - len(part))]
        values = run.groups.actor.sequence_logprobs(rows_to_batch(padded))
        out.append(values[: len(part)])
    return torch.cat(out).float()


def reference_pass(run: Run) -> torch.Tensor:
    """Reference sequence log-probs of every row of every example, (N, rows per example)."""
    examples = run.offline.examples
    rows = [row for example in examples for row in example.rows]
    return _sequence_logprobs(run, rows).view(len(examples), len(examples[0].rows))


def step_batch(run: Run, indices: list[int]) -> tuple[Any, OfflineStepSpec, dict]:
    """The step's TokenBatch, its OfflineStepSpec and controller-side metrics."""
    cfg, s = run.cfg, run.cfg.algorithm.offline
    name = cfg.algorithm.name
    examples = [run.offline.examples[i] for i in indices]
    common = dict(beta=s.beta, dpo_loss=s.dpo_loss, lambda_d=s.kto_lambda_d,
                  lambda_u=s.kto_lambda_u)
    if name == "sft":
        batch = rows_to_batch([e.rows[0] for e in examples])
        return batch, OfflineStepSpec("sft", float(batch.loss_mask.sum()), **common), {}
    ref = run.offline.reference[indices]
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


class OfflineSource:
    """The dataset's step batches (module docstring); nothing runs ahead of the update."""

    def __init__(self, run: Run) -> None:
        self.run = run

    def start(self) -> None:
        run = self.run
        if run.cfg.algorithm.name != "sft" and run.offline.reference is None:
            run.offline.reference = reference_pass(run)
            say(f"reference log-probs of {run.offline.reference.numel()} rows computed")

    def next_batch(self, step: int) -> StepRollout:
        batch, spec, metrics = step_batch(self.run, self.run.loader.next_batch())
        spec = replace(spec, return_logprobs=step in self.run.cfg.trainer.dump_batch_steps)
        return StepRollout(batch, None, metrics, spec=spec)

    def before_refit(self, timer: PhaseTimer) -> None:
        """No rollout engines: nothing is refitted."""

    def after_step(self, step: int, rollout: StepRollout) -> None:
        """Nothing to record."""


def offline_step(run: Run, step: int, rollout: StepRollout,
                 timer: PhaseTimer) -> tuple[dict[str, float], bool]:
    """One optimizer step of the offline loss on the step's batch; its metrics, and False (no
    refit: there is no rollout)."""
    batch, spec = rollout.batch, rollout.spec
    with timer.phase("update"):
        results = run.groups.actor.offline_update(batch, spec)
    metrics: dict[str, float] = {}
    for key, value in results[0]["metrics"].items():
        metrics[key if "/" in key or key == "loss" else f"actor/{key}"] = value
    if "rewards/chosen" in metrics and "rewards/margin" not in metrics:
        metrics["rewards/margin"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    metrics["data/tokens"] = float(batch.attention_mask.sum())
    if spec.return_logprobs:
        phases.dump_batch(run, step, batch.with_fields(
            logprobs=concat_rows([r["logprobs"] for r in results])))
    return metrics, False
