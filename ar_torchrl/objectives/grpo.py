"""``GRPOAdvantage``: group-relative advantages as a TorchRL ``Transform`` (same call as ``TokenGAE``)."""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, fields

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey
from torchrl.envs.transforms import Transform

from ar_torchrl.functional import check_finite_reward, grpo_advantage, token_gae
from ar_torchrl.objectives._keys import require_key, squeeze_feature, stored_advantages
from ar_torchrl.utils.checks import check_grpo_args

__all__ = ["GRPOAdvantage"]

logger = logging.getLogger(__name__)


class GRPOAdvantage(Transform):
    """Group-relative advantage over a ``[B, L]`` token trajectory, broadcast to ``loss_mask`` tokens.

    Sequence reward = sum of ``("next", "reward")`` over the row; rows are grouped by ``prompt_id``;
    advantage = ``(r - mean_group) / (std_group + eps)`` (``scale=False``: Dr.GRPO, no division),
    written as ``advantage`` ``[B, L, 1]`` on ``loss_mask`` tokens and 0 elsewhere (see
    :func:`ar_torchrl.functional.grpo_advantage`). Groups whose rewards are all equal carry no signal
    (advantage 0); they are counted in :attr:`stats`. DAPO's dynamic sampling (drop them and sample
    more prompts) is the collector's job: ``WeightSyncCollector(dynamic_sampling=True)``. A NaN/inf
    reward is an error naming its row and position. :class:`~ar_torchrl.objectives.RLOOAdvantage`
    is the same module with RLOO's leave-one-out baseline.

    Call contract (shared with :class:`TokenGAE`, as TorchRL's value estimators): every call
    ``td = module(td)`` recomputes and overwrites the advantage. :attr:`stats` describes the last
    call only: ``groups`` and ``groups_zero_spread`` of that batch.

    Replay buffers: register it with TorchRL's ``invert=True``
    (``rb.append_transform(GRPOAdvantage(), invert=True)``): the advantage is then computed when
    complete groups are written (``extend``), and sampled batches keep the stored values (a sample
    holds partial groups, so recomputing there would be wrong; TorchRL's ``MCAdvantage`` also computes
    on the write side). Registered without ``invert=True`` it raises on the first ``extend``.

    Keys are TorchRL-style: declared once in :class:`_AcceptedKeys`, changed with :meth:`set_keys`.
    The reward key is named as for :class:`TokenGAE` (and TorchRL's value estimators): ``reward``
    is ``"reward"`` and is read under ``"next"``, so ``set_keys(reward="r")`` reads ``("next", "r")``
    in every advantage module. (Until 0.1 this module took the full path, ``("next", "reward")``;
    ``set_keys(reward=("next", ...))`` still works for one release, with a ``DeprecationWarning``.)

    Critic under GRPO: with ``critic_targets=True`` the module also writes ``value_target``
    ``[B, L, 1]``, the Monte-Carlo return (discounted reward-to-go over ``loss_mask`` tokens,
    ``token_gae`` with ``V = 0`` and ``lambda = 1``), so a value head attached to the policy keeps
    learning on its own targets while GRPO supplies the advantage (switching back to GAE later then
    starts from a trained critic). With ``critic_targets=False`` no ``value_target`` is written and
    the loss must run without a critic (``TokenPPOLoss(critic_coeff=0)``).

    Args:
        scale: divide by the group std (GRPO); ``False`` for Dr.GRPO.
        eps: added to the std (``>= 0``).
        critic_targets: also write ``value_target`` (Monte-Carlo returns) for a value head.
        gamma: discount of those returns (``critic_targets`` only), in ``[0, 1]``.

    Example:
        >>> from tensordict import TensorDict
        >>> mask = torch.tensor([[False, True], [False, True]])
        >>> td = TensorDict({"loss_mask": mask, "prompt_id": torch.zeros(2, 2, dtype=torch.long),
        ...     "next": {"reward": torch.tensor([[[0.0], [1.0]], [[0.0], [-1.0]]])}}, [2, 2])
        >>> grpo = GRPOAdvantage()
        >>> [[round(a, 4) for a in row] for row in grpo(td)["advantage"].squeeze(-1).tolist()]
        [[0.0, 0.7071], [0.0, -0.7071]]
        >>> grpo.stats
        {'groups': 1, 'groups_zero_spread': 0}
    """

    @dataclass
    class _AcceptedKeys:
        """Keys read and written (TorchRL names plus ``loss_mask`` and the group id ``prompt_id``)."""

        reward: NestedKey = "reward"  # read under "next", as TokenGAE's
        loss_mask: NestedKey = "loss_mask"
        group: NestedKey = "prompt_id"
        advantage: NestedKey = "advantage"
        value_target: NestedKey = "value_target"

    default_keys = _AcceptedKeys

    @property
    def _owner(self) -> str:
        return type(self).__name__

    def __init__(
        self,
        *,
        scale: bool = True,
        eps: float = 1e-6,
        critic_targets: bool = False,
        gamma: float = 1.0,
    ) -> None:
        args = check_grpo_args(
            self._owner,
            scale=scale,
            eps=eps,
            critic_targets=critic_targets,
            gamma=gamma,
        )
        super().__init__(in_keys=[], out_keys=[])
        self.scale, self.eps = args["scale"], args["eps"]
        self.critic_targets, self.gamma = args["critic_targets"], args["gamma"]
        self.tensor_keys = self._AcceptedKeys()
        self._refresh_keys()
        self.stats: dict[str, int] = {"groups": 0, "groups_zero_spread": 0}

    def set_keys(self, **keys: NestedKey) -> GRPOAdvantage:
        """Rename keys: ``reward`` (read under ``"next"``), ``loss_mask``, ``group``,
        ``advantage``, ``value_target``."""
        names = [f.name for f in fields(self._AcceptedKeys)]
        for name, key in keys.items():
            if name not in names:
                raise KeyError(
                    f"{self._owner}.set_keys: unknown key name {name!r}; expected one of {names}"
                )
            if name == "reward":
                key = self._reward_name(key)
            setattr(self.tensor_keys, name, key)
        self._refresh_keys()
        return self

    def _reward_name(self, key: NestedKey) -> NestedKey:
        """The 0.1 spelling ``("next", name)`` -> ``name`` (one release, with a warning)."""
        if isinstance(key, tuple) and len(key) > 1 and key[0] == "next":
            new = key[1] if len(key) == 2 else key[1:]
            warnings.warn(
                f"{self._owner}.set_keys(reward={key!r}): the reward key is now read under "
                f"'next', as TokenGAE's: write set_keys(reward={new!r}); the full path goes in "
                "ar_torchrl 0.2",
                DeprecationWarning,
                stacklevel=3,
            )
            return new
        return key

    @property
    def reward_key(self) -> NestedKey:
        """The full path of the reward read: ``("next", tensor_keys.reward)``."""
        reward = self.tensor_keys.reward
        return ("next", *reward) if isinstance(reward, tuple) else ("next", reward)

    def _refresh_keys(self) -> None:
        k = self.tensor_keys
        self.in_keys = [self.reward_key, k.loss_mask, k.group]
        self.out_keys = [k.advantage] + ([k.value_target] if self.critic_targets else [])

    def compute(self, td: TensorDictBase) -> TensorDictBase:
        """Compute advantages for ``td`` (what every call does); updates :attr:`stats`."""
        if td.batch_dims != 2:
            raise ValueError(
                f"{self._owner} expects a [B, L] token trajectory, got batch_size {tuple(td.batch_size)}"
            )
        k, shape = self.tensor_keys, td.batch_size
        mask = require_key(td, k.loss_mask, self._owner, "bool [B, L]").bool()
        key = self.reward_key
        reward = squeeze_feature(
            require_key(td, key, self._owner, "per-token reward"), key, shape, self._owner
        )
        check_finite_reward(reward, self._owner, f"reward {key!r}")
        stray = (reward != 0) & ~mask
        if stray.any():
            raise ValueError(
                f"{self._owner}: {int(stray.sum())} non-zero reward(s) on masked tokens; rewards "
                "belong on loss_mask tokens (the last generated token for the task reward)"
            )
        group = require_key(td, k.group, self._owner, "group id per row (stored [B, L])")
        group = group.reshape(shape[0], -1)[:, 0] if group.ndim > 1 else group
        adv, flat = self.group_advantage(reward.sum(-1), group.long())
        self._count(group, flat)
        td.set(k.advantage, torch.where(mask, adv.unsqueeze(-1), 0.0).unsqueeze(-1))
        if self.critic_targets:  # Monte-Carlo return: GAE with V = 0 and lambda = 1
            _, ret = token_gae(reward, torch.zeros_like(reward), mask, gamma=self.gamma, lmbda=1.0)
            td.set(k.value_target, ret.unsqueeze(-1))
        return td

    def group_advantage(self, seq_reward: torch.Tensor, group: torch.Tensor):
        """``(advantage [B], zero_spread [B])`` of the sequence rewards: GRPO's z-score."""
        return grpo_advantage(seq_reward, group, scale=self.scale, eps=self.eps)

    def _count(self, group: torch.Tensor, flat: torch.Tensor) -> None:
        groups, flat_groups = torch.unique(group), torch.unique(group[flat])
        self.stats = {"groups": int(groups.numel()), "groups_zero_spread": int(flat_groups.numel())}
        if flat_groups.numel():
            logger.debug(
                "%s: %d of %d groups have zero spread",
                type(self).__name__,
                flat_groups.numel(),
                groups.numel(),
            )

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        return self.compute(tensordict)

    def _call(self, next_tensordict: TensorDictBase) -> TensorDictBase:
        # The write side of ``rb.append_transform(self, invert=True)`` (TorchRL's ``Compose.inv``
        # reaches an inverted transform's ``_call``): compute on the complete groups written.
        return self.compute(next_tensordict)

    def _inv_call(self, tensordict: TensorDictBase) -> TensorDictBase:
        # The read side of ``invert=True`` (samples keep the stored advantages), or the write side of a
        # registration without ``invert=True``, which would recompute on partial groups when sampled.
        return stored_advantages(
            tensordict,
            self.tensor_keys.advantage,
            self._owner,
            "advantages are computed when complete groups are written (extend), not on samples",
        )
