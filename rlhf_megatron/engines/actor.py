"""Actor and reference engines: token log-probs and entropy, and the policy update.

Token values are aligned with input_ids (see data/batch.py): the logits at position t score token
t + 1, so values[:, t + 1] = f(logits[:, t], input_ids[:, t + 1]) and values[:, 0] = 0. Everything
is computed vocab-parallel (engines/vocab_parallel.py): no rank gathers the full vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from rlhf_megatron.algorithms import (
    LossAggregation,
    LossNormalizer,
    PolicyLossConfig,
    PolicyLossInputs,
    RolloutCorrection,
    RolloutCorrectionConfig,
    compute_kl_loss,
    compute_loss_normalizer,
    compute_policy_loss,
    compute_rollout_correction,
)
from rlhf_megatron.data.batch import TokenBatch
from rlhf_megatron.data.packing import unpack_rows
from rlhf_megatron.data.sampling import SampledDistribution, sampled_distribution
from rlhf_megatron.engines.base import MegatronEngine, MicroBatch
from rlhf_megatron.engines.chunked_logprobs import next_token_logprobs
from rlhf_megatron.errors import ConfigError


@dataclass(frozen=True)
class PolicyUpdateSettings:
    """How one policy update turns a batch into a loss (all names go through the registries)."""

    loss: str = "vanilla"
    """Policy loss name in POLICY_LOSSES ('vanilla' = PPO clip with clip-higher/dual clip; 'gspo')."""
    loss_config: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    aggregation: str = "token-mean"
    """Loss aggregation mode, normalised over the whole global batch."""
    loss_scale_factor: float | None = None
    """Constant of seq-mean-token-sum-norm (e.g. the max response length)."""
    entropy_coeff: float = 0.0
    """Entropy bonus: loss -= entropy_coeff * aggregated entropy."""
    kl_loss_coeff: float = 0.0
    """KL-as-loss against batch field 'ref_logprobs' (0 disables)."""
    kl_loss_kind: str = "low_var_kl"
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """IS weights / rejection from batch field 'rollout_logprobs' (behaviour) to 'old_logprobs'."""


def token_values_from_logits(
    engine: MegatronEngine, micro: MicroBatch, logits: torch.Tensor, *, compute_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(b, S) log-probs (and entropy) of micro.rows' tokens, aligned with input_ids, of the
    distribution each row was sampled from (its temperature, top-k and top-p fields;
    data/sampling.py): every pass (old, reference, update, entropy) comes through here."""
    shifted_lp, shifted_ent = next_token_logprobs(
        engine.last_stage_output(logits), micro.full_tokens, vocab_size=engine.vocab_size,
        compute_entropy=compute_entropy, cp=micro.cp, sampling=position_sampling(micro),
    )

    def align(values: torch.Tensor | None) -> torch.Tensor | None:
        if values is None:
            return None
        values = torch.nn.functional.pad(values, (1, 0))  # position 0 has no context
        if micro.packed is None:
            return values[:, : micro.rows.seq_len]  # CP pads rows to a multiple of 2*cp
        # The first token of each packed row was "predicted" from the previous row: drop it.
        rows = unpack_rows(values.unsqueeze(-1), micro.packed, micro.rows.seq_len).squeeze(-1)
        rows[:, 0] = 0.0
        return rows

    return align(shifted_lp), align(shifted_ent)


def position_sampling(micro: MicroBatch) -> SampledDistribution | None:
    """The rows' sampling settings laid out like the logits' positions: (b, 1) for dense rows,
    (1, T) for packed ones (each row's value over its padded span), this CP rank's share of
    them under context parallelism. None for rows without sampling fields."""
    rows = sampled_distribution(micro.rows.fields)
    if rows is None:
        return None
    if micro.packed is None:
        return rows.expand(lambda t: t.unsqueeze(-1))
    lengths = micro.packed.padded_lengths.to(rows.temperature.device)

    def per_position(t: torch.Tensor) -> torch.Tensor:
        spread = torch.repeat_interleave(t, lengths).unsqueeze(0)
        return spread if micro.cp is None else micro.cp.local(spread)

    return rows.expand(per_position)


