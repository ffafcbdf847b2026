"""``RLOOAdvantage``: REINFORCE leave-one-out advantages, a drop-in for ``GRPOAdvantage``."""

from __future__ import annotations

import torch

from ar_torchrl.functional import rloo_advantage
from ar_torchrl.objectives.grpo import GRPOAdvantage

__all__ = ["RLOOAdvantage"]


class RLOOAdvantage(GRPOAdvantage):
    """RLOO over a ``[B, L]`` token trajectory: each sample's baseline is the mean reward of the
    *other* samples of its prompt (:func:`ar_torchrl.functional.rloo_advantage`), broadcast to its
    ``loss_mask`` tokens (Ahmadian et al. 2024, https://arxiv.org/abs/2402.14740; verl's ``rloo``,
    TRL's ``RLOOTrainer``).

    Everything else is :class:`GRPOAdvantage`'s: the call (``td = module(td)``), the keys and
    :meth:`set_keys`, :attr:`stats`, the replay-buffer registration and ``critic_targets``. There
    is no std scaling (``scale`` and ``eps`` are not arguments).

    Args:
        critic_targets: also write ``value_target`` (Monte-Carlo returns) for a value head.
        gamma: discount of those returns, in ``[0, 1]``.

    Example:
        >>> from tensordict import TensorDict
        >>> mask = torch.tensor([[False, True]] * 3)
        >>> td = TensorDict({"loss_mask": mask, "prompt_id": torch.zeros(3, 2, dtype=torch.long),
        ...     "next": {"reward": torch.tensor([[[0.0], [1.0]], [[0.0], [0.0]], [[0.0], [0.0]]])}}, [3, 2])
        >>> RLOOAdvantage()(td)["advantage"].squeeze(-1)[:, 1].tolist()
        [1.0, -0.5, -0.5]
    """

    def __init__(self, *, critic_targets: bool = False, gamma: float = 1.0) -> None:
        super().__init__(scale=False, critic_targets=critic_targets, gamma=gamma)

    def group_advantage(self, seq_reward: torch.Tensor, group: torch.Tensor):
        """``(advantage [B], zero_spread [B])``: RLOO's leave-one-out baseline."""
        return rloo_advantage(seq_reward, group)
