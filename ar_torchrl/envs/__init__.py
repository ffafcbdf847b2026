"""TorchRL environments whose samples become token trajectories: single-turn and tool-use episodes."""

from ar_torchrl.envs.llm_env import LLMEnv
from ar_torchrl.envs.sampler import EpochSampler
from ar_torchrl.envs.tool_env import ToolEnv

__all__ = ["EpochSampler", "LLMEnv", "ToolEnv"]
