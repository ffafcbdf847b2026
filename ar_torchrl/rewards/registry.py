"""The reward protocol (a score and "correct", over the whole sample), its registry and wrappers.

A reward sees the whole :class:`~ar_torchrl.data.samples.Sample`: the response text
(``sample.text``) and ids (``sample.response_ids``), the finish reason, the segments and the dataset
row (any schema). It implements

- ``score(sample) -> float``: the outcome reward (placed on the last trained token);
- ``correct(sample, score) -> bool``: whether the answer counts as correct (``rollout/accuracy``,
  ``eval/accuracy`` are the fraction of samples it calls correct);
- ``name``: how messages name it.

:class:`TaskReward` adapts the classic ``fn(response_text, ground_truth) -> float`` (DAPO's schema:
``row["reward_model"]["ground_truth"]``); :func:`as_reward` accepts either form. Shaping is a
wrapper, not an environment argument: :class:`OverlongPenalty` (DAPO's soft overlong punishment)
adds to the score of the reward it wraps and leaves "correct" to it.

Reward options are torch-free schemas registered with ``@register_reward(name, help=...)`` (the one
shape of :mod:`ar_torchrl.registry`) whose ``build()`` returns the reward: ``dapo_math`` and
``arithmetic`` are built in (:mod:`ar_torchrl.rewards.math`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ar_torchrl.registry import Registry
from ar_torchrl.rewards.shaping import overlong_penalty

__all__ = [
    "REWARDS",
    "OverlongPenalty",
    "Reward",
    "SampleReward",
    "TaskReward",
    "as_reward",
    "is_correct",
    "register_reward",
]

REWARDS = Registry(
    "reward",
    builtins=("ar_torchrl.rewards.math",),
    decorator="register_reward",
    build="build(self) -> Reward",
)

#: ``@register_reward(name, help=...)`` on the reward's options dataclass
#: (:meth:`ar_torchrl.registry.Registry.register` of :data:`REWARDS`).
register_reward = REWARDS.register


@runtime_checkable
class Reward(Protocol):
    """A reward over a whole sample (see the module docstring)."""

    name: str

    def score(self, sample: Any) -> float: ...

    def correct(self, sample: Any, score: float) -> bool: ...


def ground_truth(sample: Any) -> str:
    """``row["reward_model"]["ground_truth"]`` of the sample's row (DAPO-Math's schema), or an error
    naming the row and what a reward for another schema should read instead."""
    row = sample.row or {}
    try:
        return str(row["reward_model"]["ground_truth"])
    except (KeyError, TypeError):
        raise KeyError(
            f"{sample.source or 'the row'} has no reward_model.ground_truth (DAPO-Math's schema; it "
            f"has {sorted(row)}): give this task a reward that reads its own fields"
        ) from None


@dataclass(frozen=True)
class TaskReward:
    """``fn(response_text, ground_truth) -> float`` on DAPO-schema rows; a score above
    ``correct_above`` is correct.

    Example:
        >>> from ar_torchrl.data.samples import Sample
        >>> reward = TaskReward(lambda text, truth: float(text.strip() == truth), correct_above=0.5)
        >>> sample = Sample([], row={"reward_model": {"ground_truth": "12"}}, text=" 12")
        >>> score = reward.score(sample)
        >>> score, reward.correct(sample, score), reward("13", "12")
        (1.0, True, 0.0)
    """

    fn: Callable[[str, str], float]
    correct_above: float = 0.0
    name: str = "reward"

    def __call__(self, response_text: str, ground_truth: str) -> float:
        return self.fn(response_text, ground_truth)

    def score(self, sample: Any) -> float:
        return self.fn(sample.text, ground_truth(sample))

    def correct(self, sample: Any, score: float) -> bool:
        return score > self.correct_above


@dataclass(frozen=True)
class SampleReward:
    """``fn(sample) -> float`` as a reward; a score above ``correct_above`` is correct.

    Example:
        >>> from ar_torchrl.data.samples import Sample, Segment
        >>> short = SampleReward(lambda s: -0.1 * s.num_trained, correct_above=-0.25, name="short")
        >>> s = Sample([Segment([1]), Segment([5, 6], trained=True)])
        >>> short.score(s), short.correct(s, short.score(s))
        (-0.2, True)
    """

    fn: Callable[[Any], float]
    correct_above: float = 0.0
    name: str = "reward"

    def score(self, sample: Any) -> float:
        return self.fn(sample)

    def correct(self, sample: Any, score: float) -> bool:
        return score > self.correct_above


@dataclass(frozen=True)
class OverlongPenalty:
    """DAPO's soft overlong punishment on top of ``reward``: ``score = reward.score(sample) +
    overlong_penalty(trained tokens, max_len, buffer_len, penalty_factor)``; "correct" is the
    wrapped reward's, on its own score (a correct answer stays correct when it is long).

    Example:
        >>> from ar_torchrl.data.samples import Sample, Segment
        >>> base = SampleReward(lambda s: 1.0)
        >>> shaped = OverlongPenalty(base, max_len=10, buffer_len=4)
        >>> s = Sample([Segment([1]), Segment(list(range(9)), trained=True)])
        >>> shaped.score(s), shaped.correct(s, shaped.score(s))
        (0.25, True)
    """

    reward: Any
    max_len: int
    buffer_len: int
    penalty_factor: float = 1.0

    @property
    def name(self) -> str:
        return f"{self.reward.name}+overlong"

    def score(self, sample: Any) -> float:
        penalty = overlong_penalty(
            sample.num_trained, self.max_len, self.buffer_len, self.penalty_factor
        )
        return self.reward.score(sample) + penalty

    def correct(self, sample: Any, score: float) -> bool:
        return self.reward.correct(sample, self.reward.score(sample))


def as_reward(reward: Any) -> Any:
    """A :class:`Reward` from a reward object (returned as is), a ``fn(sample)`` or a classic
    ``fn(response_text, ground_truth)`` (DAPO's schema, correct when > 0).

    Example:
        >>> as_reward(lambda text, truth: 1.0).name, as_reward(lambda sample: 1.0).name
        ('<lambda>', '<lambda>')
    """
    if hasattr(reward, "score") and hasattr(reward, "correct"):
        return reward
    if not callable(reward):
        raise TypeError(
            f"a reward must have score(sample)/correct(sample, score) or be a function, got "
            f"{type(reward).__name__}"
        )
    name = getattr(reward, "__qualname__", None) or getattr(reward, "__name__", "reward")
    try:
        params = [
            p
            for p in inspect.signature(reward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
        ]
    except (TypeError, ValueError):  # a builtin without a signature: the classic form
        params = [None, None]
    if len(params) == 1:
        return SampleReward(reward, name=name)
    return TaskReward(reward, name=name)


def is_correct(reward_fn: Any, reward: Any) -> Any:
    """What ``reward_fn`` calls correct of a plain score (``correct_above`` when it has one, else
    ``score > 0``), elementwise on a float or a tensor.

    Example:
        >>> is_correct(lambda text, truth: 1.0, -0.5), is_correct(TaskReward(len, 2.0), 1.0)
        (False, False)
    """
    return reward > getattr(reward_fn, "correct_above", 0.0)
