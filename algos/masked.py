"""Masked reductions over padded (batch, time) tensors.

Every tensor here is a padded batch: ``values`` of shape (B, T) (or any shape) and a ``mask`` of
the same shape with 1 where a position is real (a response token) and 0 where it is padding.
Padded positions never contribute, even when they hold NaN or inf: they are selected away with
``torch.where`` instead of being multiplied by zero.
"""

from __future__ import annotations

import torch

__all__ = ["masked_sum", "masked_mean", "masked_var", "masked_whiten"]

WHITEN_EPS = 1e-8


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values * mask``.

    Args:
        values: (B, T) or any shape.
        mask: same shape as ``values``; 0/1 (bool or numeric). A non-binary mask acts as weights.
        dim: reduce over this dimension; ``None`` reduces over all elements.

    Returns:
        a scalar tensor when ``dim`` is None, otherwise ``values`` with ``dim`` removed
        (e.g. (B,) for ``dim=-1`` on (B, T)).
    """
    weighted = torch.where(mask != 0, values * mask, 0.0)
    if dim is None:
        return weighted.sum()
    return weighted.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over the positions where ``mask`` is set.

    Args:
        values: (B, T) or any shape.
        mask: same shape as ``values``.
        dim: reduce over this dimension; ``None`` reduces over all elements.

    Returns:
        scalar (``dim=None``) or ``values`` with ``dim`` removed. A reduction that sees no valid
        position returns 0 (not NaN), so an empty row or an empty batch is harmless.
    """
    total = masked_sum(values, mask, dim)
    count = mask.to(total.dtype)
    count = count.sum() if dim is None else count.sum(dim=dim)
    return total / count.clamp(min=1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` over the masked positions (all of them together).

    Args:
        values: (B, T) or any shape.
        mask: same shape as ``values``.
        unbiased: apply Bessel's correction n / (n - 1), n = number of valid positions.

    Returns:
        scalar tensor. With fewer than two valid positions the unbiased variance is undefined;
        it is returned as 0 (there is no spread to measure) instead of raising, so whitening a
        single token yields 0 rather than NaN.
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.to(variance.dtype).sum()
        if count < 2:
            return torch.zeros_like(variance)
        variance = variance * count / (count - 1)
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise ``values`` to zero mean and unit variance over the masked positions.

    ``(values - mean) / sqrt(var + 1e-8)`` with the masked mean and unbiased masked variance.
    With ``shift_mean=False`` the mean is added back (only the scale changes).

    Args:
        values: (B, T) or any shape.
        mask: same shape as ``values``.
        shift_mean: subtract the mean (True) or keep it (False).

    Returns:
        same shape as ``values``; 0 wherever ``mask`` is 0.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=True)
    whitened = (values - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask != 0, whitened, 0.0)
