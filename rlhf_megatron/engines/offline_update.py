"""One offline optimizer step on an ActorEngine, through the engine's own micro-batching,
pipeline schedule, forward/backward and optimizer (engines/base.py); only the loss differs.

Every loss term is normalised by a global count the controller computes over the whole step
batch (SFT: assistant tokens; DPO: pairs; KTO: examples), then summed over micro-batches and DP
ranks (`loss_scale_for_sum`), so the loss and gradient do not depend on how the batch is split.
Metrics are normalised the same way and summed (`reduce_metrics(summed=...)`), so they are exact
batch means too.

Batch layout (built by controller/offline_source.py):
    SFT  one row per conversation; loss_mask on the assistant tokens.
    DPO  rows 2i, 2i+1 = chosen, rejected of pair i; field 'ref_seq_logps' (bs,).
    KTO  one row per example; fields 'ref_seq_logps' (bs,), 'desirable' (bs,) 0/1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlhf_megatron.algorithms.preference import dpo_loss, kto_loss, sft_token_loss_sum
from rlhf_megatron.data.batch import TokenBatch
from rlhf_megatron.engines.actor import token_values_from_logits
from rlhf_megatron.engines.base import MegatronEngine, MicroBatch


@dataclass(frozen=True)
class OfflineStepSpec:
    """What one step computes. Counts are over the whole step batch (all DP ranks)."""

    algorithm: str
    """'sft', 'dpo' or 'kto'."""
    global_count: float
    """SFT: loss tokens; DPO: pairs; KTO: examples."""
    beta: float = 0.1
    dpo_loss: str = "sigmoid"
    lambda_d: float = 1.0
    lambda_u: float = 1.0
    kl_ref: float = 0.0
    """KTO's z0 for this batch (computed by the controller, detached)."""
    global_desirable: float = 0.0
    global_undesirable: float = 0.0
    return_logprobs: bool = False
    """Also return the policy's (bs, S) token log-probs of this forward (batch order)."""


def _sequence_logps(engine: MegatronEngine, micro: MicroBatch,
                    logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, s) masked token log-probs and their (b,) per-row sums."""
    lp, _ = token_values_from_logits(engine, micro, logits, compute_entropy=False)
    token_lp = lp * micro.rows.loss_mask.to(lp.dtype)
    return token_lp, token_lp.sum(-1)


def _sft_terms(token_lp: torch.Tensor, seq: torch.Tensor, rows: TokenBatch,
               spec: OfflineStepSpec) -> tuple[torch.Tensor, dict[str, float]]:
    loss = sft_token_loss_sum(token_lp, rows.loss_mask.to(token_lp.dtype)) / spec.global_count
    return loss, {"loss": float(loss.detach())}


def _dpo_terms(token_lp: torch.Tensor, seq: torch.Tensor, rows: TokenBatch,
               spec: OfflineStepSpec) -> tuple[torch.Tensor, dict[str, float]]:
    assert len(seq) % 2 == 0, "a DPO micro-batch must hold whole (chosen, rejected) pairs"
    ref = rows.fields["ref_seq_logps"].to(seq.dtype)
    terms = dpo_loss(seq[0::2], seq[1::2], ref[0::2], ref[1::2], beta=spec.beta,
                     kind=spec.dpo_loss)
    n = spec.global_count
    loss = terms.losses.sum() / n
    margin = terms.chosen_rewards - terms.rejected_rewards
    return loss, {
        "loss": float(loss.detach()),
        "rewards/chosen": float(terms.chosen_rewards.sum() / n),
        "rewards/rejected": float(terms.rejected_rewards.sum() / n),
        "rewards/margin": float(margin.sum() / n),
        "rewards/accuracy": float((margin > 0).float().sum() / n),
        "logps/chosen": float(seq[0::2].detach().sum() / n),
        "logps/rejected": float(seq[1::2].detach().sum() / n),
    }


def _kto_terms(token_lp: torch.Tensor, seq: torch.Tensor, rows: TokenBatch,
               spec: OfflineStepSpec) -> tuple[torch.Tensor, dict[str, float]]:
    ref = rows.fields["ref_seq_logps"].to(seq.dtype)
    desirable = rows.fields["desirable"].bool()
    terms = kto_loss(seq, ref, desirable, kl_ref=spec.kl_ref, beta=spec.beta,
                     lambda_d=spec.lambda_d, lambda_u=spec.lambda_u)
    loss = terms.losses.sum() / spec.global_count
    return loss, {
        "loss": float(loss.detach()),
        "rewards/chosen": float(terms.chosen_rewards.sum() / max(spec.global_desirable, 1.0)),
        "rewards/rejected": float(terms.rejected_rewards.sum()
                                  / max(spec.global_undesirable, 1.0)),
    }


TERMS = {"sft": _sft_terms, "dpo": _dpo_terms, "kto": _kto_terms}
"""The loss terms of each offline algorithm (algorithm.name)."""


def offline_update(engine: Any, batch: TokenBatch, spec: OfflineStepSpec) -> dict[str, Any]:
    """One optimizer step on this DP rank's share of the batch.

    Returns {'metrics': {name: float}} (identical on every rank: batch means, plus grad_norm
    and lr) and, with spec.return_logprobs, 'logprobs': (bs, S) of this shard.
    """
    micro_batches = engine.make_micro_batches(batch)
    scale = engine.loss_scale_for_sum(len(micro_batches))
    terms = TERMS[spec.algorithm]

    def loss_fn(micro: MicroBatch, logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
        token_lp, seq = _sequence_logps(engine, micro, logits)
        loss, values = terms(token_lp, seq, micro.rows, spec)
        if spec.return_logprobs:
            values["_logprobs"] = token_lp.detach()
        return loss * scale, values

    results = engine.run_micro_batches(micro_batches, loss_fn, forward_only=False)
    pieces = [r.pop("_logprobs") for r in results] if spec.return_logprobs else []
    names = set(results[0]) if results else set()
    metrics = engine.reduce_metrics(results, summed=names)
    metrics.update(engine.optimizer_step())
    out: dict[str, Any] = {"metrics": metrics}
    if spec.return_logprobs:
        out["logprobs"] = engine.rows_in_batch_order(batch, micro_batches, pieces)
    return out
