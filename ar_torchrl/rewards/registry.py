"""The registry of task rewards (:data:`REWARDS`) and the reward protocol: a score and "correct".

A reward is a callable ``reward(response_text, ground_truth) -> float`` that also says which scores
count as a correct answer (``is_correct(reward)``, elementwise on a float or a tensor): the
``rollout/accuracy`` and ``eval/accuracy`` metrics are the fraction of samples it calls correct.
:class:`TaskReward` wraps a plain function with a threshold; a plain function without
``is_correct`` counts ``reward > 0`` as correct (:func:`is_correct`).

A reward option is a torch-free schema registered with :func:`register_reward` whose ``build()``
returns the reward: ``dapo_math`` (DAPO's rule, :mod:`ar_torchrl.rewards.math`) is built in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ar_torchrl.registry import Registry

__all__ = ["REWARDS", "TaskReward", "is_correct", "register_reward"]

REWARDS = Registry("reward", builtins=("ar_torchrl.rewards.math",))


def register_reward(name: str, *, help: str) -> Callable[[type], type]:
    """Class decorator: register a reward schema (``build()`` returns the reward) as ``name``."""

    def decorator(schema: type) -> type:
        REWARDS.register(name, config=schema, help=help)(lambda options: options.build())
        return schema

    return decorator


@dataclass(frozen=True)
class TaskReward:
    """``fn(response_text, ground_truth) -> float``; a score above ``correct_above`` is correct.

    Example:
        >>> reward = TaskReward(lambda text, truth: float(text.strip() == truth), correct_above=0.5)
        >>> reward("12", "12"), reward.is_correct(reward("12", "12")), reward.is_correct(0.0)
        (1.0, True, False)
    """

    fn: Callable[[str, str], float]
    correct_above: float = 0.0
    name: str = "reward"

    def __call__(self, response_text: str, ground_truth: str) -> float:
        return self.fn(response_text, ground_truth)

    def is_correct(self, reward: Any) -> Any:
        return reward > self.correct_above


def is_correct(reward_fn: Any, reward: Any) -> Any:
    """What ``reward_fn`` calls correct (its ``is_correct``), else ``reward > 0``.

    Example:
        >>> is_correct(lambda text, truth: 1.0, -0.5), is_correct(TaskReward(len, 2.0), 1.0)
        (False, False)
    """
    judge = getattr(reward_fn, "is_correct", None)
    return judge(reward) if judge is not None else reward > 0
