"""Loss aggregation: a per-token loss matrix ``(bs, T)`` -> one scalar, layout-independent.

Why a *global* normaliser: a step's batch is split over DP ranks and micro-batches. If every
micro-batch divided by its own token count, the sum of the pieces would depend on how the batch was
cut. Instead every piece divides by the denominator of the *whole* global batch
(:class:`LossNormalizer`, counted once per step and all-reduced by the engine), so

    sum over ranks and micro-batches of aggregate_loss(piece, normalizer) == aggregate_loss(batch)

exactly, for every mode, in value and in gradient. The engine must therefore *sum* the pieces:
no extra division by the number of micro-batches and no averaging of gradients over DP ranks
(with Megatron: return the loss as-is with ``calculate_per_token_loss``-style handling, or
multiply by ``num_microbatches * dp_size`` to undo the averaging). This is verl's ``agg_loss``
with ``batch_num_tokens`` / ``global_batch_size`` (which multiplies by ``dp_size`` because FSDP
averages over DP instead).

Modes (``mask``: 1 = real response token, 0 = padding; ``N_tok``/``N_seq`` from the normaliser):
  * ``token-mean``:              sum(loss * mask) / N_tok
  * ``token-sum``:               sum(loss * mask), no denominator: the global batch's loss is the
    sum over *all* its real tokens. The normaliser is not read (its denominator is the constant
    1), so each piece's sum adds up to the global one exactly like the other modes; the loss and
    its gradient grow with the number of tokens in the step (pick the learning rate for that).
    verl's ``token-sum`` (its pure-IS / bypass presets).
  * ``seq-mean-token-sum``:      sum(loss * mask) / N_seq
  * ``seq-mean-token-mean``:     sum_i [sum_t(loss * mask)_i / n_i] / N_seq   (n_i = tokens of i)
  * ``seq-mean-token-sum-norm``: sum(loss * mask) / (N_seq * loss_scale_factor); the factor
    defaults to ``T = mask.shape[-1]`` as in verl (Dr. GRPO's constant normaliser). Pass a
    constant (e.g. the configured max response length) when micro-batches are padded to
    different lengths, or the result depends on the padding.

Empty sequences (all-zero mask row), following verl: they add nothing to any numerator, 0 tokens to
``N_tok``, and are *not* counted in ``N_seq`` (verl's ``seq_mask = token_count > 0``). A global
batch with no real token gives a loss of exactly 0 (verl would produce 0/0 = NaN).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlhf_megatron.algorithms._checks import check_positive, validated_mask, zero_padding
from rlhf_megatron.algorithms.registry import Registry

AggregationFn = Callable[[torch.Tensor, torch.Tensor, "LossNormalizer", float], torch.Tensor]

AGGREGATION_MODES: Registry[AggregationFn] = Registry("loss aggregation mode")


@dataclass(frozen=True)
class LossNormalizer:
    """Denominators of the *global* batch of one optimizer step.

    Attributes:
        num_tokens: real response tokens (mask == 1) in the whole global batch.
        num_seqs: sequences with at least one real token in the whole global batch.

    Build one per micro-batch with :func:`compute_loss_normalizer`, then add them up over
    micro-batches (``a + b``) and all-reduce over DP ranks (``to_tensor`` / ``from_tensor``).
    """

    num_tokens: float
    num_seqs: float

    def __post_init__(self) -> None:
        check_positive("LossNormalizer.num_tokens", self.num_tokens, allow_zero=True)
        check_positive("LossNormalizer.num_seqs", self.num_seqs, allow_zero=True)

    def __add__(self, other: LossNormalizer) -> LossNormalizer:
        return LossNormalizer(self.num_tokens + other.num_tokens, self.num_seqs + other.num_seqs)

    def to_tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``[num_tokens, num_seqs]`` as float64, ready for a SUM all-reduce."""
        return torch.tensor([self.num_tokens, self.num_seqs], dtype=torch.float64, device=device)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> LossNormalizer:
        """Inverse of :meth:`to_tensor` (one host sync)."""
        num_tokens, num_seqs = t.detach().to("cpu", torch.float64).tolist()
        return cls(num_tokens, num_seqs)


def compute_loss_normalizer(response_mask: torch.Tensor) -> LossNormalizer:
    """Count the local contribution to the global :class:`LossNormalizer`.

    Args:
        response_mask: ``(bs, T)``; 1 = real response token, 0 = padding.

    Returns:
        Token count and non-empty-sequence count of this piece (sum them over all pieces).
    """
    mask = validated_mask(response_mask)
    counts = torch.stack([mask.sum(), mask.any(dim=-1).sum()]).tolist()
    return LossNormalizer(float(counts[0]), float(counts[1]))


