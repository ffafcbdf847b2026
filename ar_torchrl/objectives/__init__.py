"""Advantage modules and the PPO loss for token trajectories.

The estimator registry (:mod:`ar_torchrl.objectives.registry`) imports nothing heavy; the classes
below are imported on first access (PEP 562), so ``import ar_torchrl.objectives.registry`` does not
import torch (the recipe checks ``algo.advantage_mode`` before it loads the training stack).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ar_torchrl.objectives.registry import (
    advantage_names,
    make_advantage,
    needs_critic,
    register_advantage,
)

if TYPE_CHECKING:
    from ar_torchrl.objectives.anchors import recompute_anchors
    from ar_torchrl.objectives.gae import TokenGAE
    from ar_torchrl.objectives.grpo import GRPOAdvantage
    from ar_torchrl.objectives.ppo import TokenPPOLoss

_LAZY = {
    "GRPOAdvantage": "grpo",
    "TokenGAE": "gae",
    "TokenPPOLoss": "ppo",
    "recompute_anchors": "anchors",
}

__all__ = [
    "GRPOAdvantage",
    "TokenGAE",
    "TokenPPOLoss",
    "advantage_names",
    "make_advantage",
    "needs_critic",
    "recompute_anchors",
    "register_advantage",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
