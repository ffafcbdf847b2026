"""Torch-free config schemas of the SGLang engine, registered beside it.

- the backend (``backend=sglang`` in the recipe): :class:`SGLangBackendConfig`, which launches a
  local server on the starting policy or connects to running ones;
- its weight-sync methods and their options: ``disk`` (:class:`DiskSyncOptions`), ``tensor``
  (:class:`TensorSyncOptions``), ``distributed`` (:class:`DistributedSyncOptions`). A ``None`` option
  keeps the sender's own default.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from typing import Any, Optional
from urllib.parse import urlparse

from ar_torchrl.backends.registry import BackendContext, register_backend
from ar_torchrl.utils.checks import check_choice, check_number
from ar_torchrl.weight_sync.registry import register_sync_method, sender_options, set_options

# OmegaConf reads the annotations at run time: they must stay `Optional[...]`, not `X | None`.
# ruff: noqa: UP045

__all__ = [
    "DiskSyncOptions",
    "DistributedSyncOptions",
    "SGLangBackendConfig",
    "TensorSyncOptions",
    "check_server_url",
]


def check_server_url(prefix: str, name: str, url: Any) -> str:
    """An ``http(s)://host:port`` URL (a path is allowed, e.g. behind a proxy).

    Example:
        >>> check_server_url("config: backend.", "url", "http://127.0.0.1:30000")
        'http://127.0.0.1:30000'
        >>> check_server_url("config: backend.", "url", "notaurl")
        Traceback (most recent call last):
        ...
        ValueError: config: backend.url='notaurl' is not a server URL: expected http://host:port or https://host:port
    """
    key = f"{prefix}{name}" if prefix.endswith(".") else f"{prefix}: {name}"
    if not isinstance(url, str):
        raise TypeError(f"{key} must be a URL string, got {url!r} ({type(url).__name__})")
    parsed = urlparse(url)
    try:
        port = parsed.port
    except ValueError:
        port = None
    if parsed.scheme not in ("http", "https") or not parsed.hostname or port is None:
        raise ValueError(
            f"{key}={url!r} is not a server URL: expected http://host:port or https://host:port"
        )
    return url


# --------------------------------------------------------------------------- weight sync methods
@dataclass
class DiskSyncOptions:
    """Options of :class:`~.senders.disk.DiskWeightSender`."""

    config_dir: Optional[str] = None  # HF config/tokenizer files to copy beside the weights
    tmp_root: Optional[str] = None  # where weight directories are written (shared with the server)
    bucket_bytes: Optional[int] = None  # bytes per safetensors shard

    def check(self, prefix: str) -> None:
        check_number(prefix, "bucket_bytes", self.bucket_bytes, ge=1, integer=True, allow_none=True)


@dataclass
class TensorSyncOptions:
    """Options of :class:`~.senders.tensor.TensorWeightSender`."""

    bucket_bytes: Optional[int] = None  # bytes per shared-memory bucket

    def check(self, prefix: str) -> None:
        check_number(prefix, "bucket_bytes", self.bucket_bytes, ge=1, integer=True, allow_none=True)


@dataclass
class DistributedSyncOptions:
    """Options of :class:`~.senders.distributed.DistributedWeightSender`."""

    backend: Optional[str] = None  # gloo | nccl (None: nccl when CUDA is available, else gloo)
    master_address: Optional[str] = None  # this host's address as the servers reach it
    master_port: Optional[int] = None  # the group's port (None: a free one)
    group_name: Optional[str] = None  # the process group's name on the servers
    bucket_bytes: Optional[int] = None  # bytes per broadcast bucket
    timeout_s: Optional[float] = None  # group set-up and broadcast timeout

    def check(self, prefix: str) -> None:
        if self.backend is not None:
            check_choice(prefix, "backend", self.backend, ("gloo", "nccl"))
        check_number(
            prefix, "master_port", self.master_port, ge=1, le=65535, integer=True, allow_none=True
        )
        check_number(prefix, "bucket_bytes", self.bucket_bytes, ge=1, integer=True, allow_none=True)
        check_number(prefix, "timeout_s", self.timeout_s, gt=0, allow_none=True)


def _sender(module: str, cls: str):
    def factory(options: Any, *, target: Any) -> Any:
        import importlib

        sender = getattr(
            importlib.import_module(f"ar_torchrl.backends.sglang.senders.{module}"), cls
        )
        return sender(target, **set_options(options))

    return factory


register_sync_method(
    "disk",
    engine="sglang",
    config=DiskSyncOptions,
    help="safetensors shards in a temp dir + /update_weights_from_disk (shared filesystem)",
)(_sender("disk", "DiskWeightSender"))
register_sync_method(
    "tensor",
    engine="sglang",
    config=TensorSyncOptions,
    help="buckets through shared memory + /update_weights_from_tensor (same machine)",
)(_sender("tensor", "TensorWeightSender"))
register_sync_method(
    "distributed",
    engine="sglang",
    config=DistributedSyncOptions,
    help="broadcast over a gloo/nccl group + /update_weights_from_distributed",
)(_sender("distributed", "DistributedWeightSender"))


# --------------------------------------------------------------------------- the backend
@register_backend(
    "sglang", help="an SGLang server: launched locally on the policy, or running ones"
)
@dataclass
class SGLangBackendConfig:
    """``backend=sglang``: :class:`~ar_torchrl.backends.SGLangBackend` over one or more servers."""

    url: Any = None  # None (launch one) | a URL | a list of URLs (or one sglang-router URL)
    python: Optional[str] = None  # interpreter of the SGLang environment (None: .venv-sglang)
    device: str = "cpu"  # where a launched server runs
    weight_sync: str = "disk"  # a registered sglang method (ar_torchrl.weight_sync.registry)
    weight_sync_options: dict[str, Any] = field(default_factory=dict)  # that method's options
    extra_args: list[str] = field(default_factory=list)  # extra sglang.launch_server flags
    timeout_s: float = 600.0  # deadline of one whole /generate answer (seconds)
    # how long a server holding requests may stay silent (no answer, no passed /health_generate
    # probe) before its requests move to the other servers; None: never (only timeout_s ends a wait)
    stall_grace_s: Optional[float] = 60.0
    sync_timeout_s: float = 600.0  # deadline of each weight-sync request (seconds)

    @property
    def urls(self) -> list[str] | None:
        """The server URLs (``None``: launch one)."""
        if self.url is None:
            return None
        return [self.url] if isinstance(self.url, str) else list(self.url)

    def check(self, prefix: str) -> None:
        if self.url is not None:
            urls = self.urls
            if not urls:
                raise ValueError(
                    f"{prefix}url must be null, a URL or a non-empty list of URLs, got []"
                )
            for url in urls:
                check_server_url(prefix, "url", url)
        check_choice(prefix, "device", self.device, ("cpu", "cuda"))
        check_number(prefix, "timeout_s", self.timeout_s, gt=0)
        check_number(prefix, "sync_timeout_s", self.sync_timeout_s, gt=0)
        check_number(
            prefix,
            "stall_grace_s",
            self.stall_grace_s,
            ge=2,
            allow_none=True,
            hint="SGLang answers the /health_generate probe after 1 s at the earliest; null disables "
            "the stall detection",
        )
        sender_options(
            self.weight_sync,
            dict(self.weight_sync_options),
            engine="sglang",
            prefix=f"{prefix}weight_sync_options.",
        )

    def starts_with_trainer_weights(self) -> bool:
        """A launched server loads the starting policy; running servers hold other weights."""
        return self.url is None

    def build(self, context: BackendContext) -> Any:
        """Launch a server on the starting policy (stopped when the run ends) or connect to the
        given ones; the server must answer ``GET /health``."""
        from ar_torchrl.backends.sglang.client import SGLangBackend
        from ar_torchrl.backends.sglang.errors import SGLangUnavailableError
        from ar_torchrl.backends.sglang.launcher import launch_sglang_server

        urls = self.urls
        if urls is None:  # a local server on the starting policy, stopped when the run ends
            model_dir, owned = context.start_dir, []
            if model_dir is None:  # the server's start weights: deleted when it stops
                from ar_torchrl.backends.sglang import reaper
                from ar_torchrl.modules import save_policy

                model_dir = context.run_dir / "sglang_model"
                owned = [model_dir]  # also removed if this process is killed (the reaper)
                context.stack.callback(shutil.rmtree, model_dir, ignore_errors=True)
                reaper.guard_dir(model_dir)
                save_policy(context.model, model_dir, context.tokenizer)
            server = context.stack.enter_context(
                launch_sglang_server(
                    model_dir,
                    python=self.python,
                    device=self.device,
                    extra_args=list(self.extra_args),
                    log_file=context.run_dir / "sglang_server.log",
                    owned_dirs=owned,
                )
            )
            urls = [server.url]
        backend = SGLangBackend(
            urls,
            weight_sync=self.weight_sync,
            weight_sync_options=dict(self.weight_sync_options),
            timeout_s=self.timeout_s,
            stall_grace_s=self.stall_grace_s,
            sync_timeout_s=self.sync_timeout_s,
            vocab_size=context.model.config.vocab_size,
            show_progress=False,
        )
        context.stack.callback(backend.close)
        if not backend.health():  # said once, before anything reads as a weight-sync failure
            raise SGLangUnavailableError(
                f"backend.url={urls}: no SGLang server answers GET /health there; start it (or "
                "set backend.url=null to launch one) and check the URL"
            )
        return backend
