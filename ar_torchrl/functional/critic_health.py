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
:func:`explained_variance_within_groups` is the same after removing each prompt's mean from both:
what the critic knows beyond the prompt, i.e. whether it reads the response (a critic that only
knows how hard each prompt is scores exactly 0 there).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ar_torchrl.functional._shapes import _check_mask
from ar_torchrl.functional.gae import token_gae

__all__ = [
    "explained_variance_or_nan",
    "explained_variance_within_groups",
    "monte_carlo_returns",
    "position_thirds",
]

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


def explained_variance_within_groups(value: Tensor, target: Tensor, groups: Tensor) -> Tensor:
    """The explained variance left after each group's mean is removed from both ``V`` and ``R``:
    ``1 - Var(R' - V') / Var(R')`` with ``R' = R - mean_g R`` and ``V' = V - mean_g V`` (means over
    the items of each item's group ``g``, population variances, float64); ``nan`` where undefined
    (no item, or ``R'`` does not vary: every group's returns are constant, e.g. one sample per
    prompt with an outcome reward).

    With one group per prompt this is what the critic knows *beyond the prompt*: a critic whose
    value depends on the prompt alone has ``V' = 0`` and scores exactly 0; one that reads the
    response (a wrong step, a failed tool call) scores above 0. Its ceiling is
    ``1 - E[Var(R | s)] / E[Var(R | prompt)]`` (``within_prompt`` of
    :func:`~ar_torchrl.recipes.ceiling.ceiling_from_trajectories`).

    Args:
        value: ``[N]`` float, the prediction of each item (a trained token's value).
        target: ``[N]`` float, its return.
        groups: ``[N]`` int, the group of each item (equal ids: one group, e.g. the prompt id of the
            token's row).

    Returns:
        a float64 scalar.

    Example:
        >>> r = torch.tensor([1.0, -1.0, 1.0, 1.0]); g = torch.tensor([0, 0, 1, 1])
        >>> explained_variance_within_groups(torch.tensor([0.5, 0.5, 0.9, 0.9]), r, g).item()  # prompt only
        0.0
        >>> round(explained_variance_within_groups(torch.tensor([0.8, -0.8, 0.0, 0.0]), r, g).item(), 6)
        0.96
    """
    for name, t in (("value", value), ("target", target), ("groups", groups)):
        if t.ndim != 1:
            raise ValueError(
                f"explained_variance_within_groups: {name} must be 1-D [N] (the selected items), "
                f"got shape {tuple(t.shape)}"
            )
    if not value.shape == target.shape == groups.shape:
        raise ValueError(
            "explained_variance_within_groups: value, target and groups must have one shape [N], "
            f"got {tuple(value.shape)}, {tuple(target.shape)} and {tuple(groups.shape)}"
        )
    if groups.dtype.is_floating_point or groups.dtype == torch.bool:
        raise TypeError(
            f"explained_variance_within_groups: groups must be an integer tensor (a group id per "
            f"item), got dtype {groups.dtype}"
        )
    if value.numel() == 0:
        return torch.tensor(float("nan"), dtype=torch.float64, device=target.device)
    _, inverse = torch.unique(groups, return_inverse=True)
    num = int(inverse.max()) + 1
    r, v = target.detach().double(), value.detach().double()
    count = torch.zeros(num, dtype=torch.float64, device=r.device).index_add_(
        0, inverse, torch.ones_like(r)
    )

    def centred(x: Tensor) -> Tensor:
        sums = torch.zeros(num, dtype=torch.float64, device=x.device).index_add_(0, inverse, x)
        return x - (sums / count)[inverse]

    rc, vc = centred(r), centred(v)
    # R' has mean 0, so "R' does not vary" compares its variance with the raw returns' mean square
    var_r = rc.var(unbiased=False)
    flat = var_r <= FLAT_EPS * (r * r).mean()
    ev = 1.0 - (rc - vc).var(unbiased=False) / torch.where(flat, torch.ones_like(var_r), var_r)
    return torch.where(flat, torch.full_like(ev, float("nan")), ev)
