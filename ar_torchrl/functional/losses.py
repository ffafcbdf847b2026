"""Loss aggregation (token and sequence normalisers, the global normaliser of gradient accumulation)
and the clipped value loss.

The policy losses (the clipped surrogate, GSPO, CISPO) are in
:mod:`ar_torchrl.functional.policy_losses`, the KL penalties in :mod:`ar_torchrl.functional.kl`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ar_torchrl.functional._shapes import _check_mask, _check_same_shape
from ar_torchrl.utils.checks import AGGREGATION_MODES, AggregationMode

__all__ = ["aggregate_loss", "clipped_value_loss", "loss_normalizer"]


# ----------------------------------------------------------------------------- aggregation
def _check_mode(mode: str) -> None:
    if mode not in AGGREGATION_MODES:
        raise ValueError(
            f"unknown loss aggregation mode {mode!r}; expected one of {AGGREGATION_MODES}"
        )


def loss_normalizer(mask: Tensor, mode: AggregationMode) -> Tensor:
    """The denominator :func:`aggregate_loss` uses by default for ``mask`` (a scalar tensor).

    ``token_mean``: number of trained tokens; every ``seq_*`` mode: number of rows with at least one
    trained token. Summing it over the micro-batches of a mini-batch (or all-reducing it across ranks)
    gives the *global normaliser* that makes gradient accumulation equal the full-batch gradient.

    Args:
        mask: ``[B, L]`` bool.

    Example:
        >>> m = torch.tensor([[True, True], [False, False], [True, False]])
        >>> loss_normalizer(m, "token_mean").item(), loss_normalizer(m, "seq_mean_token_mean").item()
        (3.0, 2.0)
    """
    _check_mode(mode)
    if mode == "token_mean":
        return mask.sum().to(torch.float32)
    return mask.any(-1).sum().to(torch.float32)


def aggregate_loss(
    loss: Tensor,
    mask: Tensor,
    mode: AggregationMode = "token_mean",
    normalizer: Tensor | float | None = None,
    *,
    norm_length: int | None = None,
) -> Tensor:
    """Reduce a per-token loss ``[B, L]`` to a scalar over ``mask``.

    - ``token_mean``: ``sum(loss * mask) / N_tokens`` (DAPO).
    - ``seq_mean_token_mean``: mean over rows of each row's token mean (GRPO paper).
    - ``seq_mean_token_sum``: mean over rows of each row's token sum.
    - ``seq_mean_token_sum_norm``: mean over rows of ``token sum / norm_length`` (Dr.GRPO; the
      constant ``norm_length``, e.g. the generation budget, is required).

    Rows without trained tokens contribute 0 and are not counted. ``normalizer`` replaces the
    default denominator (:func:`loss_normalizer`) with a global one for gradient accumulation.

    Args:
        loss: ``[B, L]`` float; mask: ``[B, L]`` bool.

    Example:
        >>> loss = torch.tensor([[1.0, 3.0], [2.0, 99.0]]); m = torch.tensor([[True, True], [True, False]])
        >>> aggregate_loss(loss, m, "token_mean").item(), aggregate_loss(loss, m, "seq_mean_token_mean").item()
        (2.0, 2.0)
    """
    _check_mode(mode)
    _check_mask(mask, loss, "loss")
    if loss.ndim != 2:
        raise ValueError(f"aggregate_loss expects loss [B, L], got shape {tuple(loss.shape)}")
    masked = torch.where(mask, loss, torch.zeros((), dtype=loss.dtype, device=loss.device))
    if mode == "token_mean":
        numerator = masked.sum()
    elif mode == "seq_mean_token_mean":
        numerator = (masked.sum(-1) / mask.sum(-1).clamp_min(1)).sum()
    elif mode == "seq_mean_token_sum":
        numerator = masked.sum()
    else:
        if norm_length is None or norm_length <= 0:
            raise ValueError(
                "aggregate_loss: mode 'seq_mean_token_sum_norm' needs a positive constant "
                f"`norm_length` (e.g. max_new_tokens), got {norm_length!r}"
            )
        numerator = masked.sum() / norm_length
    if normalizer is None:
        normalizer = loss_normalizer(mask, mode)
    normalizer = torch.as_tensor(normalizer, dtype=loss.dtype, device=loss.device)
    return numerator / normalizer.clamp_min(1)


# ----------------------------------------------------------------------------- value loss
def clipped_value_loss(
    value: Tensor, old_value: Tensor, target: Tensor, mask: Tensor, *, clip_value: float | None
) -> tuple[Tensor, Tensor]:
    """Per-token clipped value loss ``0.5 * max((V - R)^2, (V_clip - R)^2)``.

    ``V_clip = V_old + clamp(V - V_old, -clip_value, clip_value)``; ``clip_value=None`` gives the
    plain ``0.5 * (V - R)^2``. Masked positions give 0 and zero gradient.

    Args:
        value, old_value, target: ``[B, L]`` float; mask: ``[B, L]`` bool.

    Returns:
        ``(loss [B, L], clipped [B, L] bool)`` where ``clipped`` marks tokens whose clipped branch is
        the larger one (as verl's ``vf_clipfrac``, up to the rounding of ``V_clip``; TorchRL's
        ``value_clip_fraction`` counts ``|V - V_old| > clip_value`` instead).

    Example:
        >>> v = torch.tensor([[1.0]]); old = torch.zeros(1, 1); r = torch.tensor([[2.0]])
        >>> loss, clipped = clipped_value_loss(v, old, r, torch.ones(1, 1, dtype=torch.bool), clip_value=0.2)
        >>> round(loss.item(), 3), clipped.item()
        (1.62, True)
    """
    _check_mask(mask, value, "value")
    _check_same_shape("old_value", old_value, "value", value)
    _check_same_shape("target", target, "value", value)
    zero = torch.zeros((), dtype=value.dtype, device=value.device)
    v = torch.where(mask, value, zero)
    tgt = torch.where(mask, target, zero)
    unclipped = (v - tgt) ** 2
    if clip_value is None:
        return torch.where(mask, 0.5 * unclipped, zero), torch.zeros_like(mask)
    old = torch.where(mask, old_value, zero)
    v_clip = old + (v - old).clamp(-clip_value, clip_value)
    clipped_sq = (v_clip - tgt) ** 2
    loss = 0.5 * torch.maximum(unclipped, clipped_sq)
    return torch.where(mask, loss, zero), (clipped_sq > unclipped) & mask


def __getattr__(name: str) -> object:
    """The names that moved out of this module (``clipped_surrogate`` & co. to
    :mod:`~ar_torchrl.functional.policy_losses`, ``k3_kl`` to :mod:`~ar_torchrl.functional.kl`),
    kept one release with a ``DeprecationWarning`` (:data:`ar_torchrl._compat.RENAMED`)."""
    from ar_torchrl._compat import renamed

    return renamed(__name__, name)
