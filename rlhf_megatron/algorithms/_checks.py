"""Input validation shared by the algorithms (private).

Conventions checked here, once per public call:
  * ``response_mask`` is 2-D ``(bs, T)``, holding only 0 and 1 (any dtype; bool allowed);
    1 = real response token, 0 = padding (or a non-trainable token such as a tool observation).
  * every token tensor has the mask's shape, every per-sequence tensor has shape ``(bs,)``.
  * no NaN/inf at a real position (per-sequence tensors: in a sequence with >= 1 real token).
    Padding positions may hold anything: callers zero them with :func:`zero_padding` before use.
All checks of one call share a single device->host synchronisation.
"""

from __future__ import annotations

import torch

from rlhf_megatron.algorithms.errors import (
    InvalidConfigError,
    InvalidMaskError,
    NonFiniteInputError,
    ShapeMismatchError,
)


def validated_mask(
    response_mask: torch.Tensor, *, token_dims: int | None = 2, **tensors: torch.Tensor | None
) -> torch.Tensor:
    """Check ``response_mask`` and the named tensors; return the mask as a bool tensor.

    ``token_dims=2`` requires the ``(bs, T)`` layout and also accepts per-sequence ``(bs,)``
    tensors; ``token_dims=None`` accepts a mask of any shape, with tensors of exactly that shape.
    """
    if not isinstance(response_mask, torch.Tensor):
        raise ShapeMismatchError(
            f"response_mask must be a torch.Tensor, got {type(response_mask).__name__}"
        )
    if token_dims is not None and response_mask.dim() != token_dims:
        raise ShapeMismatchError(
            f"response_mask must be a 2-D (bs, T) tensor, got shape {tuple(response_mask.shape)}"
        )
    row_shape = tuple(response_mask.shape[:1]) if token_dims is not None else None
    present = {name: t for name, t in tensors.items() if t is not None}
    for name, t in present.items():
        if not isinstance(t, torch.Tensor):
            raise ShapeMismatchError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.shape != response_mask.shape and tuple(t.shape) != row_shape:
            expected = f"{tuple(response_mask.shape)}" + (f" or {row_shape}" if row_shape else "")
            raise ShapeMismatchError(
                f"{name} has shape {tuple(t.shape)}; expected {expected} to match response_mask"
            )

    if response_mask.dtype == torch.bool:
        mask = response_mask
        flags = [torch.zeros((), dtype=torch.bool, device=mask.device)]
    else:
        flags = [((response_mask != 0) & (response_mask != 1)).any()]
        mask = response_mask != 0
    names = []
    for name, t in present.items():
        where = mask if t.shape == mask.shape else mask.any(dim=-1)
        flags.append((~torch.isfinite(t.detach()) & where).any().to(mask.device))
        names.append(name)

    bad = torch.stack(flags).tolist()  # the one device->host sync of the call
    if bad[0]:
        raise InvalidMaskError("response_mask must hold only 0 and 1 (1 = real response token)")
    for name, is_bad in zip(names, bad[1:], strict=True):
        if is_bad:
            raise NonFiniteInputError(f"{name} holds NaN or inf at a real (mask == 1) position")
    return mask


def zero_padding(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` with padding positions replaced by 0 (NaN-safe, unlike ``x * mask``).

    Sanitising inputs *before* any arithmetic keeps garbage in padding from reaching a value or a
    gradient: ``torch.where`` gives the padding positions an exact zero gradient.
    """
    if x.shape != mask.shape:  # a per-sequence (bs,) tensor against a (bs, T) mask
        mask = mask.any(dim=-1)
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def check_positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    """Raise ``InvalidConfigError`` unless ``value`` is finite and > 0 (or >= 0)."""
    ok = value == value and abs(value) != float("inf") and (value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise InvalidConfigError(f"{name} must be a finite number {bound}, got {value!r}")
