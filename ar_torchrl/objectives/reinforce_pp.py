"""``ReinforcePPAdvantage``: REINFORCE++ (batch-whitened Monte-Carlo returns) as a TorchRL ``Transform``."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey
from torchrl.envs.transforms import Transform

from ar_torchrl.functional import reinforce_pp_advantage
from ar_torchrl.objectives._keys import (
    policy_tokens,
    require_key,
    squeeze_feature,
    stored_advantages,
)
from ar_torchrl.utils.checks import check_bool, check_number

__all__ = ["ReinforcePPAdvantage"]

_OWNER = "ReinforcePPAdvantage"


class ReinforcePPAdvantage(Transform):
    """REINFORCE++ over a ``[B, L]`` token trajectory: no critic, no groups (Hu et al. 2025,
    https://arxiv.org/abs/2501.03262; verl's ``reinforce_plus_plus``).

    Each trained token's Monte-Carlo return (its row's discounted reward-to-go over ``loss_mask``
    tokens), whitened over every trained token of the batch, is its ``advantage`` ``[B, L, 1]`` (0
    elsewhere): :func:`ar_torchrl.functional.reinforce_pp_advantage` has the equations. The
    baseline is the batch mean, so one sample per prompt works. With a ``policy_mask`` in the
    batch (rows kept for a critic only) the whitening runs over ``loss_mask & policy_mask``, as
    :class:`TokenGAE`'s ``normalize_advantage`` does. A NaN/inf reward is an error naming its row
    and position. The statistics are those of the batch given (the recipe gives every rank the
    whole batch, so they are the same on every rank).

    Call contract (shared with :class:`TokenGAE` and :class:`GRPOAdvantage`): every call
    ``td = module(td)`` recomputes and overwrites the advantage. On a replay buffer register it
    with ``invert=True`` (``rb.append_transform(ReinforcePPAdvantage(), invert=True)``): the
    statistics are then those of the batch written (``extend``), not of a sample.

    Critic: with ``critic_targets=True`` the returns are also written as ``value_target``, so a
    value head attached to the policy keeps learning (as under GRPO).

    Args:
        gamma: discount per trained token, in ``[0, 1]``.
        eps: added to the variance (``>= 0``; verl's 1e-8).
        critic_targets: also write ``value_target`` (the Monte-Carlo returns).

    Example:
        >>> from tensordict import TensorDict
        >>> mask = torch.tensor([[False, True], [False, True], [False, True]])
        >>> td = TensorDict({"loss_mask": mask,
        ...     "next": {"reward": torch.tensor([[[0.0], [1.0]], [[0.0], [0.0]], [[0.0], [0.0]]])}}, [3, 2])
        >>> adv = ReinforcePPAdvantage()(td)["advantage"].squeeze(-1)
        >>> [round(a, 4) for a in adv[:, 1].tolist()], adv[:, 0].tolist()
        ([1.1547, -0.5774, -0.5774], [0.0, 0.0, 0.0])
    """

    @dataclass
    class _AcceptedKeys:
        """Keys read and written (TorchRL names plus ``loss_mask`` and the optional ``policy_mask``)."""

        reward: NestedKey = ("next", "reward")
        loss_mask: NestedKey = "loss_mask"
        policy_mask: NestedKey = "policy_mask"
        advantage: NestedKey = "advantage"
        value_target: NestedKey = "value_target"

    default_keys = _AcceptedKeys

    def __init__(
        self, *, gamma: float = 1.0, eps: float = 1e-8, critic_targets: bool = False
    ) -> None:
        super().__init__(in_keys=[], out_keys=[])
        self.gamma = float(check_number(_OWNER, "gamma", gamma, ge=0, le=1))
        self.eps = float(check_number(_OWNER, "eps", eps, ge=0))
        self.critic_targets = check_bool(_OWNER, "critic_targets", critic_targets)
        self.tensor_keys = self._AcceptedKeys()
        self._refresh_keys()

    def set_keys(self, **keys: NestedKey) -> ReinforcePPAdvantage:
        """Rename keys: ``reward``, ``loss_mask``, ``policy_mask``, ``advantage``, ``value_target``."""
        names = [f.name for f in fields(self._AcceptedKeys)]
        for name, key in keys.items():
            if name not in names:
                raise KeyError(
                    f"{_OWNER}.set_keys: unknown key name {name!r}; expected one of {names}"
                )
            setattr(self.tensor_keys, name, key)
        self._refresh_keys()
        return self

    def _refresh_keys(self) -> None:
        k = self.tensor_keys
        self.in_keys = [k.reward, k.loss_mask]
        self.out_keys = [k.advantage] + ([k.value_target] if self.critic_targets else [])

    def compute(self, td: TensorDictBase) -> TensorDictBase:
        """Compute advantages (and value targets) for ``td``: what every call does."""
        if td.batch_dims != 2:
            raise ValueError(
                f"{_OWNER} expects a [B, L] token trajectory, got batch_size {tuple(td.batch_size)}"
            )
        k, shape = self.tensor_keys, td.batch_size
        mask = squeeze_feature(
            require_key(td, k.loss_mask, _OWNER, "bool [B, L], True on generated tokens"),
            k.loss_mask,
            shape,
            _OWNER,
        )
        if mask.dtype != torch.bool:
            raise TypeError(f"{_OWNER}: {k.loss_mask!r} must be bool, got {mask.dtype}")
        reward = squeeze_feature(
            require_key(td, k.reward, _OWNER, "per-token reward"), k.reward, shape, _OWNER
        )
        policy = policy_tokens(td, k.policy_mask, mask, _OWNER)
        adv, returns = reinforce_pp_advantage(
            reward, mask, gamma=self.gamma, policy_mask=policy, eps=self.eps
        )
        td.set(k.advantage, adv.unsqueeze(-1))
        if self.critic_targets:
            td.set(k.value_target, returns.unsqueeze(-1))
        return td

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        return self.compute(tensordict)

    def _call(self, next_tensordict: TensorDictBase) -> TensorDictBase:
        # The write side of ``rb.append_transform(self, invert=True)``: the batch written.
        return self.compute(next_tensordict)

    def _inv_call(self, tensordict: TensorDictBase) -> TensorDictBase:
        # The read side of ``invert=True`` (samples keep the stored advantages), or the write side
        # of a registration without ``invert=True``, which would whiten over each sample instead.
        return stored_advantages(
            tensordict,
            self.tensor_keys.advantage,
            _OWNER,
            "advantages are whitened over the batch written (extend), not over each sample",
        )
