"""What the policy's own sampling probabilities say about how a response is going.

A critic that regresses +-1 outcomes learns how hard each prompt is, but on ``critic_arithmetic``
it does not learn to read the response (docs/evidence.md, "Why the critic stays below its
ceiling"): a wrong step is written, and its value does not move. The policy's log-prob of each
token it sampled carries that information (a digit the policy thought unlikely is usually a wrong
one): those log-probs are a function of the state under the sampling policy, and in every batch
(``rollout_log_prob``). :func:`sampled_log_prob_features` summarises them per token, for the
state before the token (what ``state_value[t]`` sees) and after it (``("next", "state_value")``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ar_torchrl.functional._shapes import _check_mask

__all__ = ["CONFIDENCE_FEATURES", "sampled_log_prob_features"]

#: The summaries :func:`sampled_log_prob_features` returns, in order (its last dimension).
CONFIDENCE_FEATURES = ("lowest", "mean", "last")


def sampled_log_prob_features(log_prob: Tensor, loss_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Per token, over the trained tokens of its row: the lowest, the mean and the last log-prob
    the policy gave a token it sampled, counting the tokens *before* it (``before``: the state
    ``state_value[t]`` is the value of) and *up to and including* it (``through``: the state of
    ``("next", "state_value")[t]``); 0 where no trained token is counted. Tool and prompt tokens
    (off ``loss_mask``) are skipped; so is ``log_prob`` there (its value is ignored).

    Args:
        log_prob: ``[B, L]`` float, the sampling log-prob of each token (``rollout_log_prob``).
        loss_mask: ``[B, L]`` bool, the trained (sampled) tokens.

    Returns:
        ``(before, through)``, each ``[B, L, 3]`` in ``log_prob``'s dtype (features in the order of
        :data:`CONFIDENCE_FEATURES`).

    Example:
        >>> lp = torch.tensor([[0.0, -0.1, -2.0, -0.3]]); m = torch.tensor([[False, True, True, True]])
        >>> before, through = sampled_log_prob_features(lp, m)
        >>> [round(x, 3) for x in before[0, 3].tolist()], [round(x, 3) for x in through[0, 1].tolist()]
        ([-2.0, -1.05, -2.0], [-0.1, -0.1, -0.1])
    """
    _check_mask(loss_mask, log_prob, "log_prob")
    if log_prob.ndim != 2:
        raise ValueError(
            f"sampled_log_prob_features: log_prob must be [B, L], got shape {tuple(log_prob.shape)}"
        )
    lp = torch.where(loss_mask, log_prob, torch.zeros_like(log_prob))
    lowest = torch.cummin(lp, dim=1).values  # 0 before the first trained token: min(0, ...)
    count = loss_mask.to(lp.dtype).cumsum(1)
    mean = lp.cumsum(1) / count.clamp_min(1)
    positions = torch.arange(lp.shape[1], device=lp.device).expand_as(lp)
    index = torch.where(loss_mask, positions, -1).cummax(1).values  # the last trained token so far
    last = torch.where(index >= 0, lp.gather(1, index.clamp_min(0)), torch.zeros_like(lp))
    through = torch.stack([lowest, mean, last], dim=-1)
    before = torch.cat([torch.zeros_like(through[:, :1]), through[:, :-1]], dim=1)
    return before, through
