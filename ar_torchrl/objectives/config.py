"""The built-in advantage estimators' torch-free config schemas, registered with their factories.

Each schema is a dataclass of the estimator's own options (``gamma`` is the recipe's shared
``algo.gamma``, given to every factory) with ``check(prefix)`` applying the library's range checks
(:mod:`ar_torchrl.utils.checks`); each factory imports its class when called. A recipe reads the
schemas from :data:`~ar_torchrl.objectives.registry.ADVANTAGES` (``algo.<name>.*`` keys) before it
imports torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ar_torchrl.objectives.registry import register_advantage
from ar_torchrl.utils.checks import check_gae_args, check_grpo_args

__all__ = ["GAEConfig", "GRPOConfig", "RLOOConfig"]


@dataclass
class GAEConfig:
    """Options of :class:`~ar_torchrl.objectives.TokenGAE` besides ``gamma``."""

    lmbda: float = 0.95  # GAE lambda
    normalize_advantage: bool = True  # whiten advantages over trained tokens
    timestep: str = "token"  # GAE step: token | turn (one per turn of multi-turn rows)

    def check(self, prefix: str) -> None:
        check_gae_args(prefix, **asdict(self))


@register_advantage("gae", needs_critic=True, config=GAEConfig)
def _token_gae(options: GAEConfig, *, critic: bool, gamma: float) -> Any:
    """Token-level GAE over the value head (:class:`~ar_torchrl.objectives.TokenGAE`)."""
    from ar_torchrl.objectives.gae import TokenGAE

    return TokenGAE(gamma=gamma, **asdict(options))


@dataclass
class GRPOConfig:
    """Options of :class:`~ar_torchrl.objectives.GRPOAdvantage` besides ``gamma``."""

    scale: bool = True  # divide by the group std (False: Dr.GRPO)

    def check(self, prefix: str) -> None:
        check_grpo_args(prefix, **asdict(self))


@register_advantage("grpo", config=GRPOConfig)
def _grpo(options: GRPOConfig, *, critic: bool, gamma: float) -> Any:
    """GRPO group z-scores (:class:`~ar_torchrl.objectives.GRPOAdvantage`).

    With a value head (``critic=True``) it also writes Monte-Carlo returns as ``value_target``
    (``critic_targets=True``), so swapping GAE for GRPO keeps the head training.
    """
    from ar_torchrl.objectives.grpo import GRPOAdvantage

    return GRPOAdvantage(critic_targets=critic, gamma=gamma, **asdict(options))


@dataclass
class RLOOConfig:
    """Options of :class:`~ar_torchrl.objectives.RLOOAdvantage` besides ``gamma`` (none)."""


@register_advantage("rloo", config=RLOOConfig)
def _rloo(options: RLOOConfig, *, critic: bool, gamma: float) -> Any:
    """RLOO leave-one-out baselines (:class:`~ar_torchrl.objectives.RLOOAdvantage`); with a value
    head it writes Monte-Carlo value targets, as GRPO does."""
    from ar_torchrl.objectives.rloo import RLOOAdvantage

    return RLOOAdvantage(critic_targets=critic, gamma=gamma)