@AGGREGATION_MODES.register("token-mean")
def _token_mean(
    loss: torch.Tensor, mask: torch.Tensor, n: LossNormalizer, scale: float
) -> torch.Tensor:
    return loss.sum() / max(n.num_tokens, 1.0)


@AGGREGATION_MODES.register("token-sum")
def _token_sum(
    loss: torch.Tensor, mask: torch.Tensor, n: LossNormalizer, scale: float
) -> torch.Tensor:
    return loss.sum()


@AGGREGATION_MODES.register("seq-mean-token-sum")
def _seq_mean_token_sum(
    loss: torch.Tensor, mask: torch.Tensor, n: LossNormalizer, scale: float
) -> torch.Tensor:
    return loss.sum() / max(n.num_seqs, 1.0)


@AGGREGATION_MODES.register("seq-mean-token-mean")
def _seq_mean_token_mean(
    loss: torch.Tensor, mask: torch.Tensor, n: LossNormalizer, scale: float
) -> torch.Tensor:
    per_seq = loss.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1).to(loss.dtype)  # empty row -> 0
    return per_seq.sum() / max(n.num_seqs, 1.0)


@AGGREGATION_MODES.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(
    loss: torch.Tensor, mask: torch.Tensor, n: LossNormalizer, scale: float
) -> torch.Tensor:
    return loss.sum() / (max(n.num_seqs, 1.0) * scale)


@dataclass(frozen=True)
class LossAggregation:
    """How one micro-batch's per-token losses become its share of the global loss.

    Attributes:
        mode: one of ``AGGREGATION_MODES.names()``.
        normalizer: the global batch's :class:`LossNormalizer`; ``None`` uses the micro-batch's
            own counts (correct only when the micro-batch *is* the whole global batch).
        loss_scale_factor: ``seq-mean-token-sum-norm`` only; ``None`` means ``mask.shape[-1]``.
    """

    mode: str = "token-mean"
    normalizer: LossNormalizer | None = None
    loss_scale_factor: float | None = None

    def __post_init__(self) -> None:
        AGGREGATION_MODES.get(self.mode)  # unknown mode -> UnknownNameError listing the modes
        if self.loss_scale_factor is not None:
            check_positive("loss_scale_factor", self.loss_scale_factor)

    def apply(self, loss_mat: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
        """Validate the inputs and aggregate; see :func:`aggregate_loss`."""
        mask = validated_mask(response_mask, loss_mat=loss_mat)
        return self.apply_validated(loss_mat, mask)

    def apply_validated(self, loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Aggregate without re-validating; ``mask`` must be the bool mask of ``validated_mask``."""
        normalizer = self.normalizer
        if normalizer is None:
            counts = torch.stack([mask.sum(), mask.any(dim=-1).sum()]).tolist()
            normalizer = LossNormalizer(float(counts[0]), float(counts[1]))
        scale = self.loss_scale_factor if self.loss_scale_factor is not None else mask.shape[-1]
        fn = AGGREGATION_MODES.get(self.mode)
        return fn(zero_padding(loss_mat, mask), mask, normalizer, float(scale))


def aggregate_loss(
    loss_mat: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str = "token-mean",
    normalizer: LossNormalizer | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss matrix into this piece's share of the global loss.

    Args:
        loss_mat: ``(bs, T)`` per-token loss (may require grad); padding positions are ignored,
            whatever they hold.
        response_mask: ``(bs, T)``; 1 = real response token, 0 = padding.
        mode: ``token-mean`` | ``token-sum`` | ``seq-mean-token-sum`` | ``seq-mean-token-mean``
            | ``seq-mean-token-sum-norm`` (see the module docstring for the formulas).
        normalizer: global :class:`LossNormalizer`; ``None`` = this piece is the whole batch.
        loss_scale_factor: ``seq-mean-token-sum-norm`` only; default ``T``.

    Returns:
        0-dim tensor. Summing it over every micro-batch and DP rank gives the single-batch loss.

    Follows verl ``core_algos.agg_loss``; ``seq-mean-token-sum-norm`` is Dr. GRPO's constant
    normaliser (Liu et al. 2025, "Understanding R1-Zero-Like Training").
    """
    agg = LossAggregation(mode, normalizer, loss_scale_factor)
    return agg.apply(loss_mat, response_mask)
