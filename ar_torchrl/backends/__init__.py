"""Rollout engines behind one interface (:class:`GenerationBackend`)."""

from ar_torchrl.backends.base import Completion, FinishReason, GenerationBackend, SamplingParams

__all__ = ["Completion", "FinishReason", "GenerationBackend", "SamplingParams"]