class ReferenceEngine(MegatronEngine):
    """Frozen policy: log-probs only, no optimizer."""

    def __init__(self, config: Any, *, hf_dir: Any, dims: Any, trainable: bool = False) -> None:
        super().__init__(config, hf_dir=hf_dir, dims=dims, trainable=trainable)
        self.reads_hidden_states = config.logits_chunk_tokens > 0

    def compute_logprobs(
        self, batch: TokenBatch, *, with_entropy: bool = False
    ) -> dict[str, torch.Tensor]:
        """{'logprobs': (bs, S)[, 'entropy': (bs, S)]} of every token, zero where loss_mask is 0.

        Identical on every rank of the engine (broadcast from the last pipeline stage).
        """
        return self._compute_logprobs(batch, with_entropy=with_entropy)[0]

    def _compute_logprobs(self, batch: TokenBatch, *, with_entropy: bool,
                          routing: Any = None) -> tuple[dict[str, torch.Tensor], list[MicroBatch]]:
        micro_batches = self.make_micro_batches(batch)

        def read_out(micro: MicroBatch, logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
            lp, ent = token_values_from_logits(self, micro, logits, compute_entropy=with_entropy)
            mask = micro.rows.loss_mask.to(lp.dtype)
            values = {"logprobs": lp * mask}
            if ent is not None:
                values["entropy"] = ent * mask
            return lp.new_zeros(()), values

        results = self.run_micro_batches(micro_batches, read_out, forward_only=True,
                                         routing=routing)
        names = ["logprobs"] + (["entropy"] if with_entropy else [])
        return {
            name: self.rows_in_batch_order(batch, micro_batches, [r[name] for r in results])
            for name in names
        }, micro_batches


class ActorEngine(ReferenceEngine):
    """The policy: log-probs, entropy and the PPO/GRPO update."""

    def __init__(self, config: Any, *, hf_dir: Any, dims: Any) -> None:
        super().__init__(config, hf_dir=hf_dir, dims=dims, trainable=True)
        if config.routing_replay:
            if not self.is_moe:
                raise ConfigError("actor.engine.routing_replay needs a mixture-of-experts model")
            if dims.cp > 1:
                raise ConfigError(f"actor.engine.routing_replay does not support context "
                                  f"parallelism (cp={dims.cp})")
            if config.recompute_activations:
                raise ConfigError("actor.engine.routing_replay does not support "
                                  "recompute_activations (the recomputed forward would not replay)")

    def adapters_off(self) -> AdaptersOffReference:
        """The reference policy of a LoRA actor: this engine with its adapters switched off."""
        if self.config.lora is None:
            raise ConfigError("adapters_off needs actor.engine.lora")
        return AdaptersOffReference(self)

    def _routing_pass(self, *, replay: bool) -> Any:
        """An MoE model's routing bookkeeping for one pass (None for a dense model)."""
        if not self.is_moe:
            return None
        from rlhf_megatron.models.moe_replay import RoutingPass

        return RoutingPass(self.args.transformer_config, replay=replay)

    def _moe_groups(self) -> list[Any]:
        """The groups MoE counts add up over: the pipeline stages, then DP."""
        from megatron.core import parallel_state

        return [parallel_state.get_pipeline_model_parallel_group(),
                parallel_state.get_data_parallel_group(with_context_parallel=False)]

    def compute_logprobs(
        self, batch: TokenBatch, *, with_entropy: bool = False
    ) -> dict[str, torch.Tensor]:
        """As ReferenceEngine's; with engine.routing_replay also 'routed_experts'
        (bs, S, MoE layers, k) int16: each token's experts in this forward (models/moe_replay.py)."""
        from megatron.core import parallel_state

        from rlhf_megatron.models.moe_replay import ROUTED_EXPERTS

        if not self.config.routing_replay:
            return super().compute_logprobs(batch, with_entropy=with_entropy)
        routing = self._routing_pass(replay=False)
        out, micro_batches = self._compute_logprobs(batch, with_entropy=with_entropy,
                                                    routing=routing)
        out[ROUTED_EXPERTS] = routing.recorded_field(
            batch, micro_batches, parallel_state.get_pipeline_model_parallel_group(),
            self.platform.device())
        return out

    def update_policy(self, batch: TokenBatch, settings: PolicyUpdateSettings) -> dict[str, float]:
        """One optimizer step on this DP rank's share of the global batch.

        batch.fields must hold 'advantages' (bs, S) and, unless this is the batch's only
        optimizer step, 'old_logprobs' (bs, S): without them the update uses its own detached
        log-probs as the old ones (the on-policy shortcut: ratio 1, same gradient); optionally
        'rollout_logprobs' (for TIS and rollout correction) and 'ref_logprobs' (for the KL loss).
        With rollout correction on, rejected tokens leave the loss mask of every term and the
        global normaliser. Returns metrics averaged over micro-batches and DP ranks, plus
        grad_norm and lr. After an on-policy update (no 'old_logprobs'), `self.on_policy_values`
        holds {'logprobs', 'entropy'}: (bs, S), detached, zero outside loss_mask: what the
        skipped forward would have given (the controller's rollout metrics read them).
        """
        on_policy = "old_logprobs" not in batch.fields
        self.on_policy_values: dict[str, torch.Tensor] | None = None
        correcting = settings.rollout_correction.enabled
        for name in ("advantages",) + (("old_logprobs",) if correcting else ()) + (
            ("ref_logprobs",) if settings.kl_loss_coeff else ()
        ) + (("rollout_logprobs",) if correcting else ()):
            if name not in batch.fields:
                raise ConfigError(f"update_policy needs batch field {name!r}")
        micro_batches = self.make_micro_batches(batch)
        corrections = [self._correction(m, settings) for m in micro_batches] if correcting else []
        correction_of = {id(m): c for m, c in zip(micro_batches, corrections)}
        normaliser = self._global_normaliser(micro_batches, corrections)
        aggregation = LossAggregation(settings.aggregation, normaliser, settings.loss_scale_factor)
        scale = self.loss_scale_for_sum(len(micro_batches))
        need_entropy = True  # reported as a metric even without a bonus

        def policy_loss(micro: MicroBatch, logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
            lp, entropy = token_values_from_logits(self, micro, logits, compute_entropy=need_entropy)
            rows, mask = micro.rows, micro.rows.loss_mask
            correction = correction_of.get(id(micro))
            if correction is not None:
                mask = correction.mask
            inputs = PolicyLossInputs(
                log_prob=lp, old_log_prob=rows.fields.get("old_logprobs", lp.detach()),
                advantages=rows.fields["advantages"], response_mask=mask,
                rollout_log_prob=rows.fields.get("rollout_logprobs"),
                is_weights=None if correction is None else correction.weights,
            )
            loss, metrics = compute_policy_loss(
                settings.loss, inputs, settings.loss_config, aggregation
            )
            entropy_term = aggregation.apply(entropy, mask)
            if correction is not None:
                metrics = {**metrics, **correction.metrics}
            values = {k: float(v) for k, v in metrics.items()}
            values["pg_loss"] = float(loss.detach())  # the policy loss alone, without the bonus
            values["entropy"] = float(entropy_term.detach())
            if settings.entropy_coeff:  # else the metric's graph is never walked backward
                loss = loss - settings.entropy_coeff * entropy_term
            if settings.kl_loss_coeff:
                kl, _ = compute_kl_loss(
                    lp, rows.fields["ref_logprobs"], mask, settings.kl_loss_kind, aggregation
                )
                loss = loss + settings.kl_loss_coeff * kl
                values["kl_loss"] = float(kl.detach())
            if on_policy:  # per-token values for the controller (popped before the reduction)
                values["token/logprobs"] = lp.detach() * micro.rows.loss_mask
                values["token/entropy"] = entropy.detach() * micro.rows.loss_mask
            return loss * scale, values

        routing = self._routing_pass(replay=self.config.routing_replay)
        results = self.run_micro_batches(micro_batches, policy_loss, forward_only=False,
                                         routing=routing)
        if on_policy:
            self.on_policy_values = {
                name: self.rows_in_batch_order(
                    batch, micro_batches, [r.pop(f"token/{name}") for r in results])
                for name in ("logprobs", "entropy")}
        metrics = self.reduce_metrics(results, summed={"pg_loss", "entropy", "kl_loss"})
        if routing is not None:
            metrics.update(self._moe_metrics(routing, len(micro_batches)))
        metrics.update(self.optimizer_step())
        return metrics

    def _moe_metrics(self, routing: Any, num_micro_batches: int) -> dict[str, float]:
        """Routing mismatch / drift against the recorded experts, expert load per layer, and
        the load-balancing loss the backward added (models/moe_replay.py)."""
        from megatron.core import parallel_state

        from rlhf_megatron.models.moe_replay import aux_loss_metrics

        device = self.platform.device()
        groups = self._moe_groups()
        metrics = routing.metrics(groups, device)
        coeff = float(self.args.transformer_config.moe_aux_loss_coeff or 0.0)
        metrics.update(aux_loss_metrics(
            coeff, num_micro_batches, [parallel_state.get_pipeline_model_parallel_group()],
            parallel_state.get_data_parallel_group(with_context_parallel=False), device))
        return metrics

    @staticmethod
    def _correction(micro: MicroBatch, settings: PolicyUpdateSettings) -> RolloutCorrection:
        """Rollout correction of one micro-batch: behaviour = vLLM's log-probs, target = old."""
        rows = micro.rows
        return compute_rollout_correction(
            rows.fields["old_logprobs"], rows.fields["rollout_logprobs"], rows.loss_mask,
            settings.rollout_correction,
        )

    def _global_normaliser(
        self, micro_batches: list[MicroBatch], corrections: list[RolloutCorrection] = ()
    ) -> LossNormalizer:
        """Token and sequence counts of the global batch (after rollout-correction rejection)."""
        local = LossNormalizer(0.0, 0.0)
        masks = [c.mask for c in corrections] or [m.rows.loss_mask for m in micro_batches]
        for mask in masks:
            local = local + compute_loss_normalizer(mask)
        return LossNormalizer.from_tensor(self.all_reduce_dp(local.to_tensor()))


class AdaptersOffReference:
    """A LoRA actor's base model as a reference engine: the same chunks with every adapter's
    delta left out (models/lora.py), so no second copy of the weights is built. Its log-probs
    are the frozen base model's, bit for bit (tests/integration/engines/test_lora_engine.py)."""

    def __init__(self, actor: ActorEngine) -> None:
        self.actor = actor

    def compute_logprobs(self, batch: TokenBatch, *, with_entropy: bool = False
                         ) -> dict[str, torch.Tensor]:
        from rlhf_megatron.models.lora import adapters_disabled

        with adapters_disabled(self.actor.chunks):
            return ReferenceEngine.compute_logprobs(self.actor, batch, with_entropy=with_entropy)
