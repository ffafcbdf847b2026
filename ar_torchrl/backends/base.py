"""The one interface every rollout backend implements.

A backend turns prompt token ids into sampled completions with the log-probs of the sampled tokens,
accepts new policy weights, and releases its resources on ``close()``.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

__all__ = ["Completion", "FinishReason", "GenerationBackend", "SamplingParams", "validate_prompts"]

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. Field names follow SGLang's ``sampling_params``.

    Attributes:
        max_new_tokens: hard cap on generated tokens per completion.
        temperature: softmax temperature; ``0`` means greedy. Log-probs are those of the
            temperature-scaled distribution the token was sampled from (greedy: ``T = 1``).
        top_p: nucleus sampling threshold in ``(0, 1]``.
        top_k: keep the ``k`` most likely tokens; ``-1`` disables (SGLang's convention).
        stop_token_ids: extra token ids that end a completion (the EOS id always does);
            the stop token is kept in the completion.
        seed: per-call seed for reproducible sampling (``None``: backend's own RNG stream).

    Example:
        >>> SamplingParams(max_new_tokens=8, temperature=0.0).greedy
        True
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(
                f"SamplingParams: max_new_tokens must be >= 1, got {self.max_new_tokens}"
            )
        if self.temperature < 0:
            raise ValueError(f"SamplingParams: temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams: top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingParams: top_k must be -1 (off) or >= 1, got {self.top_k}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Completion:
    """One sampled completion of one prompt.

    Attributes:
        prompt_index: index of the prompt in the ``generate`` call.
        token_ids: generated ids, stop/EOS token included when it ended the completion.
        log_probs: ``log p(token_ids[i] | prompt, token_ids[:i])`` under the sampling distribution,
            one per token (the first generated token included).
        finish_reason: ``"stop"`` (EOS/stop token), ``"length"`` (hit ``max_new_tokens``), ``"abort"``.
        weight_version: the engine's weight version that produced it, when the engine reports one.

    Example:
        >>> c = Completion(0, [5, 2], [-0.1, -0.2], "stop")
        >>> len(c)
        2
    """

    prompt_index: int
    token_ids: list[int]
    log_probs: list[float]
    finish_reason: FinishReason
    weight_version: str | None = None
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.log_probs):
            raise ValueError(
                f"Completion: {len(self.token_ids)} token ids but {len(self.log_probs)} log-probs"
            )

    def __len__(self) -> int:
        return len(self.token_ids)


def validate_prompts(
    prompt_token_ids: Sequence[Sequence[int]], n: int, owner: str
) -> list[list[int]]:
    """Check ``generate`` arguments and return the prompts as lists of ints.

    Raises:
        ValueError: ``n < 1``, no prompts, or empty prompts (named by index).

    Example:
        >>> validate_prompts([[1, 2], (3,)], 2, "MyBackend")
        [[1, 2], [3]]
    """
    if n < 1:
        raise ValueError(f"{owner}.generate: n must be >= 1, got {n}")
    prompts = [[int(t) for t in p] for p in prompt_token_ids]
    if not prompts:
        raise ValueError(f"{owner}.generate: got no prompts")
    empty = [i for i, p in enumerate(prompts) if not p]
    if empty:
        raise ValueError(
            f"{owner}.generate: prompts {empty[:8]} are empty; every prompt needs >= 1 token"
        )
    return prompts


class GenerationBackend(abc.ABC):
    """Interface of a rollout engine (trainside transformers, SGLang, ...).

    ``generate`` returns a flat, prompt-major list: for ``P`` prompts and ``n`` samples, item
    ``i * n + j`` is sample ``j`` of prompt ``i``.
    """

    @abc.abstractmethod
    def generate(
        self, prompt_token_ids: Sequence[Sequence[int]], n: int, sampling: SamplingParams
    ) -> list[Completion]:
        """Sample ``n`` completions for each prompt (prompt-major order)."""

    @abc.abstractmethod
    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load new policy weights (HF names, never ``value_head.*``) and tag them ``version``."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (processes, sockets). Idempotent."""

    def __enter__(self) -> GenerationBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
