"""Loss aggregation: hand-computed modes, empty sequences, and layout independence."""

from __future__ import annotations

import pytest
import torch

from rlhf_megatron.algorithms import (
    AGGREGATION_MODES,
    InvalidConfigError,
    LossAggregation,
    LossNormalizer,
    NonFiniteInputError,
    aggregate_loss,
    compute_loss_normalizer,
)

F64 = torch.float64
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], dtype=F64)
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # the last sequence is empty


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("token-sum", 7.0),  # 1 + 2 + 4, no denominator
        ("seq-mean-token-sum", 7 / 2),  # (3 + 4) / 2 non-empty sequences
        ("seq-mean-token-mean", (1.5 + 4) / 2),
        ("seq-mean-token-sum-norm", 7 / (2 * 3)),  # scale factor defaults to T = 3
    ],
)
def test_modes_by_hand_with_an_empty_sequence(mode: str, expected: float) -> None:
    assert aggregate_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_seq_mean_token_sum_norm_uses_the_given_scale_factor() -> None:
    loss = aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_scale_factor=7)
    assert loss.item() == pytest.approx(7 / (2 * 7))
    with pytest.raises(InvalidConfigError, match="loss_scale_factor"):
        LossAggregation("seq-mean-token-sum-norm", loss_scale_factor=0)


def test_normalizer_counts_tokens_and_non_empty_sequences() -> None:
    n = compute_loss_normalizer(MASK)
    assert (n.num_tokens, n.num_seqs) == (3.0, 2.0)
    total = n + compute_loss_normalizer(torch.ones(2, 5))
    assert (total.num_tokens, total.num_seqs) == (13.0, 4.0)
    assert LossNormalizer.from_tensor(total.to_tensor()) == total
    with pytest.raises(InvalidConfigError):
        LossNormalizer(-1.0, 1.0)


def test_token_sum_ignores_the_normalizer_and_sums_every_real_token() -> None:
    """token-sum's global loss is the plain sum over the global batch: each piece adds its own
    sum and the normaliser's counts are not read."""
    n = LossNormalizer(num_tokens=14.0, num_seqs=8.0)
    assert aggregate_loss(LOSS, MASK, "token-sum", n).item() == pytest.approx(7.0)
    leaf = LOSS.clone().requires_grad_(True)
    aggregate_loss(leaf, MASK, "token-sum", n).backward()
    torch.testing.assert_close(leaf.grad, MASK.to(F64))  # d(sum)/d(loss_t) = 1 per real token


def test_explicit_global_normalizer_is_used() -> None:
    n = LossNormalizer(num_tokens=14.0, num_seqs=8.0)
    assert aggregate_loss(LOSS, MASK, "token-mean", n).item() == pytest.approx(7 / 14)
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-mean", n).item() == pytest.approx(5.5 / 8)


@pytest.mark.parametrize("mode", AGGREGATION_MODES.names())
def test_all_empty_batch_gives_zero_not_nan(mode: str) -> None:
    loss_mat = LOSS.clone().requires_grad_(True)
    loss = aggregate_loss(loss_mat, torch.zeros(3, 3), mode)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.all(loss_mat.grad == 0)


def _random_batch(seed: int, bs: int = 8, width: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, width + 1, (bs,), generator=g)
    lengths[1] = 0  # always at least one empty sequence
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    return torch.randn(bs, width, generator=g, dtype=F64), mask


def _sharded_loss_and_grad(
    loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, pieces: int, seed: int
) -> tuple[float, torch.Tensor]:
    """Shuffle the rows, cut them into `pieces` uneven micro-batches/ranks and sum the losses."""
    leaf = loss_mat.clone().requires_grad_(True)
    order = torch.randperm(len(mask), generator=torch.Generator().manual_seed(seed))
    cuts = sorted(
        torch.randperm(len(mask) - 1, generator=torch.Generator().manual_seed(seed))[: pieces - 1]
        + 1
    )
    chunks = torch.tensor_split(order, [int(c) for c in cuts])
    # the engine's job: count each piece, sum over micro-batches and all-reduce over ranks
    normalizer = sum(
        (compute_loss_normalizer(mask[idx]) for idx in chunks[1:]),
        compute_loss_normalizer(mask[chunks[0]]),
    )
    total = sum(aggregate_loss(leaf[idx], mask[idx], mode, normalizer) for idx in chunks)
    total.backward()
    return float(total), leaf.grad


@pytest.mark.parametrize("mode", AGGREGATION_MODES.names())
@pytest.mark.parametrize("seed", range(4))
def test_any_split_into_micro_batches_or_ranks_gives_the_same_loss_and_grad(
    mode: str, seed: int
) -> None:
    loss_mat, mask = _random_batch(seed)
    reference, ref_grad = _sharded_loss_and_grad(loss_mat, mask, mode, 1, seed)
    assert reference == pytest.approx(aggregate_loss(loss_mat, mask, mode).item(), rel=1e-12)
    for pieces in (2, 4):
        value, grad = _sharded_loss_and_grad(loss_mat, mask, mode, pieces, seed + 100)
        assert value == pytest.approx(reference, rel=1e-12, abs=1e-12)
        torch.testing.assert_close(grad, ref_grad)


def test_local_normalisation_would_not_be_layout_independent() -> None:
    """Guard that the property above is not vacuous: per-piece means differ from the global."""
    loss_mat, mask = _random_batch(0)
    whole = aggregate_loss(loss_mat, mask, "token-mean").item()
    halves = [
        aggregate_loss(loss_mat[s], mask[s], "token-mean").item()
        for s in (slice(0, 4), slice(4, 8))
    ]
    assert sum(halves) / 2 != pytest.approx(whole)


@pytest.mark.parametrize("mode", AGGREGATION_MODES.names())
@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), -1e30])
def test_padding_never_changes_loss_or_grad(mode: str, garbage: float) -> None:
    loss_mat, mask = _random_batch(7)
    clean = loss_mat.clone().requires_grad_(True)
    aggregate_loss(clean, mask, mode).backward()
    dirty = torch.where(mask.bool(), loss_mat, torch.full_like(loss_mat, garbage)).requires_grad_(
        True
    )
    loss = aggregate_loss(dirty, mask, mode)
    loss.backward()
    assert loss.item() == pytest.approx(aggregate_loss(loss_mat, mask, mode).item())
    torch.testing.assert_close(dirty.grad, clean.grad)
    assert torch.all(dirty.grad[~mask.bool()] == 0)


def test_non_finite_real_loss_is_a_typed_error() -> None:
    bad = LOSS.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(NonFiniteInputError, match="loss_mat"):
        aggregate_loss(bad, MASK)
