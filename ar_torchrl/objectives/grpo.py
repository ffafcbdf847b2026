"""``GRPOAdvantage``: group-relative advantages as a TorchRL ``Transform`` (same call as ``TokenGAE``)."""

from __future__ import annotations

import logging

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey
from torchrl.envs.transforms import Transform

from ar_torchrl.functional import grpo_advantage, token_gae
from ar_torchrl.objectives.gae import require_key, squeeze_feature

__all__ = ["GRPOAdvantage"]

logger = logging.getLogger(__name__)


class GRPOAdvantage(Transform):
    """Group-relative advantage over a ``[B, L]`` token trajectory, broadcast to ``loss_mask`` tokens.

    Sequence reward = sum of ``("next", "reward")`` over the row; rows are grouped by ``prompt_id``;
    advantage = ``(r - mean_group) / (std_group + eps)`` (``scale=False``: Dr.GRPO, no division),
    written as ``advantage`` ``[B, L, 1]`` on ``loss_mask`` tokens and 0 elsewhere (see
    :func:`ar_torchrl.functional.grpo_advantage`). Groups whose rewards are all equal carry no signal:
    they are counted in :attr:`stats` and, with ``drop_zero_spread=True`` (DAPO dynamic sampling),
    their rows are removed from the batch.

    It is called like :class:`TokenGAE` (``td = module(td)``) and can sit on the write side of a
    TorchRL ``ReplayBuffer`` (``rb.append_transform(GRPOAdvantage())``), like TorchRL's
    ``MCAdvantage``: advantages are computed when complete groups are written (``extend``), and the
    read side leaves them untouched. A plain call on a batch that already holds the advantage key
    also leaves it untouched: delete the key to recompute.

    Critic under GRPO: with ``critic_targets=True`` the module also writes ``value_target``
    ``[B, L, 1]``, the Monte-Carlo return (discounted reward-to-go over ``loss_mask`` tokens,
    ``token_gae`` with ``V = 0`` and ``lambda = 1``), so a value head attached to the policy keeps
    learning on its own targets while GRPO supplies the advantage (switching back to GAE later then
    starts from a trained critic). With ``critic_targets=False`` no ``value_target`` is written and
    the loss must run without a critic (``TokenPPOLoss(critic_coeff=0)``).

    Args:
        scale: divide by the group std (GRPO); ``False`` for Dr.GRPO.
        eps: added to the std.
        drop_zero_spread: remove rows of zero-spread groups (dynamic sampling).
        critic_targets: also write ``value_target`` (Monte-Carlo returns) for a value head.
        gamma: discount of those returns (``critic_targets`` only).

    Example:
        >>> from tensordict import TensorDict
        >>> mask = torch.tensor([[False, True], [False, True]])
        >>> td = TensorDict({"loss_mask": mask, "prompt_id": torch.zeros(2, 2, dtype=torch.long),
        ...     "next": {"reward": torch.tensor([[[0.0], [1.0]], [[0.0], [-1.0]]])}}, [2, 2])
        >>> [[round(a, 4) for a in row] for row in GRPOAdvantage()(td)["advantage"].squeeze(-1).tolist()]
        [[0.0, 0.7071], [0.0, -0.7071]]
    """

    def __init__(
        self,
        *,
        scale: bool = True,
        eps: float = 1e-6,
        drop_zero_spread: bool = False,
        critic_targets: bool = False,
        gamma: float = 1.0,
        reward_key: NestedKey = ("next", "reward"),
        loss_mask_key: NestedKey = "loss_mask",
        group_key: NestedKey = "prompt_id",
        advantage_key: NestedKey = "advantage",
        value_target_key: NestedKey = "value_target",
    ) -> None:
        if eps < 0:
            raise ValueError(f"GRPOAdvantage: eps must be >= 0, got {eps}")
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"GRPOAdvantage: gamma must be in [0, 1], got {gamma}")
        out_keys = [advantage_key] + ([value_target_key] if critic_targets else [])
        super().__init__(in_keys=[reward_key, loss_mask_key, group_key], out_keys=out_keys)
        self.scale = scale
        self.eps = float(eps)
        self.drop_zero_spread = drop_zero_spread
        self.critic_targets, self.gamma = critic_targets, float(gamma)
        self.reward_key, self.loss_mask_key = reward_key, loss_mask_key
        self.group_key, self.advantage_key = group_key, advantage_key
        self.value_target_key = value_target_key
        self.stats: dict[str, int] = {"groups": 0, "zero_spread_groups": 0, "dropped_rows": 0}

    def set_keys(self, **keys: NestedKey) -> GRPOAdvantage:
        """Rename ``reward``, ``loss_mask``, ``group`` or ``advantage`` keys (TorchRL style)."""
        for name, key in keys.items():
            if name not in ("reward", "loss_mask", "group", "advantage", "value_target"):
                raise KeyError(f"GRPOAdvantage.set_keys: unknown key name {name!r}")
            setattr(self, f"{name}_key", key)
        self.in_keys = [self.reward_key, self.loss_mask_key, self.group_key]
        self.out_keys = [self.advantage_key] + (
            [self.value_target_key] if self.critic_targets else []
        )
        return self

    def compute(self, td: TensorDictBase) -> TensorDictBase:
        """Compute advantages for ``td`` (always; the other entry points may skip)."""
        if td.batch_dims != 2:
            raise ValueError(
                f"GRPOAdvantage expects a [B, L] token trajectory, got batch_size {tuple(td.batch_size)}"
            )
        shape = td.batch_size
        mask = require_key(td, self.loss_mask_key, "GRPOAdvantage", "bool [B, L]").bool()
        reward = squeeze_feature(
            require_key(td, self.reward_key, "GRPOAdvantage", "per-token reward"),
            self.reward_key,
            shape,
            "GRPOAdvantage",
        )
        stray = (reward != 0) & ~mask
        if stray.any():
            raise ValueError(
                f"GRPOAdvantage: {int(stray.sum())} non-zero reward(s) on masked tokens; rewards "
                "belong on loss_mask tokens (the last generated token for the task reward)"
            )
        group = require_key(td, self.group_key, "GRPOAdvantage", "group id per row (stored [B, L])")
        group = group.reshape(shape[0], -1)[:, 0] if group.ndim > 1 else group
        adv, flat = grpo_advantage(reward.sum(-1), group.long(), scale=self.scale, eps=self.eps)
        self._count(group, flat)
        td.set(self.advantage_key, torch.where(mask, adv.unsqueeze(-1), 0.0).unsqueeze(-1))
        if self.critic_targets:  # Monte-Carlo return: GAE with V = 0 and lambda = 1
            _, ret = token_gae(reward, torch.zeros_like(reward), mask, gamma=self.gamma, lmbda=1.0)
            td.set(self.value_target_key, ret.unsqueeze(-1))
        if self.drop_zero_spread and flat.any():
            self.stats["dropped_rows"] += int(flat.sum())
            td = td[~flat]
        return td

    def _count(self, group: torch.Tensor, flat: torch.Tensor) -> None:
        groups = torch.unique(group)
        flat_groups = torch.unique(group[flat])
        self.stats["groups"] += int(groups.numel())
        self.stats["zero_spread_groups"] += int(flat_groups.numel())
        if flat_groups.numel():
            logger.debug(
                "GRPOAdvantage: %d of %d groups have zero spread",
                flat_groups.numel(),
                groups.numel(),
            )

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        if tensordict.get(self.advantage_key, None) is not None:
            return tensordict
        return self.compute(tensordict)

    def _inv_call(self, tensordict: TensorDictBase) -> TensorDictBase:
        return self.compute(tensordict)

    def _call(self, next_tensordict: TensorDictBase) -> TensorDictBase:
        return next_tensordict
