"""Advantage modules and the PPO loss for token trajectories."""

from ar_torchrl.objectives.anchors import recompute_anchors
from ar_torchrl.objectives.gae import TokenGAE
from ar_torchrl.objectives.grpo import GRPOAdvantage
from ar_torchrl.objectives.ppo import TokenPPOLoss

#: The registry of advantage modes (``algo.advantage_mode`` in the recipe).
ADVANTAGE_MODES = {"gae": TokenGAE, "grpo": GRPOAdvantage}

__all__ = ["ADVANTAGE_MODES", "GRPOAdvantage", "TokenGAE", "TokenPPOLoss", "recompute_anchors"]
