"""Every policy loss: PPO's clipped surrogate (with clip-higher and dual-clip), GSPO (sequence and
token forms) and CISPO, and the masked log-ratio they share.

Every loss function has the signature
``(log_prob, old_log_prob, advantage, mask, ...) -> (loss [B, L], ratio [B, L], clipped [B, L])``:
a per-token loss (0 at masked positions, with zero gradient there whatever the inputs hold), the
ratio the loss used on each token (detach it for metrics) and the tokens whose gradient the clip
changed. They are aggregated alike (:func:`~ar_torchrl.functional.aggregate_loss`, any
``loss_agg_mode``). A row of ``[B, L]`` is one sequence (an episode, in multi-turn rows). The
registry of :mod:`ar_torchrl.objectives.policy_loss` wraps each as a named policy loss of
:class:`~ar_torchrl.objectives.TokenPPOLoss`.

With ``lr_t = clamp(log pi_t - log pi_old_t, -20, 20)``, ``r_t = exp(lr_t)``, ``n`` the row's number
of trained tokens, ``A_t`` the advantage and ``sg`` the stop-gradient, the per-token gradient of each
loss w.r.t. ``log pi_t`` (the closed forms ``tests/objectives/test_policy_losses.py`` checks against
autograd):

=================  ===============================================  ===================================
loss               per-token loss                                   ``d loss / d log pi_t``
=================  ===============================================  ===================================
``clip``           ``-min(r_t A_t, clip(r_t) A_t)``, ``clip`` to     ``-A_t r_t`` (0 when clipped); with
                   ``[1 - eps_low, 1 + eps_high]``; dual-clip:       the dual clip, 0 where ``-c A_t``
                   ``min(., -c A_t)`` for ``A_t < 0`` (PPO,          is taken
                   https://arxiv.org/abs/1707.06347; DAPO; Ye et
                   al. 2020)
``gspo``           row loss ``-min(s A, clip(s) A)`` on each of the  ``-A s / n`` per row loss (0 when
                   row's tokens; ``s = exp(mean_t lr_t)``, ``A``     clipped); every token of the row
                   the row's mean advantage (GSPO, Zheng et al.      shares the row's gradient
                   2025, https://arxiv.org/abs/2507.18071)
``gspo_token``     ``-min(s_t A_t, clip(s_t) A_t)``,                 ``-A_t s`` (0 when clipped); no
                   ``s_t = exp(sg[mean lr] + log pi_t - sg[log pi_t])`` gradient reaches other tokens
                   (value ``s``; GSPO-token)
``cispo``          ``-sg[clamp(r_t, w_min, w_max)] A_t log pi_t``    ``-clamp(r_t, w_min, w_max) A_t``:
                   (CISPO, MiniMax-M1, https://arxiv.org/abs/        *every* token keeps a gradient,
                   2506.13585)                                      the clipped ones with the capped
                                                                    weight
=================  ===============================================  ===================================

TorchRL 0.14's ``CISPOLoss`` computes ``-exp(clamp(lr)) * A``: a clamped token gets no gradient (the
clamp is flat), which is the clipped surrogate's behaviour, not CISPO's; the test pins that difference.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ar_torchrl.functional._shapes import _check_mask, _check_same_shape

__all__ = [
    "LOG_RATIO_CLAMP",
    "cispo_surrogate",
    "clipped_surrogate",
    "gspo_surrogate",
    "masked_log_ratio",
    "pessimistic_clip",
]

#: Log-ratios ``log pi - log pi_old`` are clamped to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` before
#: ``exp`` (as verl does): ``exp(88.7)`` already overflows float32, and one ``inf`` ratio turns the loss
#: (advantage 0: ``inf * 0``) or the gradient (``0 * inf`` through the unselected branch) into NaN.
LOG_RATIO_CLAMP = 20.0


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


def _check(log_prob: Tensor, old_log_prob: Tensor, advantage: Tensor, mask: Tensor) -> None:
    _check_mask(mask, log_prob, "log_prob")
    _check_same_shape("old_log_prob", old_log_prob, "log_prob", log_prob)
    _check_same_shape("advantage", advantage, "log_prob", log_prob)
    if log_prob.ndim != 2:
        raise ValueError(f"expected log_prob [B, L], got shape {tuple(log_prob.shape)}")


def _clip_args(clip_low: float, clip_high: float) -> None:
    if not (0 <= clip_low < 1) or clip_high < 0:
        raise ValueError(
            f"GSPO clip range: need 0 <= clip_low < 1 and clip_high >= 0, got ({clip_low}, "
            f"{clip_high}) (the paper uses 3e-4, 4e-4)"
        )


def gspo_surrogate(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantage: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    token_level: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """GSPO's length-normalised sequence ratio in a clipped surrogate (``token_level``: GSPO-token).

    ``s = exp(mean over the row's trained tokens of lr)``. Sequence form: the row's loss
    ``-min(s A, clip(s, 1 - clip_low, 1 + clip_high) A)`` with ``A`` the row's mean advantage over
    its trained tokens (GRPO/RLOO give one advantage per row: then ``A`` is it), placed on each
    trained token, so ``loss_agg_mode="seq_mean_token_mean"`` gives the mean over rows of the row
    losses (the paper's objective; ``token_mean`` weights a row by its length). GSPO-token: per-token
    ratio ``s_t = sg[s] * pi_t / sg[pi_t]`` (value ``s``, gradient through ``log pi_t`` only) and
    each token's own advantage. The clip range is GSPO's own (the paper: ``3e-4``, ``4e-4``): a
    PPO-sized range almost never clips a length-normalised ratio.

    Args:
        log_prob, old_log_prob, advantage: ``[B, L]`` float; mask: ``[B, L]`` bool.
        clip_low, clip_high: the band ``[1 - clip_low, 1 + clip_high]`` of ``s``.
        token_level: GSPO-token instead of the sequence form.

    Returns:
        ``(loss [B, L], ratio [B, L], clipped [B, L] bool)``: ``ratio`` is ``s`` on the row's
        trained tokens (1 elsewhere); ``clipped`` marks tokens whose clipped branch was taken.

    Example:
        >>> lp = torch.tensor([[-1.0, -2.0]]); old = torch.tensor([[-1.2, -2.2]])
        >>> m = torch.ones(1, 2, dtype=torch.bool); a = torch.ones(1, 2)
        >>> loss, ratio, clipped = gspo_surrogate(lp, old, a, m, clip_low=3e-4, clip_high=4e-4)
        >>> round(ratio[0, 0].item(), 4), round(loss[0, 0].item(), 4), clipped.tolist()
        (1.2214, -1.0004, [[True, True]])
    """
    _check(log_prob, old_log_prob, advantage, mask)
    _clip_args(clip_low, clip_high)
    zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    n = mask.sum(-1, keepdim=True).clamp_min(1).to(log_prob.dtype)  # [B, 1]
    seq_log_ratio = masked_log_ratio(log_prob, old_log_prob, mask).sum(-1, keepdim=True) / n
    adv = torch.where(mask, advantage, zero)
    if token_level:
        lp = torch.where(mask, log_prob, zero)
        log_s = (seq_log_ratio.detach() + lp - lp.detach()).clamp(max=LOG_RATIO_CLAMP)
        ratio = torch.where(mask, torch.exp(log_s), torch.ones_like(log_s))
    else:
        adv = (adv.sum(-1, keepdim=True) / n).expand_as(adv)
        ratio = torch.where(mask, torch.exp(seq_log_ratio).expand_as(adv), zero + 1.0)
    loss, clipped = pessimistic_clip(ratio, adv, mask, clip_low=clip_low, clip_high=clip_high)
    return torch.where(mask, loss, zero), ratio, clipped


def cispo_surrogate(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantage: Tensor,
    mask: Tensor,
    *,
    weight_max: float,
    weight_min: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """CISPO: ``-sg[clamp(r, weight_min, weight_max)] * A * log pi`` per token (``r = pi / pi_old``).

    The importance weight is clipped and detached, so every trained token keeps a policy gradient
    (``-w A``), the clipped ones included (the point of CISPO: PPO's clip zeroes the gradient of
    the rare tokens that matter for reasoning). ``weight_max`` is the absolute cap (TRL's
    ``epsilon_high`` for ``loss_type="cispo"``, ScaleRL's ``eps_max``; verl's ``1 + clip_ratio_high``);
    ``weight_min`` the optional floor (MiniMax-M1 sets none; verl's ``1 - clip_ratio_low``).

    Args:
        log_prob, old_log_prob, advantage: ``[B, L]`` float; mask: ``[B, L]`` bool.
        weight_max: upper bound of the weight (> 0).
        weight_min: lower bound (``None``: none), ``<= weight_max``.

    Returns:
        ``(loss [B, L], weight [B, L], clipped [B, L] bool)``: ``weight`` is the clipped weight
        (1 at masked positions), ``clipped`` the tokens whose weight was clamped.

    Example:
        >>> lp = torch.log(torch.tensor([[0.5, 0.1]])); old = torch.log(torch.tensor([[0.1, 0.1]]))
        >>> m = torch.ones(1, 2, dtype=torch.bool); a = torch.ones(1, 2)
        >>> loss, w, clipped = cispo_surrogate(lp, old, a, m, weight_max=4.0)
        >>> [round(x, 3) for x in w[0].tolist()], clipped.tolist()
        ([4.0, 1.0], [[True, False]])
    """
    _check(log_prob, old_log_prob, advantage, mask)
    if not weight_max > 0 or (weight_min is not None and not 0 <= weight_min <= weight_max):
        raise ValueError(
            "cispo_surrogate: need weight_max > 0 and 0 <= weight_min <= weight_max (or "
            f"weight_min=None), got weight_min={weight_min!r}, weight_max={weight_max!r}"
        )
    zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    raw = torch.exp(masked_log_ratio(log_prob, old_log_prob, mask)).detach()
    weight = raw.clamp(min=weight_min, max=weight_max)
    clipped = (weight != raw) & mask
    adv = torch.where(mask, advantage, zero)
    lp = torch.where(mask, log_prob, zero)
    loss = -weight * adv * lp
    return torch.where(mask, loss, zero), weight, clipped
