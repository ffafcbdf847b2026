"""Shape and dtype checks shared by the functional modules."""

from __future__ import annotations

import torch
from torch import Tensor


def _check_same_shape(name: str, tensor: Tensor, ref_name: str, ref: Tensor) -> None:
    if tensor.shape != ref.shape:
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)} but {ref_name} has shape {tuple(ref.shape)}; "
            f"both must be [B, L] (squeeze a trailing 1 first)."
        )


def _check_mask(mask: Tensor, ref: Tensor, ref_name: str = "reward") -> None:
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor, got dtype {mask.dtype}")
    _check_same_shape("mask", mask, ref_name, ref)


def check_finite_reward(reward: Tensor, owner: str, name: str = "reward") -> None:
    """Raise if ``reward`` holds a NaN or inf, naming the first one's row (and position).

    A single non-finite reward would make a whole GAE batch NaN (every update step then skipped), or
    silently count as a zero-spread GRPO group; it is a bug in the reward function to fix.

    Args:
        reward: ``[B]`` or ``[B, L]``.
    """
    bad = ~torch.isfinite(reward)
    if not bool(bad.any()):
        return
    first = [int(i) for i in bad.nonzero()[0]]
    where = f"row {first[0]}" + (f", position {first[1]}" if len(first) > 1 else "")
    rows = bad.reshape(bad.shape[0], -1).any(-1)
    raise ValueError(
        f"{owner}: non-finite {name} {reward[tuple(first)].item()} at {where} "
        f"({int(rows.sum())} of {reward.shape[0]} rows hold NaN/inf rewards); fix the reward "
        "function or drop those rows before computing advantages"
    )
