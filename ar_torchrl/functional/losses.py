"""Loss aggregation (token / sequence normalisers) and the PPO terms: log-ratio, clipped surrogate,
clipped value loss, k3 KL."""

from __future__ import annotations

import torch
from torch import Tensor

from ar_torchrl.functional._shapes import _check_mask, _check_same_shape
from ar_torchrl.utils.checks import AGGREGATION_MODES, AggregationMode

__all__ = [
    "LOG_RATIO_CLAMP",
    "aggregate_loss",
    "clipped_surrogate",
    "clipped_value_loss",
    "k3_kl",
    "loss_normalizer",
    "masked_log_ratio",
    "pessimistic_clip",
]

#: Log-ratios ``log pi - log pi_old`` are clamped to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` before
#: ``exp`` (as verl does): ``exp(88.7)`` already overflows float32, and one ``inf`` ratio turns the loss
#: (advantage 0: ``inf * 0``) or the gradient (``0 * inf`` through the unselected branch) into NaN.
LOG_RATIO_CLAMP = 20.0


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


# ----------------------------------------------------------------------------- PPO terms
def masked_log_ratio(log_prob: Tensor, old_log_prob: Tensor, mask: Tensor) -> Tensor:
    """``clamp(log_prob - old_log_prob, -20, 20)`` on ``mask``, 0 elsewhere (``[B, L]``).

    The clamp (:data:`LOG_RATIO_CLAMP`, as verl's ``compute_policy_loss``) keeps ``exp`` of it finite in
    float32; inside the range the result is exactly the difference. Beyond it a token's gradient
    through the ratio is 0 (the clamp is flat there).

    Example:
        >>> masked_log_ratio(torch.tensor([[0.5, 100.0, 7.0]]), torch.zeros(1, 3),
        ...                  torch.tensor([[True, True, False]])).tolist()
        [[0.5, 20.0, 0.0]]
    """
    zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    diff = torch.where(mask, log_prob - old_log_prob, zero)
    return diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def pessimistic_clip(
    ratio: Tensor, advantage: Tensor, mask: Tensor, *, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic bound ``max(-r A, -clamp(r, 1 - clip_low, 1 + clip_high) A)`` per token.

    The core of :func:`clipped_surrogate` and of GSPO
    (:func:`~ar_torchrl.functional.gspo_surrogate`, with a sequence ratio); no masking of the
    loss itself (the callers zero masked positions).

    Args:
        ratio, advantage: ``[B, L]`` float; mask: ``[B, L]`` bool.

    Returns:
        ``(loss [B, L], clipped [B, L] bool)``: ``clipped`` marks trained tokens where the clipped
        term is the larger loss (their gradient through ``r`` is 0).

    Example:
        >>> loss, clipped = pessimistic_clip(torch.tensor([[1.5, 1.0]]), torch.ones(1, 2),
        ...                                  torch.ones(1, 2, dtype=torch.bool), clip_low=0.2, clip_high=0.2)
        >>> loss.tolist(), clipped.tolist()
        ([[-1.2000000476837158, -1.0]], [[True, False]])
    """
    surr = -ratio * advantage
    surr_clipped = -ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantage
    return torch.maximum(surr, surr_clipped), (surr_clipped > surr) & mask


def clipped_surrogate(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantage: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token clipped PPO policy loss (clip-higher and optional dual-clip).

    ``ratio = exp(log_prob - old_log_prob)``;
    ``loss = -min(ratio * A, clamp(ratio, 1 - clip_low, 1 + clip_high) * A)``; with ``dual_clip = c``
    (> 1), tokens with ``A < 0`` use ``min(loss, -c * A)``. Masked positions give loss 0, ratio 1 and
    zero gradient whatever their inputs hold. The log-ratio is clamped to ``[-20, 20]`` first
    (:func:`masked_log_ratio`, as verl): identical results inside that range, and finite losses and
    gradients outside it (an unclamped float32 ratio overflows above ~88.7).

    Args:
        log_prob, old_log_prob, advantage: ``[B, L]`` float; mask: ``[B, L]`` bool.

    Returns:
        ``(loss [B, L], ratio [B, L], clipped [B, L] bool)``; ``clipped`` marks tokens where a
        clipped branch was taken (the clip, or the dual clip: verl's ``pg_clipfrac`` plus
        ``pg_clipfrac_lower`` numerators; TorchRL's ``clip_fraction`` counts ratios outside the
        band instead, whichever branch is taken).

    Example:
        >>> lp = torch.tensor([[0.5, 0.0]]); old = torch.zeros(1, 2); a = torch.ones(1, 2)
        >>> loss, ratio, clipped = clipped_surrogate(lp, old, a, torch.ones(1, 2, dtype=torch.bool),
        ...                                          clip_low=0.2, clip_high=0.28)
        >>> [round(x, 2) for x in loss[0].tolist()], clipped.tolist()
        ([-1.28, -1.0], [[True, False]])
    """
    _check_mask(mask, log_prob, "log_prob")
    _check_same_shape("old_log_prob", old_log_prob, "log_prob", log_prob)
    _check_same_shape("advantage", advantage, "log_prob", log_prob)
    zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    adv = torch.where(mask, advantage, zero)
    ratio = torch.exp(masked_log_ratio(log_prob, old_log_prob, mask))
    loss, clipped = pessimistic_clip(ratio, adv, mask, clip_low=clip_low, clip_high=clip_high)
    if dual_clip is not None:
        dual = torch.minimum(loss, -dual_clip * adv)
        clipped = clipped | ((adv < 0) & (dual < loss) & mask)
        loss = torch.where(adv < 0, dual, loss)
    return torch.where(mask, loss, zero), ratio, clipped


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


def k3_kl(log_prob: Tensor, ref_log_prob: Tensor, mask: Tensor, *, clamp: float = 10.0) -> Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref): ``exp(ref - lp) - (ref - lp) - 1`` (>= 0).

    Schulman's low-variance estimator (http://joschu.net/blog/kl-approx.html), as GRPO uses it. The
    log-ratio is clamped to ``[-20, 20]`` and the result to ``[0, clamp]`` for stability (as verl's
    ``low_var_kl``). 0 at masked positions.

    Example:
        >>> m = torch.ones(1, 2, dtype=torch.bool)
        >>> k3_kl(torch.tensor([[0.0, -1.0]]), torch.tensor([[0.0, 0.0]]), m).tolist()[0][0]
        0.0
    """
    _check_mask(mask, log_prob, "log_prob")
    _check_same_shape("ref_log_prob", ref_log_prob, "log_prob", log_prob)
    zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    diff = masked_log_ratio(ref_log_prob, log_prob, mask)
    kl = (torch.exp(diff) - diff - 1.0).clamp(0.0, clamp)
    return torch.where(mask, kl, zero)
