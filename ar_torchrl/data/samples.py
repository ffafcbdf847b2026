"""Samples and segments: what a rollout is before it becomes a token trajectory.

A **sample** is one episode of one prompt: its dataset row and an ordered list of **segments**, the
prompt first, then for every turn the model's tokens (*trained*: with the engine's log-probs and the
weight version that sampled them) and, between turns, the tokens a tool or the environment inserted
(not trained). Single-turn is the prompt segment plus one response segment. A backend's
:class:`~ar_torchrl.backends.Completion` *is* a trained segment (it has ``token_ids``, ``log_probs``,
``policy_version`` and ``trained = True``), so a backend's answer goes into a sample as it is.

:func:`~ar_torchrl.data.trajectory.build_trajectory` turns a list of samples into the ``[B, L]``
token trajectory (docs/design.md section 1); nothing else pads or builds trajectories. Rewards see
the whole sample (:mod:`ar_torchrl.rewards`: response text and ids, finish reason, segments, row).

Nothing here imports torch (token ids may nevertheless be 1-D tensors).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["FinishReason", "Sample", "Segment"]

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class Segment:
    """A run of tokens of a sample.

    Attributes:
        token_ids: the ids (a list, or a 1-D integer tensor).
        trained: the model generated them under the policy being trained (``loss_mask`` True);
            ``False`` for the prompt and for tool / environment tokens.
        log_probs: the engine's log-prob of each token (trained segments; ``None``: zeros).
        policy_version: the weight version that sampled them (trained segments).
        turn: the turn this segment belongs to (multi-turn episodes; ``None`` for single turn).
        token_versions: per-token weight versions when a weight update interrupted the segment
            (partial rollouts: each token keeps the version that sampled it); ``None``: every
            token has ``policy_version``.

    Example:
        >>> len(Segment([4, 5, 6])), Segment([7], trained=True, log_probs=[-0.5]).trained
        (3, True)
    """

    token_ids: Any
    trained: bool = False
    log_probs: Any = None
    policy_version: int | None = None
    turn: int | None = None
    token_versions: Any = None

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass
class Sample:
    """One episode of one prompt, as segments, with what scoring it produced.

    Attributes:
        segments: the prompt segment(s) first, then the response's segments (trained ones are the
            model's: :class:`Segment` with ``trained=True`` or a backend ``Completion``).
        row: the dataset row the prompt came from (any schema).
        prompt_id: the group of the sample (its prompt's dataset index: GRPO's group).
        finish_reason: how the episode ended: ``"stop"`` (EOS / no further call), ``"length"``
            (cut by a token cap) or ``"abort"``.
        reward: the outcome reward (placed on the last trained token).
        turn_rewards: per-turn rewards, turn -> reward (e.g. a tool-error penalty), placed on each
            turn's last trained token (multi-turn episodes; added to the outcome on the last one).
        correct: whether the reward counts the answer as correct (``rollout/accuracy``).
        text: the decoded response (set when the sample is scored).
        source: where the row comes from, for messages (``"data/dapo.jsonl line 7"``).

    Example:
        >>> s = Sample([Segment([1, 2]), Segment([7, 8], trained=True, log_probs=[-0.1, -0.2])])
        >>> s.prompt_ids, s.response_ids, s.num_trained, s.terminated
        ([1, 2], [7, 8], 2, True)
    """

    segments: list[Any]
    row: Mapping | None = None
    prompt_id: int = 0
    finish_reason: FinishReason = "stop"
    reward: float = 0.0
    turn_rewards: dict[int, float] = field(default_factory=dict)
    correct: bool = False
    text: str | None = None
    source: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def first_trained(self) -> int:
        """Index of the first trained segment (where the response starts)."""
        for i, segment in enumerate(self.segments):
            if _trained(segment):
                return i
        return len(self.segments)

    @property
    def prompt_ids(self) -> list[int]:
        """The tokens before the first trained segment (the prompt)."""
        return [int(t) for s in self.segments[: self.first_trained] for t in s.token_ids]

    @property
    def response_ids(self) -> list[int]:
        """The trained tokens, in order (the model's answer, over every turn)."""
        return [int(t) for s in self.segments if _trained(s) for t in s.token_ids]

    @property
    def num_trained(self) -> int:
        return sum(len(s) for s in self.segments if _trained(s))

    @property
    def terminated(self) -> bool:
        """The episode ended by itself (``"stop"``), not cut by a cap."""
        return self.finish_reason == "stop"

    @property
    def policy_versions(self) -> set[int]:
        """The weight versions of its trained tokens."""
        found: set[int] = set()
        for s in self.segments:
            if _trained(s):
                per_token = getattr(s, "token_versions", None)
                found |= {int(v) for v in per_token} if per_token else {int(s.policy_version or 0)}
        return found


def _trained(segment: Any) -> bool:
    return bool(getattr(segment, "trained", False))


def sample_from_completion(
    prompt_ids: Sequence[int], completion: Any, *, row: Mapping | None = None, prompt_id: int = 0
) -> Sample:
    """The single-turn sample of one backend completion: prompt segment + the completion.

    Example:
        >>> from ar_torchrl.backends import Completion
        >>> s = sample_from_completion([4, 5], Completion(0, [7, 2], [-0.5, -0.1], "stop"), prompt_id=3)
        >>> s.prompt_ids, s.response_ids, s.prompt_id, s.finish_reason
        ([4, 5], [7, 2], 3, 'stop')
    """
    return Sample(
        [Segment(prompt_ids), completion],
        row=row,
        prompt_id=prompt_id,
        finish_reason=completion.finish_reason,
    )
