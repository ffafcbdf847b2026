"""Torch-free config schemas of the TorchRL-wrapper engine, registered beside it.

- the backend (``backend=torchrl`` in the recipe): :class:`TorchRLBackendConfig`, a
  :class:`~ar_torchrl.backends.torchrl.TorchRLBackend` over TorchRL's ``TransformersWrapper`` (a copy
  of the policy in the trainer's process) or ``SGLangWrapper`` (over ``AsyncSGLang.connect(url)``, a
  running server). A ``vLLMWrapper`` is built in Python (``TorchRLBackend(vLLMWrapper(...))``): its
  engine needs vLLM, which this config layer does not start;
- its weight-sync methods, TorchRL's own: ``strategy`` (TorchRL's ``WeightStrategy.apply_weights``
  into an in-process model: ``TransformersWrapper``) and ``double_buffer`` (TorchRL's
  ``VLLMDoubleBufferSyncScheme``: ``vLLMWrapper``). An ``SGLangWrapper``'s server is synced by the
  SGLang methods (``disk``, ``tensor``, ``distributed``; see :mod:`.sender` for why).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Optional

from ar_torchrl.backends.registry import BackendConfig, BackendContext, register_backend
from ar_torchrl.utils.checks import check_choice, check_number
from ar_torchrl.weight_sync.registry import register_sync_method, sender_options

# OmegaConf reads the annotations at run time: they must stay `Optional[...]`, not `X | None`.
# ruff: noqa: UP045

__all__ = ["DoubleBufferSyncOptions", "StrategySyncOptions", "TorchRLBackendConfig"]

WRAPPERS = ("transformers", "sglang")


@register_sync_method(
    "strategy",
    engine="torchrl",
    help="TorchRL's WeightStrategy.apply_weights into a TransformersWrapper's in-process model",
)
@dataclass
class StrategySyncOptions:
    """``strategy``: :class:`~ar_torchrl.backends.torchrl.sender.StrategySender` (no options)."""

    def build(self, *, target: Any) -> Any:
        from ar_torchrl.backends.torchrl.sender import StrategySender

        return StrategySender(target)


@register_sync_method(
    "double_buffer",
    engine="torchrl",
    help="TorchRL's VLLMDoubleBufferSyncScheme: memory-mapped weights a vLLMWrapper's engine loads",
)
@dataclass
class DoubleBufferSyncOptions:
    """``double_buffer``: :class:`~ar_torchrl.backends.torchrl.sender.DoubleBufferSender`."""

    directory: Optional[str] = None  # where the weights are written (None: a temporary directory)
    num_threads: int = 1  # threads of the memory-mapped write

    def check(self, prefix: str) -> None:
        check_number(prefix, "num_threads", self.num_threads, ge=1, integer=True)

    def build(self, *, target: Any) -> Any:
        from ar_torchrl.backends.torchrl.sender import DoubleBufferSender

        return DoubleBufferSender(target, self.directory, self.num_threads)


@register_backend(
    "torchrl",
    help="a TorchRL LLM wrapper: TransformersWrapper (a copy of the policy) or SGLangWrapper (a server)",
)
@dataclass
class TorchRLBackendConfig(BackendConfig):
    """``backend=torchrl``: :class:`~ar_torchrl.backends.torchrl.TorchRLBackend` over a wrapper."""

    wrapper: str = "transformers"  # transformers | sglang
    url: Optional[str] = None  # sglang: the running server (AsyncSGLang.connect(url))
    weight_sync: str = "disk"  # sglang: this library's SGLang method for the server
    weight_sync_options: dict[str, Any] = field(default_factory=dict)  # that method's options

    def check(self, prefix: str) -> None:
        check_choice(prefix, "wrapper", self.wrapper, WRAPPERS)
        key = prefix.rpartition(": ")[2]
        if self.wrapper == "sglang":
            from ar_torchrl.backends.sglang.config import check_server_url

            if self.url is None:
                raise ValueError(
                    f"{prefix}url is required with {key}wrapper=sglang: the running SGLang server "
                    "the SGLangWrapper connects to (AsyncSGLang.connect(url))"
                )
            check_server_url(prefix, "url", self.url)
            sender_options(
                self.weight_sync,
                dict(self.weight_sync_options),
                engine="sglang",
                prefix=f"{prefix}weight_sync_options.",
            )
        elif self.url is not None or self.weight_sync_options:
            raise ValueError(
                f"{prefix}url / {key}weight_sync_options configure an SGLangWrapper; "
                f"{key}wrapper=transformers samples with a copy of the policy in this process"
            )

    def starts_with_trainer_weights(self) -> bool:
        """A ``TransformersWrapper`` copies the trainer's policy; a running server holds its own."""
        return self.wrapper == "transformers"

    def build(self, context: BackendContext) -> Any:
        """The wrapper (a ``TransformersWrapper`` over a copy of the policy on the trainer's device,
        or an ``SGLangWrapper`` connected to ``url``) as a started ``TorchRLBackend``."""
        from ar_torchrl.backends.torchrl.backend import TorchRLBackend

        if self.wrapper == "sglang":
            from torchrl.modules.llm import SGLangWrapper
            from torchrl.modules.llm.backends.sglang import AsyncSGLang

            wrapper = SGLangWrapper(
                AsyncSGLang.connect(self.url), tokenizer=context.tokenizer, input_mode="tokens"
            )
            backend = TorchRLBackend(
                wrapper,
                weight_sync=self.weight_sync,
                weight_sync_options=dict(self.weight_sync_options),
            )
        else:
            from torchrl.modules.llm import TransformersWrapper

            if context.start_dir is not None:  # the engine's own full copy, on this rank's device
                from ar_torchrl.models.hf import load_hf_model

                model = load_hf_model(context.start_dir, dtype=context.dtype)[0]
            else:
                model = copy.deepcopy(context.model)
            model = model.to(context.device).eval()
            wrapper = TransformersWrapper(model, tokenizer=context.tokenizer, input_mode="tokens")
            backend = TorchRLBackend(wrapper)
        context.stack.callback(backend.close)
        return backend
