"""Rollout engines behind one interface (:class:`GenerationBackend`).

The SGLang client (``SGLangBackend``, ``launch_sglang_server``) is imported on first use, so that
importing the library does not import ``requests`` (``from ar_torchrl.backends import SGLangBackend``
works as usual).
"""

from __future__ import annotations

from typing import Any

from ar_torchrl.backends.base import (
    Completion,
    ContextLengthError,
    FinishReason,
    GenerationBackend,
    SamplingParams,
)
from ar_torchrl.backends.transformers import TransformersBackend, next_token_log_probs

__all__ = [
    "Completion",
    "ContextLengthError",
    "FinishReason",
    "GenerationBackend",
    "SGLangBackend",
    "SamplingParams",
    "TransformersBackend",
    "launch_sglang_server",
    "next_token_log_probs",
]

_LAZY = {"SGLangBackend", "launch_sglang_server"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from ar_torchrl.backends import sglang

        return getattr(sglang, name)
    raise AttributeError(f"module 'ar_torchrl.backends' has no attribute {name!r}")
