"""Rollout engines behind one interface (:class:`GenerationBackend`), one folder per engine.

- :mod:`.transformers`: the trainside engine (:class:`TransformersBackend`) and its senders;
- :mod:`.sglang`: the SGLang HTTP client (:class:`SGLangBackend`), launcher, reaper and senders;
- :mod:`.torchrl`: a TorchRL user's engine (:class:`TorchRLBackend` over ``TransformersWrapper``,
  ``vLLMWrapper`` or ``SGLangWrapper``) and the senders through TorchRL's weight-sync machinery.

Names are imported on first use: this package imports neither torch nor ``requests`` by itself
(``from ar_torchrl.backends import SGLangBackend`` works as usual), and each engine's torch-free
``config`` module (its registered config schemas) can be read without the engine.
"""

from __future__ import annotations

from ar_torchrl._lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(
        [
            "BackendCapabilities",
            "Completion",
            "ContextLengthError",
            "EpisodeCache",
            "FinishReason",
            "GenerationBackend",
            "SamplingParams",
        ],
        "base",
    ),
    "TransformersBackend": "transformers",
    "next_token_log_probs": "transformers",
    "SGLangBackend": "sglang",
    "SGLangClientOptions": "sglang",
    "launch_sglang_server": "sglang",
    "TorchRLBackend": "torchrl",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
