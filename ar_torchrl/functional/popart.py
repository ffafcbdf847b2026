"""PopArt: value targets normalised by running statistics, with the output layer rescaled so that
predictions are preserved when the statistics change (van Hasselt et al. 2016, "Learning values
across many orders of magnitude", https://arxiv.org/abs/1602.07714).

The head predicts a normalised value ``n = w . h + b``; the value is ``V = sigma * n + mu``. When
the statistics move from ``(mu, sigma)`` to ``(mu', sigma')``, the layer becomes
``w' = w * sigma / sigma'``, ``b' = (sigma * b + mu - mu') / sigma'`` ("preserving outputs
precisely"), so ``sigma' * (w' . h + b') + mu' == sigma * (w . h + b) + mu`` for every ``h``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["popart_rescale", "popart_scale_shift", "popart_sigma", "popart_statistics"]


def popart_statistics(
    mu: Tensor, nu: Tensor, targets: Tensor, *, beta: float, first: bool = False
) -> tuple[Tensor, Tensor]:
    """The running first and second moments after one batch of targets.

    ``mu' = (1 - beta) mu + beta mean(t)``, ``nu' = (1 - beta) nu + beta mean(t^2)``; ``first``
    (no statistics yet) takes the batch's moments as they are.

    Args:
        mu, nu: scalar tensors (float64 recommended); targets: ``[N]`` float (the trained tokens'
            value targets), ``N >= 1``.
        beta: the step size in ``(0, 1]``.

    Example:
        >>> mu, nu = popart_statistics(torch.tensor(0.0), torch.tensor(1.0), torch.tensor([1.0, 3.0]), beta=0.5)
        >>> mu.item(), nu.item()
        (1.0, 3.0)
    """
    if targets.ndim != 1 or targets.numel() == 0:
        raise ValueError(
            f"popart_statistics: targets must be a non-empty 1-D tensor, got shape "
            f"{tuple(targets.shape)}"
        )
    if not 0 < beta <= 1:
        raise ValueError(f"popart_statistics: beta must be in (0, 1], got {beta}")
    t = targets.detach().to(mu.dtype)
    m, s = t.mean(), (t * t).mean()
    if first:
        return m, s
    return (1 - beta) * mu + beta * m, (1 - beta) * nu + beta * s


def popart_sigma(mu: Tensor, nu: Tensor, *, eps: float = 1e-4) -> Tensor:
    """``sqrt(max(nu - mu^2, eps^2))``: the running standard deviation, floored at ``eps``.

    Example:
        >>> popart_sigma(torch.tensor(1.0), torch.tensor(5.0)).item()
        2.0
    """
    return torch.sqrt(torch.clamp(nu - mu * mu, min=eps * eps))


def popart_rescale(
    weight: Tensor, bias: Tensor, mu: Tensor, sigma: Tensor, new_mu: Tensor, new_sigma: Tensor
) -> tuple[Tensor, Tensor]:
    """The output layer that gives the same values under the new statistics.

    Args:
        weight: ``[1, H]``; bias: ``[1]``; the statistics: scalar tensors.

    Returns:
        ``(weight', bias')`` with ``weight' = weight * sigma / sigma'`` and
        ``bias' = (sigma * bias + mu - mu') / sigma'``, in the layer's dtype.

    Example:
        >>> w, b = torch.tensor([[2.0]]), torch.tensor([1.0])
        >>> w2, b2 = popart_rescale(w, b, torch.tensor(0.0), torch.tensor(1.0), torch.tensor(1.0), torch.tensor(2.0))
        >>> h = torch.tensor([3.0])
        >>> (1.0 * (w @ h + b) + 0.0).item(), (2.0 * (w2 @ h + b2) + 1.0).item()
        (7.0, 7.0)
    """
    scale, shift = popart_scale_shift(mu, sigma, new_mu, new_sigma)
    return weight * scale, bias * scale + shift


def popart_scale_shift(
    mu: Tensor, sigma: Tensor, new_mu: Tensor, new_sigma: Tensor
) -> tuple[float, float]:
    """``(sigma / sigma', (mu - mu') / sigma')`` as Python floats (computed in the statistics'
    dtype): ``w' = w * scale``, ``b' = b * scale + shift`` (plain floats also scale sharded DTensor
    parameters in place).

    Example:
        >>> popart_scale_shift(torch.tensor(0.0), torch.tensor(1.0), torch.tensor(1.0), torch.tensor(2.0))
        (0.5, -0.5)
    """
    return float(sigma / new_sigma), float((mu - new_mu) / new_sigma)
