"""REINFORCE++ advantages over ``[B, L]`` rows: Monte-Carlo returns whitened over the whole batch."""

from __future__ import annotations

import torch
from torch import Tensor

from ar_torchrl.functional.gae import check_gae_inputs, token_gae
from ar_torchrl.functional.reductions import masked_whiten
from ar_torchrl.utils.checks import check_number

__all__ = ["reinforce_pp_advantage"]


def reinforce_pp_advantage(
    reward: Tensor,
    loss_mask: Tensor,
    *,
    gamma: float = 1.0,
    policy_mask: Tensor | None = None,
    eps: float = 1e-8,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu et al. 2025, https://arxiv.org/abs/2501.03262): no critic, no groups.

    Per row, backwards over the trained tokens (``loss_mask`` True; masked tokens consume no step
    and the return carries across them, as in :func:`token_gae`)::

        G_t = r_t + gamma * G_next            (G after the row's last trained token: 0)
        A_t = (G_t - mean_T G) / sqrt(var_T G + eps)

    where ``T`` is every trained token of the batch (``loss_mask & policy_mask``) and ``var`` is
    the unbiased (``n - 1``) variance (:func:`masked_whiten`). The baseline is the batch mean of
    the returns, so any number of samples per prompt works (one included). Per-token rewards
    (a KL penalty, per-turn rewards) enter ``G`` where they sit.

    Matches verl's ``compute_reinforce_plus_plus_outcome_advantage`` (whitening with mean shift,
    ``eps`` inside the square root, Bessel-corrected variance) on rows whose trained tokens are one
    run. Departure, multi-turn rows: verl zeroes the running return at every masked token, so a
    turn before a tool output gets only its own turn's rewards; here the outcome reaches every
    turn (verl's GAE with an observation mask and :func:`token_gae` carry across the same way).

    Args:
        reward: ``[B, L]`` per-token reward; must be 0 wherever ``loss_mask`` is False.
        loss_mask: ``[B, L]`` bool, True on trained tokens.
        gamma: discount per trained token, in ``[0, 1]``.
        policy_mask: ``[B, L]`` bool or ``None``; tokens outside it (rows kept for a critic only)
            get advantage 0 and do not enter the whitening statistics (their returns are kept).
        eps: added to the variance, ``>= 0``.

    Returns:
        ``(advantage [B, L], returns [B, L])``, both 0 at masked positions; ``returns`` are the
        Monte-Carlo value targets.

    Raises:
        ValueError: mismatched shapes, a NaN/inf reward (naming its row and position), a non-zero
            reward on a masked token, ``gamma`` outside ``[0, 1]`` or ``eps < 0``.

    Example:
        >>> r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
        >>> m = torch.tensor([[False, True, True], [False, True, True]])
        >>> adv, ret = reinforce_pp_advantage(r, m, gamma=0.5)
        >>> ret.tolist()
        [[0.0, 0.5, 1.0], [0.0, 0.0, 0.0]]
        >>> [[round(a, 4) for a in row] for row in adv.tolist()]
        [[0.0, 0.2611, 1.3056], [0.0, -0.7833, -0.7833]]
    """
    owner = "reinforce_pp_advantage"
    check_gae_inputs(reward, torch.zeros_like(reward), loss_mask, owner)
    check_number(owner, "gamma", gamma, ge=0, le=1)
    check_number(owner, "eps", eps, ge=0)
    over = loss_mask
    if policy_mask is not None:
        if policy_mask.dtype != torch.bool or policy_mask.shape != reward.shape:
            raise ValueError(
                f"{owner}: policy_mask must be a bool tensor of the reward's shape "
                f"{tuple(reward.shape)}, got {policy_mask.dtype} of shape {tuple(policy_mask.shape)}"
            )
        over = loss_mask & policy_mask
    _, returns = token_gae(reward, torch.zeros_like(reward), loss_mask, gamma=gamma, lmbda=1.0)
    return masked_whiten(returns, over, eps=eps), returns
