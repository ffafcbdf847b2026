"""Advantage modules and the PPO loss for token trajectories.

The estimator registry (:mod:`ar_torchrl.objectives.registry`, with the built-in schemas in
:mod:`ar_torchrl.objectives.config`) imports nothing heavy; the classes below are imported on first
access (PEP 562), so ``import ar_torchrl.objectives.registry`` does not import torch (the recipe
checks ``algo.advantage_mode``, ``algo.policy_loss`` and ``algo.rollout_correction`` before it loads
the training stack). A class is listed once, in ``_LAZY`` (name -> its module); ``__all__`` follows.
"""

from __future__ import annotations

from ar_torchrl._lazy import lazy_exports
from ar_torchrl.objectives.policy_loss import (
    POLICY_LOSSES,
    ROLLOUT_CORRECTION_PRESETS,
    RolloutCorrection,
    make_policy_loss,
    policy_loss_names,
    register_policy_loss,
)
from ar_torchrl.objectives.registry import (
    ADVANTAGES,
    advantage_names,
    make_advantage,
    needs_critic,
    register_advantage,
)

#: the torch classes, imported on first access: name -> module
_LAZY = {
    "GRPOAdvantage": "grpo",
    "KLRewardShaping": "kl_reward",
    "RLOOAdvantage": "rloo",
    "ReinforcePPAdvantage": "reinforce_pp",
    "TokenGAE": "gae",
    "TokenPPOLoss": "ppo",
}

__all__ = [
    "ADVANTAGES",
    "POLICY_LOSSES",
    "ROLLOUT_CORRECTION_PRESETS",
    "RolloutCorrection",
    "advantage_names",
    "make_advantage",
    "make_policy_loss",
    "needs_critic",
    "policy_loss_names",
    "register_advantage",
    "register_policy_loss",
    *_LAZY,
]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
