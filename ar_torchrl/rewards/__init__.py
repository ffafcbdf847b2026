"""Verifiable rewards (registered, each saying what counts as correct): DAPO's math rule and its
soft overlong penalty."""

from ar_torchrl.rewards.math import (
    DapoMathRewardConfig,
    dapo_math_reward,
    extract_answer,
    normalize_final_answer,
)
from ar_torchrl.rewards.registry import REWARDS, TaskReward, is_correct, register_reward
from ar_torchrl.rewards.shaping import overlong_penalty

__all__ = [
    "REWARDS",
    "DapoMathRewardConfig",
    "TaskReward",
    "dapo_math_reward",
    "extract_answer",
    "is_correct",
    "normalize_final_answer",
    "overlong_penalty",
    "register_reward",
]
