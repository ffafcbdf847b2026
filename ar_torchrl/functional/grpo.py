"""Group-relative advantages over ``[B]`` sequence rewards: GRPO's z-score and RLOO's leave-one-out."""

from __future__ import annotations

import torch
from torch import Tensor

from ar_torchrl.functional._shapes import check_finite_reward

__all__ = ["grpo_advantage", "rloo_advantage"]


# ----------------------------------------------------------------------------- GRPO
def grpo_advantage(
    seq_reward: Tensor, group_id: Tensor, *, scale: bool = True, eps: float = 1e-6
) -> tuple[Tensor, Tensor]:
    """Group-relative advantage: ``(r - mean_group) / (std_group + eps)``.

    ``std`` is the Bessel-corrected standard deviation over the group (as verl and TRL compute it);
    ``scale=False`` drops the division (Dr.GRPO). A group whose rewards are all equal (zero spread,
    which includes groups of one sample) gets advantage 0.

    Args:
        seq_reward: ``[B]`` float sequence rewards.
        group_id: ``[B]`` int64 group ids (all samples of one prompt share one id).
        scale: divide by the group std.
        eps: added to the std.

    Returns:
        ``(advantage [B], zero_spread [B] bool)``: ``zero_spread`` flags rows in zero-spread groups.

    Raises:
        ValueError: a NaN/inf sequence reward (naming its row), mismatched shapes.

    Example:
        >>> adv, flat = grpo_advantage(torch.tensor([1.0, -1.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1]))
        >>> [round(a, 4) for a in adv.tolist()], flat.tolist()
        ([0.7071, -0.7071, 0.0, 0.0], [False, False, True, True])
    """
    r, inverse, counts, mean, sq = _group_stats(seq_reward, group_id, "grpo_advantage")
    std = (sq / (counts - 1).clamp_min(1)).sqrt()[inverse]
    spread = (sq > 0)[inverse]
    adv = r - mean[inverse]
    if scale:
        adv = adv / (std + eps)
    adv = torch.where(spread, adv, torch.zeros_like(adv))
    return adv.to(seq_reward.dtype), ~spread


def rloo_advantage(seq_reward: Tensor, group_id: Tensor) -> tuple[Tensor, Tensor]:
    """REINFORCE leave-one-out: ``A_i = r_i - mean_{j != i in the group} r_j``.

    Equivalently ``n / (n - 1) * (r_i - mean_group)`` for a group of ``n`` samples (the form verl's
    ``compute_rloo_outcome_advantage`` and TRL's RLOO trainer compute; Ahmadian et al. 2024,
    https://arxiv.org/abs/2402.14740). A group of one sample has no baseline: its advantage is 0
    (verl keeps the raw reward there; here a lone sample carries no group-relative signal, as in
    GRPO). Zero-spread groups get exactly 0, as in :func:`grpo_advantage`.

    Args:
        seq_reward: ``[B]`` float sequence rewards.
        group_id: ``[B]`` int64 group ids.

    Returns:
        ``(advantage [B], zero_spread [B] bool)``.

    Example:
        >>> adv, flat = rloo_advantage(torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0]), torch.tensor([0, 0, 0, 1, 1]))
        >>> [round(a, 4) for a in adv.tolist()], flat.tolist()
        ([1.0, -0.5, -0.5, 0.0, 0.0], [False, False, False, True, True])
    """
    r, inverse, counts, mean, sq = _group_stats(seq_reward, group_id, "rloo_advantage")
    n = counts[inverse].to(torch.float64)
    spread = (sq > 0)[inverse]
    adv = n / (n - 1).clamp_min(1) * (r - mean[inverse])
    adv = torch.where(spread & (n > 1), adv, torch.zeros_like(adv))
    return adv.to(seq_reward.dtype), ~spread


def _group_stats(seq_reward: Tensor, group_id: Tensor, owner: str):
    """``(r, inverse, counts, mean, sq)`` in float64: each row's group index, per-group sample
    counts, means and sums of squared deviations (``[G]``); shapes and finiteness checked."""
    if seq_reward.ndim != 1 or group_id.shape != seq_reward.shape:
        raise ValueError(
            f"{owner} expects seq_reward [B] and group_id [B], got "
            f"{tuple(seq_reward.shape)} and {tuple(group_id.shape)}"
        )
    if group_id.is_floating_point():
        raise TypeError(f"group_id must be an integer tensor, got {group_id.dtype}")
    check_finite_reward(seq_reward, owner, "sequence reward")
    _, inverse, counts = torch.unique(group_id, return_inverse=True, return_counts=True)
    r = seq_reward.to(torch.float64)
    sums = torch.zeros(counts.shape, dtype=torch.float64, device=r.device).index_add_(0, inverse, r)
    mean = sums / counts
    sq = torch.zeros_like(sums).index_add_(0, inverse, (r - mean[inverse]) ** 2)
    return r, inverse, counts, mean, sq
