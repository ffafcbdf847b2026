"""``KLRewardShaping``: the KL to a reference policy as a per-token reward, before the advantage.

The classic PPO-RLHF form (InstructGPT; verl's ``algorithm.use_kl_in_reward``): every trained token
gets ``-beta * k(x_t)`` added to its reward, with ``k`` a per-token estimate of
KL(pi_old || pi_ref) over the *sampling* policy's log-probs (the PPO old log-probs ``sample_log_prob``, no gradient). GAE
then turns the penalty into advantages and value targets: the critic learns the KL-regularised
return, and the policy gradient of the penalty is a proper score-function gradient of the reverse
KL (unlike a ``k3`` loss term, whose gradient is the forward KL's; see
:mod:`ar_torchrl.functional.kl`). ``k1`` is the default: the unbiased estimate, as verl's default
``kl_penalty: kl``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from tensordict import TensorDictBase
from tensordict.utils import NestedKey
from torchrl.envs.transforms import Transform

from ar_torchrl.functional import kl_penalty, masked_mean
from ar_torchrl.objectives._keys import require_key, squeeze_feature
from ar_torchrl.utils.checks import check_choice, check_number

__all__ = ["KLRewardShaping"]


class KLRewardShaping(Transform):
    """Add ``-beta * kl_penalty(sample_log_prob, ref_log_prob)`` to ``("next", "reward")`` on the
    trained tokens of a ``[B, L]`` token trajectory (a TorchRL ``Transform``; call it before
    :class:`~ar_torchrl.objectives.TokenGAE`).

    Args:
        beta: the KL coefficient (``> 0``).
        estimator: ``"k1"`` (default, unbiased), ``"k2"`` or ``"k3"`` (the sampling policy's
            log-probs are ``sample_log_prob``, so ``"k3_unbiased"`` would equal ``"k3"`` and is refused).

    Reads ``sample_log_prob`` and ``ref_log_prob`` (``recompute_old_log_probs_and_values(..., ref_actor=...)``) and
    ``loss_mask``; writes the shaped reward in place. :attr:`last_kl` is the mean penalty term
    ``k`` over the trained tokens of the last call (a metric). Keys are renamed with
    :meth:`set_keys`.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> td = TensorDict({"loss_mask": torch.tensor([[False, True, True]]),
        ...     "sample_log_prob": torch.tensor([[0.0, -1.0, -2.0]]),
        ...     "ref_log_prob": torch.tensor([[0.0, -1.5, -1.0]]),
        ...     "next": {"reward": torch.tensor([[[0.0], [0.0], [1.0]]])}}, [1, 3])
        >>> shaping = KLRewardShaping(beta=0.1)
        >>> [[round(r, 4) for r in row] for row in shaping(td)["next", "reward"].squeeze(-1).tolist()]
        [[0.0, -0.05, 1.1]]
        >>> shaping.last_kl  # k1: mean of (-1 - -1.5, -2 - -1) over the trained tokens
        -0.25
    """

    @dataclass
    class _AcceptedKeys:
        """Keys read and written."""

        reward: NestedKey = ("next", "reward")
        loss_mask: NestedKey = "loss_mask"
        sample_log_prob: NestedKey = "sample_log_prob"
        ref_log_prob: NestedKey = "ref_log_prob"

    default_keys = _AcceptedKeys

    def __init__(self, beta: float, *, estimator: str = "k1") -> None:
        owner = type(self).__name__
        self.beta = float(check_number(owner, "beta", beta, gt=0))
        check_choice(owner, "estimator", estimator, ("k1", "k2", "k3"))
        super().__init__(in_keys=[], out_keys=[])
        self.estimator = estimator
        self.tensor_keys = self._AcceptedKeys()
        self._refresh_keys()
        self.last_kl = 0.0

    def set_keys(self, **keys: NestedKey) -> KLRewardShaping:
        """Rename keys: ``reward``, ``loss_mask``, ``sample_log_prob``, ``ref_log_prob``."""
        names = [f.name for f in fields(self._AcceptedKeys)]
        for name, key in keys.items():
            if name not in names:
                raise KeyError(
                    f"KLRewardShaping.set_keys: unknown key name {name!r}; expected one of {names}"
                )
            setattr(self.tensor_keys, name, key)
        self._refresh_keys()
        return self

    def _refresh_keys(self) -> None:
        k = self.tensor_keys
        self.in_keys = [k.reward, k.loss_mask, k.sample_log_prob, k.ref_log_prob]
        self.out_keys = [k.reward]

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        owner, k = type(self).__name__, self.tensor_keys
        if td.batch_dims != 2:
            raise ValueError(
                f"{owner} expects a [B, L] token trajectory, got batch_size {tuple(td.batch_size)}"
            )
        mask = require_key(td, k.loss_mask, owner, "bool [B, L]").bool()
        old = require_key(
            td, k.sample_log_prob, owner, "the anchors: recompute_old_log_probs_and_values(...)"
        )
        ref = require_key(
            td,
            k.ref_log_prob,
            owner,
            "reference log-probs: recompute_old_log_probs_and_values(..., ref_actor=...)",
        )
        reward = require_key(td, k.reward, owner, "per-token reward")
        kl = kl_penalty(old.detach(), ref.detach(), mask, estimator=self.estimator)
        shaped = squeeze_feature(reward, k.reward, td.batch_size, owner) - self.beta * kl
        td.set(k.reward, shaped.reshape(reward.shape))
        self.last_kl = float(masked_mean(kl, mask))
        return td

    def _call(self, next_tensordict: TensorDictBase) -> TensorDictBase:
        return self.forward(next_tensordict)

    def extra_repr(self) -> str:
        return f"beta={self.beta}, estimator={self.estimator!r}"
