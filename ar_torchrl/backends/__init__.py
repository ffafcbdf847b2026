"""Rollout engines behind one interface (:class:`GenerationBackend`)."""

from ar_torchrl.backends.base import Completion, FinishReason, GenerationBackend, SamplingParams

__all__ = ["Completion", "FinishReason", "GenerationBackend", "SamplingParams"]
from ar_torchrl.backends.transformers import TransformersBackend, next_token_log_probs  # noqa: E402

__all__ += ["TransformersBackend", "next_token_log_probs"]
from ar_torchrl.backends.sglang import SGLangBackend, launch_sglang_server  # noqa: E402

__all__ += ["SGLangBackend", "launch_sglang_server"]
