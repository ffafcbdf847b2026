"""The trainside rollout engine: an HF causal LM sampling in the trainer's process.

:class:`TransformersBackend` (its own KV-cache sampler, :mod:`.kv_cache`, :mod:`.token_sampling`)
and its weight senders (:class:`TrainsideSender`, ``copy`` / ``share``); :mod:`.config` holds its
torch-free config schemas. Names are imported on first use.
"""

from __future__ import annotations

from ar_torchrl._lazy import lazy_exports

_EXPORTS = {
    "LogProbMode": "backend",
    "TransformersBackend": "backend",
    "next_token_log_probs": "backend",
    "TrainsideSender": "sender",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
