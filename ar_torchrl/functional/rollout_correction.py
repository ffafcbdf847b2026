"""Rollout correction: importance weights and rejection masks for ``pi_old / pi_rollout``, and the
mismatch metrics.

``pi_old`` is the trainer's recomputed policy (``sample_log_prob``, the PPO old log-probs) and
``pi_rollout`` the policy that sampled the tokens as the engine reported it (``rollout_log_prob``):
the two differ by engine-vs-trainer numerics (bf16 kernels, another attention implementation) and,
in async mode, by one weight update (decoupled PPO). With ``lr_t = clamp(log pi_old_t -
log pi_rollout_t, -20, 20)`` on a row's trained tokens (a row is one sequence, or one episode):

- **IS weights** (multiply the per-token *policy* loss, detached): ``token``: ``min(exp(lr_t),
  cap)``; ``sequence``: ``min(exp(sum_t lr_t), cap)`` on every token of the row (verl's
  ``rollout_is=token|sequence`` with ``rollout_is_threshold``).
- **Rejection masks** (a rejected token's policy loss is multiplied by 0 and the normaliser still
  counts it, as TRL's ``off_policy_mask``; verl drops rejected tokens from ``response_mask``, so
  under ``token_mean`` its objective is ours times ``total / kept``): ``token``: keep tokens
  with ``exp(lr_t)`` in ``[low, high]`` (IcePop's two-sided band; ``low=None`` an upper-only token
  mask); ``sequence`` (MIS): keep rows with ``exp(sum_t lr_t)`` in ``[low, high]``;
  ``geometric``: keep rows with the geometric-mean ratio ``exp(mean_t lr_t)`` in ``[low, high]``.

The bounds compare ``exp(lr)`` with ``[low, high]`` directly (verl's ``*_k1`` rejection options
bound ``-lr``, i.e. the inverse ratio; with their symmetric defaults ``low = 1 / high`` the two
agree, and ``tests/functional/test_rollout_correction.py`` checks the presets against verl's code).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ar_torchrl.functional._shapes import _check_mask, _check_same_shape
from ar_torchrl.functional.policy_losses import LOG_RATIO_CLAMP, masked_log_ratio
from ar_torchrl.functional.reductions import masked_mean as _masked_mean

__all__ = [
    "ROLLOUT_IS_LEVELS",
    "ROLLOUT_MASK_MODES",
    "rollout_correction",
    "rollout_mismatch_metrics",
]

ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_MASK_MODES = ("token", "sequence", "geometric")


def _check(old_log_prob: Tensor, rollout_log_prob: Tensor, mask: Tensor) -> None:
    _check_mask(mask, old_log_prob, "sample_log_prob")
    _check_same_shape("rollout_log_prob", rollout_log_prob, "sample_log_prob", old_log_prob)
    if old_log_prob.ndim != 2:
        raise ValueError(
            f"rollout correction expects [B, L] log-probs, got shape {tuple(old_log_prob.shape)}"
        )


def _in_band(log_value: Tensor, low: float | None, high: float | None) -> Tensor:
    keep = torch.ones_like(log_value, dtype=torch.bool)
    if low is not None:
        keep = keep & (log_value >= (math.log(low) if low > 0 else -math.inf))
    if high is not None:
        keep = keep & (log_value <= math.log(high))
    return keep


def rollout_correction(
    old_log_prob: Tensor,
    rollout_log_prob: Tensor,
    mask: Tensor,
    *,
    is_level: str | None = None,
    is_cap: float = 2.0,
    mask_mode: str | None = None,
    mask_low: float | None = None,
    mask_high: float | None = None,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """The detached per-token weight and keep-mask of the module docstring, and their metrics.

    Args:
        old_log_prob, rollout_log_prob: ``[B, L]`` float; mask: ``[B, L]`` bool.
        is_level: ``"token"`` | ``"sequence"`` | ``None`` (no IS weight: 1).
        is_cap: the truncation of the IS weight (> 0).
        mask_mode: ``"token"`` | ``"sequence"`` | ``"geometric"`` | ``None`` (keep everything).
        mask_low, mask_high: the band of the mask's ratio (``None``: unbounded on that side; at
            least one is needed with a ``mask_mode``).

    Returns:
        ``(weight [B, L], keep [B, L] bool, metrics)``: ``weight`` is 1 at masked positions and
        without IS; ``keep`` is ``mask`` minus the rejected tokens. ``metrics`` (scalars, over the
        trained tokens / rows with trained tokens): ``tis_weight_mean`` and ``tis_weight_capped``
        (the fraction whose raw weight exceeded the cap) with IS; ``rollout_masked_tokens`` and
        ``rollout_masked_seqs`` (rows with a rejected token) with a mask.

    Example:
        >>> old = torch.tensor([[0.0, 0.0, 0.0]]); roll = torch.tensor([[0.0, -1.0, 0.1]])
        >>> m = torch.ones(1, 3, dtype=torch.bool)
        >>> w, keep, _ = rollout_correction(old, roll, m, is_level="token", is_cap=2.0,
        ...                                 mask_mode="token", mask_low=0.5, mask_high=2.0)
        >>> [round(x, 3) for x in w[0].tolist()], keep.tolist()
        ([1.0, 2.0, 0.905], [[True, False, True]])
    """
    _check(old_log_prob, rollout_log_prob, mask)
    if is_level is not None and is_level not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"rollout correction: is_level={is_level!r}; expected {ROLLOUT_IS_LEVELS}")
    if mask_mode is not None and mask_mode not in ROLLOUT_MASK_MODES:
        raise ValueError(
            f"rollout correction: mask_mode={mask_mode!r}; expected {ROLLOUT_MASK_MODES}"
        )
    if not is_cap > 0:
        raise ValueError(f"rollout correction: is_cap must be > 0, got {is_cap!r}")
    if mask_mode is not None and mask_low is None and mask_high is None:
        raise ValueError(
            f"rollout correction: mask_mode={mask_mode!r} needs mask_low and/or mask_high"
        )
    lr = masked_log_ratio(old_log_prob, rollout_log_prob, mask).detach()
    n = mask.sum(-1, keepdim=True)
    row_sum = lr.sum(-1, keepdim=True)
    seq_sum = row_sum.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    rows = mask.any(-1)
    metrics: dict[str, Tensor] = {}
    one = torch.ones_like(lr)
    weight = one
    if is_level is not None:
        raw = torch.exp(lr) if is_level == "token" else torch.exp(seq_sum).expand_as(lr)
        weight = torch.where(mask, raw.clamp(max=is_cap), one)
        metrics["tis_weight_mean"] = _masked_mean(weight, mask)
        metrics["tis_weight_capped"] = _masked_mean((raw > is_cap).to(lr.dtype), mask)
    keep = mask
    if mask_mode is not None:
        if mask_mode == "token":
            stat = lr
        elif mask_mode == "sequence":
            stat = seq_sum.expand_as(lr)
        else:
            stat = (row_sum / n.clamp_min(1)).expand_as(lr)
        keep = mask & _in_band(stat, mask_low, mask_high)
        rejected = mask & ~keep
        metrics["rollout_masked_tokens"] = _masked_mean(rejected.to(lr.dtype), mask)
        seqs = rejected.any(-1).to(lr.dtype)
        metrics["rollout_masked_seqs"] = _masked_mean(seqs, rows)
    return weight, keep, metrics


def rollout_mismatch_metrics(
    old_log_prob: Tensor, rollout_log_prob: Tensor, mask: Tensor
) -> dict[str, Tensor]:
    """How far the trainer's ``pi_old`` is from the engine's ``pi_rollout`` (scalars, detached).

    - ``rollout_abs_log_ratio``: mean over trained tokens of ``|log pi_old - log pi_rollout|``;
    - ``rollout_token_mult_prob_error``: mean over trained tokens of ``exp(|log pi_old -
      log pi_rollout|)`` (NeMo-RL's ``token_mult_prob_error``; 1 when they agree);
    - ``rollout_seq_ratio``: mean over rows of ``exp(sum_t (log pi_old_t - log pi_rollout_t))``
      (the sequence-level probability ratio; exponent clamped to ``[-20, 20]``);
    - ``rollout_kl``: mean over trained tokens of ``log pi_rollout - log pi_old`` (k1 estimate of
      KL(pi_rollout || pi_old), verl's ``rollout_corr/kl``).

    Args:
        old_log_prob, rollout_log_prob: ``[B, L]`` float; mask: ``[B, L]`` bool.

    Example:
        >>> m = torch.tensor([[True, True, False]])
        >>> out = rollout_mismatch_metrics(torch.zeros(1, 3), torch.tensor([[0.1, -0.1, 9.0]]), m)
        >>> round(out["rollout_abs_log_ratio"].item(), 3), round(out["rollout_seq_ratio"].item(), 3)
        (0.1, 1.0)
    """
    _check(old_log_prob, rollout_log_prob, mask)
    lr = masked_log_ratio(old_log_prob.detach(), rollout_log_prob, mask)
    rows = mask.any(-1)
    seq_ratio = torch.exp(lr.sum(-1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return {
        "rollout_abs_log_ratio": _masked_mean(lr.abs(), mask),
        "rollout_token_mult_prob_error": _masked_mean(torch.exp(lr.abs()), mask),
        "rollout_seq_ratio": _masked_mean(seq_ratio, rows),
        "rollout_kl": _masked_mean(-lr, mask),
    }
