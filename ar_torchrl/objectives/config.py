"""The built-in advantage estimators' torch-free config schemas, each registered with the one
decorator (:mod:`ar_torchrl.registry`).

Each schema is a dataclass of the estimator's own options (``gamma`` is the recipe's shared
``algo.gamma``, given to every ``build``) with ``check(prefix)`` applying the library's range checks
(:mod:`ar_torchrl.utils.checks`, the ones the class applies); ``build`` imports its class when
called. A recipe reads the schemas from :data:`~ar_torchrl.objectives.registry.ADVANTAGES`
(``algo.<name>.*`` keys) before it imports torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

from ar_torchrl.objectives.registry import register_advantage
from ar_torchrl.utils.checks import check_gae_args, check_grpo_args

# OmegaConf reads the annotations at run time: they must stay `Optional[...]`, not `X | None`.
# ruff: noqa: UP045

__all__ = ["GAEConfig", "GRPOConfig", "RLOOConfig", "ReinforcePPConfig"]


@register_advantage("gae", needs_critic=True, help="token-level GAE over the value head")
@dataclass
class GAEConfig:
    """Options of :class:`~ar_torchrl.objectives.TokenGAE` besides ``gamma``."""

    lmbda: float = 0.95  # GAE lambda
    critic_lmbda: Optional[float] = None  # lambda of the value target (None: lmbda; VAPO: 1.0)
    normalize_advantage: bool = True  # whiten advantages over trained tokens
    timestep: str = "token"  # GAE step: token | turn (one per turn of multi-turn rows)

    def check(self, prefix: str) -> None:
        check_gae_args(prefix, **asdict(self))

    def build(self, *, critic: bool, gamma: float) -> Any:
        """Token-level GAE over the value head (:class:`~ar_torchrl.objectives.TokenGAE`)."""
        from ar_torchrl.objectives.gae import TokenGAE

        return TokenGAE(gamma=gamma, **asdict(self))


@register_advantage("grpo", help="GRPO group z-scores (no critic needed)")
@dataclass
class GRPOConfig:
    """Options of :class:`~ar_torchrl.objectives.GRPOAdvantage` besides ``gamma``."""

    scale: bool = True  # divide by the group std (False: Dr.GRPO)

    def check(self, prefix: str) -> None:
        check_grpo_args(prefix, **asdict(self))

    def build(self, *, critic: bool, gamma: float) -> Any:
        """GRPO group z-scores (:class:`~ar_torchrl.objectives.GRPOAdvantage`).

        With a value head (``critic=True``) it also writes Monte-Carlo returns as ``value_target``
        (``critic_targets=True``), so swapping GAE for GRPO keeps the head training.
        """
        from ar_torchrl.objectives.grpo import GRPOAdvantage

        return GRPOAdvantage(critic_targets=critic, gamma=gamma, **asdict(self))


@register_advantage("rloo", help="RLOO leave-one-out baselines (no critic needed)")
@dataclass
class RLOOConfig:
    """Options of :class:`~ar_torchrl.objectives.RLOOAdvantage` besides ``gamma`` (none)."""

    def build(self, *, critic: bool, gamma: float) -> Any:
        """RLOO leave-one-out baselines (:class:`~ar_torchrl.objectives.RLOOAdvantage`); with a
        value head it writes Monte-Carlo value targets, as GRPO does."""
        from ar_torchrl.objectives.rloo import RLOOAdvantage

        return RLOOAdvantage(critic_targets=critic, gamma=gamma)


@register_advantage(
    "reinforce_pp", help="REINFORCE++ returns whitened over the batch (no critic, no groups)"
)
@dataclass
class ReinforcePPConfig:
    """Options of :class:`~ar_torchrl.objectives.ReinforcePPAdvantage` besides ``gamma`` (none)."""

    def build(self, *, critic: bool, gamma: float) -> Any:
        """REINFORCE++ (:class:`~ar_torchrl.objectives.ReinforcePPAdvantage`): Monte-Carlo returns
        discounted by ``gamma``, whitened over the batch; with a value head they are also its
        targets (``critic_targets=True``), as under GRPO."""
        from ar_torchrl.objectives.reinforce_pp import ReinforcePPAdvantage

        return ReinforcePPAdvantage(critic_targets=critic, gamma=gamma)
