"""TorchRL environments whose rollouts are token trajectories."""

from ar_torchrl.envs.llm_env import LLMEnv
from ar_torchrl.envs.sampler import EpochSampler

__all__ = ["EpochSampler", "LLMEnv"]
