"""A TorchRL user's engine as this library's rollout engine: :class:`TorchRLBackend`, a
:class:`~ar_torchrl.backends.GenerationBackend` over TorchRL 0.14's LLM wrappers
(``TransformersWrapper``, ``vLLMWrapper``, ``SGLangWrapper`` over ``AsyncSGLang``), and the senders
that push the trainer's weights into them (:mod:`.sender`); :mod:`.config` holds the torch-free
schema registered as ``backend=torchrl``. Names are imported on first use.
"""

from __future__ import annotations

from ar_torchrl._lazy import lazy_exports

_EXPORTS = {
    "TorchRLBackend": "backend",
    "wrapper_kind": "backend",
    "DoubleBufferSender": "sender",
    "StrategySender": "sender",
    "default_sender": "sender",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
