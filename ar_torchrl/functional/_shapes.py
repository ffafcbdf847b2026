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
