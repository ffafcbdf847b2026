"""Weight senders of :class:`~ar_torchrl.backends.torchrl.TorchRLBackend`: the trainer's policy
tensors (``value_head.*`` dropped by :func:`~ar_torchrl.weight_sync.policy_only`, the one filter)
into a TorchRL wrapper's engine, through TorchRL's own weight-sync machinery where it works:

- ``TransformersWrapper`` (the engine is an in-process HF model): :class:`StrategySender`, TorchRL's
  ``WeightStrategy("tensordict").apply_weights`` (what TorchRL's schemes run on a receiver), after
  the names and shapes are checked against the engine's model;
- ``vLLMWrapper``: :class:`DoubleBufferSender`, TorchRL's ``VLLMDoubleBufferSyncScheme``: its sender
  writes the tensors as a memory-mapped TensorDict, its receiver loads them into the engine
  (``model.load_weights``; ``AsyncVLLM``: a ``collective_rpc`` to every worker);
- ``SGLangWrapper``: TorchRL 0.14.1's ``SGLangWeightSyncScheme`` is NCCL-only (CUDA) and does not
  work against SGLang 0.5.23 (a singular payload answered 400, ``/get_load`` polled (404), no
  ``begin/end_weight_update`` session; docs/torchrl.md), so the engine's server is synced by this
  library's SGLang senders (``disk`` by default, or ``tensor`` / ``distributed``), built by name
  from :data:`~ar_torchrl.weight_sync.SYNC_METHODS` for the wrapper's server URL.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ar_torchrl.weight_sync.errors import WeightSyncError
from ar_torchrl.weight_sync.names import policy_only

__all__ = ["DoubleBufferSender", "StrategySender", "default_sender"]

logger = logging.getLogger(__name__)


def _check_names(
    owner: str, got: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]
) -> None:
    """Every engine tensor, each with its shape, and nothing else (nothing has been applied yet)."""
    unknown = sorted(set(got) - set(expected))
    missing = sorted(set(expected) - set(got))
    if unknown or missing:
        raise WeightSyncError(
            f"{owner}: the engine's model has no tensors {unknown[:5]} and would keep its own "
            f"{missing[:5]}; send every policy tensor with the engine's HF names "
            "(named_policy_tensors(model))",
            partial=False,
        )
    shapes = [(n, tuple(t.shape), tuple(expected[n].shape)) for n, t in got.items()]
    wrong = [s for s in shapes if s[1] != s[2]]
    if wrong:
        name, have, want = wrong[0]
        raise WeightSyncError(
            f"{owner}: tensor {name!r} has shape {have}, the engine's model {want}", partial=False
        )


class StrategySender:
    """Push the policy into a ``TransformersWrapper``'s in-process model with TorchRL's
    ``WeightStrategy("tensordict").apply_weights`` (a ``WeightSender``).

    The tensors are checked first (every engine tensor, same shapes: nothing is applied on a
    mismatch), then applied in place (cast to the engine's dtype). When the engine's model *is* the
    trainer's module, the copy is a no-op and only the names are checked.

    Example:
        >>> from ar_torchrl.models.tiny import build_tiny_qwen3
        >>> from ar_torchrl.modules import attach_value_head
        >>> from ar_torchrl.weight_sync import named_policy_tensors
        >>> trainer, engine = attach_value_head(build_tiny_qwen3(99)), build_tiny_qwen3(99, seed=1)
        >>> StrategySender(engine).send(trainer.state_dict().items(), version=1)  # value head dropped
        >>> bool((engine.lm_head.weight == trainer.lm_head.weight).all())
        True
    """

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"StrategySender: the engine's model must be an nn.Module, got {model!r}"
            )
        self.model = model

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        from torchrl.weight_update import WeightStrategy

        weights = dict(policy_only(named_tensors))
        _check_names("StrategySender", weights, dict(policy_only(self.model.state_dict().items())))
        try:
            with torch.no_grad():
                WeightStrategy("tensordict").apply_weights(self.model, weights)
        except Exception as err:
            raise WeightSyncError(
                f"StrategySender: TorchRL's apply_weights failed at version {version}: {err}",
                partial=True,
            ) from err
        logger.debug("StrategySender: %d tensors applied (version %d)", len(weights), version)

    def close(self) -> None:
        """Nothing to release."""


class DoubleBufferSender:
    """Push the policy into a ``vLLMWrapper``'s engine through TorchRL's
    ``VLLMDoubleBufferSyncScheme`` (a ``WeightSender``): the scheme's sender writes the tensors as a
    memory-mapped TensorDict under ``directory``, its receiver loads them into the engine
    (``llm_engine.model_executor.driver_worker.model_runner.model.load_weights`` for ``vllm.LLM``,
    a ``collective_rpc`` to every worker for TorchRL's ``AsyncVLLM``) and resets the prefix cache.

    Args:
        engine: the wrapper's engine (``wrapper.model``).
        directory: where the weights are written (default: a temporary directory, removed by
            :meth:`close`); the engine must read the same filesystem.
        num_threads: threads of the memory-mapped write.

    Example (an engine that records what ``load_weights`` receives, where ``vllm.LLM`` loads):
        >>> from types import SimpleNamespace as NS
        >>> loaded = []
        >>> model = NS(load_weights=lambda pairs: loaded.extend(name for name, _ in pairs))
        >>> engine = NS(llm_engine=NS(model_executor=NS(driver_worker=NS(model_runner=NS(model=model)))))
        >>> sender = DoubleBufferSender(engine)
        >>> sender.send([("lm_head.weight", torch.ones(2)), ("value_head.bias", torch.ones(1))], 1)
        >>> loaded
        ['lm_head.weight']
        >>> sender.close()
    """

    def __init__(self, engine: Any, directory: str | None = None, num_threads: int = 1) -> None:
        from torchrl.weight_update.llm import VLLMDoubleBufferSyncScheme

        self._owned = directory is None
        self.directory = directory or tempfile.mkdtemp(prefix="ar_torchrl-vllm-")
        self.scheme = VLLMDoubleBufferSyncScheme(
            remote_addr=self.directory, num_threads=num_threads, strategy="tensordict"
        )
        self._sender = self.scheme.create_sender()
        self._anchor = _Anchor()  # the scheme keeps a weak reference to a "model"
        self._sender.register_model(self._anchor)
        self._receiver = self.scheme.create_receiver(engine)

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        from tensordict import TensorDict

        weights = {n: t.detach().contiguous() for n, t in policy_only(named_tensors)}
        if not weights:
            raise WeightSyncError("DoubleBufferSender: no policy tensor to send", partial=False)
        try:
            self._sender.update_weights(weights=TensorDict(weights, batch_size=[]))
        except Exception as err:
            raise WeightSyncError(
                f"DoubleBufferSender: writing the weights to {self.directory} failed: {err}",
                partial=False,
            ) from err
        try:
            self._receiver.poll_and_apply()
        except Exception as err:
            raise WeightSyncError(
                f"DoubleBufferSender: the engine did not load the weights of version {version} "
                f"from {self.directory}: {type(err).__name__}: {err}",
                partial=True,
            ) from err

    def close(self) -> None:
        """Remove the weights directory if this sender made it. Idempotent."""
        if self._owned:
            shutil.rmtree(self.directory, ignore_errors=True)


class _Anchor:
    """What ``VLLMDoubleBufferWeightSender.register_model`` holds a weak reference to: the
    weights always come with the call, so it is never read."""


class _ClientSender:
    """A sender of this library's SGLang client, closing the client with it."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self.client.sender.send(named_tensors, version)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()


def _server_url(engine: Any) -> str:
    url = getattr(engine, "server_url", None) or getattr(engine, "_server_url", None)
    if not isinstance(url, str):
        raise TypeError(
            f"TorchRLBackend: SGLangWrapper's engine {type(engine).__name__} has no server URL; "
            "wrap an AsyncSGLang (AsyncSGLang.connect(url) or AsyncSGLang.from_pretrained(...))"
        )
    return url


def default_sender(
    wrapper: Any,
    kind: str,
    *,
    weight_sync: str = "disk",
    weight_sync_options: Mapping[str, Any] | None = None,
) -> Any:
    """The sender of ``wrapper``'s engine (see the module docstring); ``weight_sync`` and its
    options choose the SGLang method (``disk`` / ``tensor`` / ``distributed``)."""
    from ar_torchrl.weight_sync.registry import make_sender

    if kind == "transformers":
        return make_sender("strategy", wrapper.model, engine="torchrl")
    if kind == "vllm":
        options = dict(weight_sync_options or {})
        return make_sender("double_buffer", wrapper.model, engine="torchrl", **options)
    from ar_torchrl.backends.sglang.client import SGLangBackend
    from ar_torchrl.backends.sglang.options import SGLangClientOptions

    client = SGLangBackend(
        [_server_url(wrapper.model)],
        weight_sync=weight_sync,
        weight_sync_options=dict(weight_sync_options or {}),
        options=SGLangClientOptions(show_progress=False),
    )
    return _ClientSender(client)
