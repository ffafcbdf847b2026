"""Masked reductions: mean, variance, whitening, explained variance (``[B, L]`` + bool mask)."""

from __future__ import annotations

import torch
from torch import Tensor

from ar_torchrl.functional._shapes import _check_mask

__all__ = ["explained_variance", "masked_mean", "masked_var", "masked_whiten"]


# ----------------------------------------------------------------------------- masked reductions
def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is True (0 where nothing is selected).

    Args:
        x: any shape ``S``.
        mask: bool, shape ``S`` (no broadcasting).
        dim: reduce over this dim only (``None``: over everything).

    Example:
        >>> x = torch.tensor([[1.0, 2.0, 100.0]]); m = torch.tensor([[True, True, False]])
        >>> masked_mean(x, m).item()
        1.5
    """
    _check_mask(mask, x, "x")
    total = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    if dim is None:
        return total.sum() / mask.sum().clamp_min(1)
    return total.sum(dim) / mask.sum(dim).clamp_min(1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over ``mask`` (scalar); Bessel-corrected when ``unbiased`` and n > 1."""
    mean = masked_mean(x, mask)
    sq = masked_mean((x - mean) ** 2, mask)
    n = mask.sum()
    if unbiased and n > 1:
        sq = sq * n / (n - 1)
    return sq


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise ``x`` to zero mean / unit variance over ``mask``; 0 at masked positions.

    ``(x - mean) / sqrt(var + eps)`` with mean and the **unbiased** (Bessel-corrected, ``n - 1``)
    variance over the masked elements only. With ``shift_mean=False`` the mean is added back
    (scale-only whitening).

    Why unbiased: verl's and TRL's ``masked_whiten``, NeMo-RL, and TorchRL's own advantage
    normalisation (``advantage.std()`` in ``ClipPPOLoss``) all divide by ``n - 1``; using the same
    estimator makes whitened advantages comparable number for number with those implementations. The
    difference is a factor ``sqrt((n - 1) / n)`` on the result (0.07 % for 700 trained tokens). With a
    single trained element the variance is taken as 0, so the result is 0 there (never NaN).

    Args:
        x: any shape ``S``; mask: bool, shape ``S``.

    Example:
        >>> x = torch.tensor([1.0, 3.0, 1e6]); m = torch.tensor([True, True, False])
        >>> [round(v, 4) for v in masked_whiten(x, m).tolist()]
        [-0.7071, 0.7071, 0.0]
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask, out, torch.zeros((), dtype=out.dtype, device=out.device))


def explained_variance(value: Tensor, target: Tensor, mask: Tensor) -> Tensor:
    """``1 - Var[target - value] / Var[target]`` over ``mask`` (a finite scalar, always).

    A constant target (``Var[target] == 0``: e.g. one trained token, or every return equal) would
    give ``-inf`` or ``nan``. The convention is scikit-learn's ``explained_variance_score(...,
    force_finite=True)``: then the result is ``1.0`` if the residual ``target - value`` is constant
    too (a perfect prediction up to a shift, which explained variance ignores anyway), else ``0.0``.
    With no trained token it is ``0.0``. A variance counts as zero when it is below the dtype's
    ``eps`` times the mean square (so rounding in the mean of a constant does not count as spread).
    CleanRL and Stable-Baselines3 return ``nan`` here, verl and TorchRL add an epsilon to the
    denominator (a huge negative number); both would poison a logged curve.

    Args:
        value, target: ``[B, L]`` (any shape ``S``); mask: bool, shape ``S``.

    Example:
        >>> v = torch.tensor([1.0, 2.0, 9.0]); t = torch.tensor([1.0, 2.0, -9.0])
        >>> explained_variance(v, t, torch.tensor([True, True, False])).item()
        1.0
        >>> explained_variance(torch.tensor([0.0, 1.0]), torch.ones(2), torch.ones(2, dtype=torch.bool)).item()
        0.0
    """
    err = target - value
    var_t, var_err = masked_var(target, mask, False), masked_var(err, mask, False)
    eps = torch.finfo(var_t.dtype).eps
    flat_t = var_t <= eps * masked_mean(target * target, mask)
    flat_err = var_err <= eps * masked_mean(err * err, mask)
    ratio = var_err / torch.where(flat_t, torch.ones_like(var_t), var_t)
    out = torch.where(flat_t, flat_err.to(var_t.dtype), 1.0 - ratio)
    return torch.where(mask.any(), out, torch.zeros_like(out))
