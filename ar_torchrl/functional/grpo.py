"""GRPO's group-relative advantage over ``[B]`` sequence rewards."""

from __future__ import annotations

import torch
from torch import Tensor

from ar_torchrl.functional.gae import check_finite_reward

__all__ = ["grpo_advantage"]


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
    if seq_reward.ndim != 1 or group_id.shape != seq_reward.shape:
        raise ValueError(
            f"grpo_advantage expects seq_reward [B] and group_id [B], got "
            f"{tuple(seq_reward.shape)} and {tuple(group_id.shape)}"
        )
    if group_id.is_floating_point():
        raise TypeError(f"group_id must be an integer tensor, got {group_id.dtype}")
    check_finite_reward(seq_reward, "grpo_advantage", "sequence reward")
    _, inverse, counts = torch.unique(group_id, return_inverse=True, return_counts=True)
    r = seq_reward.to(torch.float64)
    sums = torch.zeros(counts.shape, dtype=torch.float64, device=r.device).index_add_(0, inverse, r)
    mean = (sums / counts)[inverse]
    sq = torch.zeros_like(sums).index_add_(0, inverse, (r - mean) ** 2)
    std = (sq / (counts - 1).clamp_min(1)).sqrt()[inverse]
    spread = (sq > 0)[inverse]
    adv = r - mean
    if scale:
        adv = adv / (std + eps)
    adv = torch.where(spread, adv, torch.zeros_like(adv))
    return adv.to(seq_reward.dtype), ~spread
