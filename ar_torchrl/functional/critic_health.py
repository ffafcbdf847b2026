"""The critic's out-of-sample health: Monte-Carlo returns, position thirds, explained variance.

verl's ``critic/vf_explained_var`` asks whether the critic *predicts*: the values it gave a fresh
batch before training on it (the anchors, ``state_value``), against what then happened, the
Monte-Carlo return of each trained token (``lambda = 1``: the discounted sum of the rewards from that
token on). :func:`monte_carlo_returns` computes those returns along the trained tokens of each row
(tool and prompt tokens consume no step, as in :func:`~ar_torchrl.functional.token_gae`),
:func:`position_thirds` says which third of its row's trained tokens each token is in (the thirds of
:func:`~ar_torchrl.recipes.ceiling.ceiling_from_trajectories`, so a third's EV can be quoted against
that third's ceiling), and :func:`explained_variance_or_nan` is ``1 - Var(R - V) / Var(R)`` that is
*undefined* (``nan``) when the returns do not vary, never a huge negative number.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ar_torchrl.functional._shapes import _check_mask
from ar_torchrl.functional.gae import token_gae

__all__ = ["explained_variance_or_nan", "monte_carlo_returns", "position_thirds"]

#: The relative size below which a variance counts as zero: float32's machine epsilon times the
#: mean square (the rule of :func:`~ar_torchrl.functional.explained_variance` and the loss metrics).
FLAT_EPS = float(torch.finfo(torch.float32).eps)


def monte_carlo_returns(reward: Tensor, loss_mask: Tensor, *, gamma: float) -> Tensor:
    """The Monte-Carlo return of every trained token: ``R_t = sum_{k >= 0} gamma^k r_{t_k}`` over
    the trained tokens ``t = t_0 < t_1 < ...`` of its row from ``t`` on (masked tokens consume no
    step); 0 at masked positions. :func:`~ar_torchrl.functional.token_gae` with ``lambda = 1`` and
    ``V = 0`` (no bootstrap: every row is an episode that ended).

    Args:
        reward: ``[B, L]`` per-token reward, 0 off ``loss_mask`` (the trajectory layout's rule).
        loss_mask: ``[B, L]`` bool, the trained tokens.
        gamma: discount in ``[0, 1]`` (per trained token).

    Returns:
        ``[B, L]`` in ``reward``'s dtype.

    Example:
        >>> r = torch.tensor([[0.0, 0.5, 0.0, 1.0]]); m = torch.tensor([[False, True, False, True]])
        >>> monte_carlo_returns(r, m, gamma=0.5).tolist()
        [[0.0, 1.0, 0.0, 1.0]]
    """
    returns, _ = token_gae(reward, torch.zeros_like(reward), loss_mask, gamma=gamma, lmbda=1.0)
    return returns


def position_thirds(loss_mask: Tensor) -> Tensor:
    """Which third of its row's trained tokens each token is: 0 (early), 1 (middle), 2 (late);
    -1 off ``loss_mask``. Token ``i`` (0-based) of a row's ``n`` trained tokens is in third
    ``floor(3 i / n)`` (a row of 1 or 2 trained tokens leaves a third empty).

    Args:
        loss_mask: ``[B, L]`` bool.

    Returns:
        ``[B, L]`` int64.

    Example:
        >>> position_thirds(torch.tensor([[False, True, True, True, True, False]])).tolist()
        [[-1, 0, 0, 1, 2, -1]]
    """
    if loss_mask.ndim != 2 or loss_mask.dtype != torch.bool:
        raise ValueError(
            f"position_thirds: loss_mask must be a bool [B, L] tensor, got shape "
            f"{tuple(loss_mask.shape)} and dtype {loss_mask.dtype}"
        )
    index = loss_mask.long().cumsum(-1) - 1
    count = loss_mask.sum(-1, keepdim=True).clamp_min(1)
    third = (3 * index).div(count, rounding_mode="floor").clamp(0, 2)
    return torch.where(loss_mask, third, -1)


def explained_variance_or_nan(value: Tensor, target: Tensor, mask: Tensor) -> Tensor:
    """``1 - Var(R - V) / Var(R)`` over ``mask`` (population variances, float64), or ``nan`` where
    it is undefined: no element, or returns that do not vary (``Var(R) <= eps * mean(R^2)``,
    ``eps`` float32's machine epsilon). Unlike :func:`~ar_torchrl.functional.explained_variance`
    (scikit-learn's finite convention, a curve to plot) the caller sees that nothing was measured.

    Args:
        value: the prediction ``V``; target: the return ``R``; mask: bool; one shape ``S`` each.

    Returns:
        a float64 scalar.

    Example:
        >>> m = torch.ones(4, dtype=torch.bool)
        >>> explained_variance_or_nan(torch.tensor([0.0, 0.0, 1.0, 1.0]),
        ...                           torch.tensor([0.0, 1.0, 1.0, 2.0]), m).item()
        0.5
        >>> explained_variance_or_nan(torch.zeros(4), torch.ones(4), m).item()
        nan
    """
    _check_mask(mask, target, "target")
    _check_mask(mask, value, "value")
    r = target.detach().double()[mask]
    resid = r - value.detach().double()[mask]
    if r.numel() == 0:
        return torch.tensor(float("nan"), dtype=torch.float64, device=target.device)
    var_r = r.var(unbiased=False)
    flat = var_r <= FLAT_EPS * (r * r).mean()
    ev = 1.0 - resid.var(unbiased=False) / torch.where(flat, torch.ones_like(var_r), var_r)
    return torch.where(flat, torch.full_like(ev, float("nan")), ev)
