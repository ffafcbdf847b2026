"""Verifiable rewards: DAPO's math rule and its soft overlong penalty."""

from ar_torchrl.rewards.math import (
    dapo_math_reward,
    extract_answer,
    normalize_final_answer,
    overlong_penalty,
)

__all__ = ["dapo_math_reward", "extract_answer", "normalize_final_answer", "overlong_penalty"]
