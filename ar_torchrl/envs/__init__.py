"""TorchRL environments whose rollouts are token trajectories."""

from ar_torchrl.envs.llm_env import EpochSampler, LLMEnv

__all__ = ["EpochSampler", "LLMEnv"]
