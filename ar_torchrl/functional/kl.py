"""Per-token KL penalties to a reference policy, and the gradient each one gives.

With ``d = log pi(x) - log pi_ref(x)`` for a token ``x`` sampled from the sampling policy ``q``
(``q = pi`` on-policy), the estimators of Schulman's note (http://joschu.net/blog/kl-approx.html)
and what differentiating them *as a loss* does (``E_q`` over the sampled tokens, ``pi`` the only
thing with a gradient):

=================  =========================================  ===========================================
estimator          per-token term                             expected gradient (exact on a categorical)
=================  =========================================  ===========================================
``"k1"``           ``d``                                      ``E_pi[grad log pi] = 0`` on-policy: no
                                                              gradient as a loss; unbiased *value* of
                                                              KL(pi || ref): the KL-in-reward term
``"k2"``           ``d ** 2 / 2``                             ``grad KL(pi || ref)`` on-policy (the
                                                              reverse KL; SkyRL's default since #1445)
``"k3"``           ``exp(-d) - 1 + d``                        ``grad KL(ref || pi)`` on-policy: the
                                                              *forward* KL (OpenRLHF #1309), although its
                                                              value estimates KL(pi || ref)
``"k3_unbiased"``  ``exp(lp - old_lp) * k3``                  ``grad KL(pi || ref)`` for any sampling
                                                              policy ``q = old`` (DeepSeek-V3.2's form;
                                                              TRL's ``use_bias_correction_kl``): the
                                                              importance weight keeps its gradient
=================  =========================================  ===========================================

``tests/functional/test_kl.py`` enumerates a small vocabulary and checks each row of this table exactly.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from ar_torchrl.functional._shapes import _check_mask, _check_same_shape
from ar_torchrl.functional.policy_losses import masked_log_ratio

__all__ = ["KL_ESTIMATORS", "KLEstimator", "k3_kl", "kl_penalty"]

KLEstimator = Literal["k1", "k2", "k3", "k3_unbiased"]
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3", "k3_unbiased")


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


def kl_penalty(
    log_prob: Tensor,
    ref_log_prob: Tensor,
    mask: Tensor,
    *,
    estimator: KLEstimator = "k3",
    old_log_prob: Tensor | None = None,
) -> Tensor:
    """The per-token KL penalty of ``estimator`` (see the module table), 0 off ``mask``.

    Args:
        log_prob: ``[B, L]`` log-probs of the sampled tokens under the policy being trained.
        ref_log_prob: ``[B, L]`` the reference policy's.
        mask: ``[B, L]`` bool, the trained tokens.
        estimator: ``"k1" | "k2" | "k3" | "k3_unbiased"``.
        old_log_prob: ``[B, L]`` the sampling policy's log-probs (``sample_log_prob``, the PPO old log-probs); required by
            ``"k3_unbiased"`` (its importance weight ``exp(log_prob - old_log_prob)``).

    Returns:
        ``[B, L]``, differentiable through ``log_prob``. The log-ratios are clamped to
        ``[-20, 20]`` and ``"k3"`` to ``[0, 10]`` (as :func:`~ar_torchrl.functional.k3_kl`, verl's
        ``low_var_kl``); ``"k3_unbiased"`` is that ``k3`` times the weight.

    Example:
        >>> lp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
        >>> m = torch.ones(1, 2, dtype=torch.bool)
        >>> kl_penalty(lp, ref, m, estimator="k1").tolist()
        [[0.5, -1.0]]
        >>> kl_penalty(lp, ref, m, estimator="k2").tolist()
        [[0.125, 0.5]]
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(
            f"kl_penalty: estimator must be one of {list(KL_ESTIMATORS)}, got {estimator!r}"
        )
    _check_mask(mask, log_prob, "log_prob")
    _check_same_shape("ref_log_prob", ref_log_prob, "log_prob", log_prob)
    if estimator == "k3":
        return k3_kl(log_prob, ref_log_prob, mask)
    zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    if estimator == "k3_unbiased":
        if old_log_prob is None:
            raise ValueError(
                "kl_penalty: estimator='k3_unbiased' needs old_log_prob (the sampling policy's "
                "log-probs, the PPO old log-probs 'sample_log_prob') for its importance weight"
            )
        _check_same_shape("old_log_prob", old_log_prob, "log_prob", log_prob)
        weight = torch.exp(masked_log_ratio(log_prob, old_log_prob, mask))
        return torch.where(mask, weight * k3_kl(log_prob, ref_log_prob, mask), zero)
    d = masked_log_ratio(log_prob, ref_log_prob, mask)
    term = d if estimator == "k1" else 0.5 * d * d
    return torch.where(mask, term, zero)
