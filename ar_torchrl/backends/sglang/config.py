"""Torch-free config schemas of the SGLang engine, registered beside it.

- the backend (``backend=sglang`` in the recipe): :class:`SGLangBackendConfig`, which launches
  local servers on the starting policy or connects to running ones, optionally behind an
  sglang-router (launched, or running);
- its weight-sync methods and their options: ``disk`` (:class:`DiskSyncOptions`), ``tensor``
  (:class:`TensorSyncOptions``), ``distributed`` (:class:`DistributedSyncOptions`). A ``None`` option
  keeps the sender's own default;
- how the client talks to the servers: :class:`SGLangClientOptions` (``SGLangBackend(options=...)``).

Every option is checked by one function, which the client and the senders call too.
"""

from __future__ import annotations

import importlib
import shutil
from dataclasses import dataclass, field
from typing import Any, Optional

from ar_torchrl.backends.registry import BackendConfig, BackendContext, register_backend
from ar_torchrl.backends.sglang.options import SGLangClientOptions, check_stall_grace
from ar_torchrl.utils.checks import (
    check_choice,
    check_number,
    check_timeout,
    is_server_url,
)
from ar_torchrl.weight_sync.registry import register_sync_method, sender_options, set_options

# OmegaConf reads the annotations at run time: they must stay `Optional[...]`, not `X | None`.
# ruff: noqa: UP045

__all__ = [
    "DiskSyncOptions",
    "DistributedSyncOptions",
    "SGLangBackendConfig",
    "SGLangClientOptions",
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
    if not is_server_url(url):
        raise ValueError(
            f"{key}={url!r} is not a server URL: expected http://host:port or https://host:port"
        )
    return url


# --------------------------------------------------------------------------- weight sync methods
def _sender(module: str, cls: str, options: Any, target: Any) -> Any:
    """``senders.<module>.<cls>(target, **options that are set)``, imported when built."""
    found = importlib.import_module(f"ar_torchrl.backends.sglang.senders.{module}")
    return getattr(found, cls)(target, **set_options(options))


@register_sync_method(
    "disk",
    engine="sglang",
    help="safetensors shards in a temp dir + /update_weights_from_disk (shared filesystem)",
)
@dataclass
class DiskSyncOptions:
    """Options of :class:`~.senders.disk.DiskWeightSender`."""

    config_dir: Optional[str] = None  # HF config/tokenizer files to copy beside the weights
    tmp_root: Optional[str] = None  # where weight directories are written (shared with the server)
    bucket_bytes: Optional[int] = None  # bytes per safetensors shard

    def check(self, prefix: str) -> None:
        check_number(prefix, "bucket_bytes", self.bucket_bytes, ge=1, integer=True, allow_none=True)

    def build(self, *, target: Any) -> Any:
        return _sender("disk", "DiskWeightSender", self, target)


@register_sync_method(
    "tensor",
    engine="sglang",
    help="buckets through shared memory + /update_weights_from_tensor (same machine)",
)
@dataclass
class TensorSyncOptions:
    """Options of :class:`~.senders.tensor.TensorWeightSender`."""

    bucket_bytes: Optional[int] = None  # bytes per shared-memory bucket

    def check(self, prefix: str) -> None:
        check_number(prefix, "bucket_bytes", self.bucket_bytes, ge=1, integer=True, allow_none=True)

    def build(self, *, target: Any) -> Any:
        return _sender("tensor", "TensorWeightSender", self, target)


@register_sync_method(
    "distributed",
    engine="sglang",
    help="broadcast over a gloo/nccl group + /update_weights_from_distributed",
)
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
        check_timeout(prefix, "timeout_s", self.timeout_s, allow_none=True)

    def build(self, *, target: Any) -> Any:
        return _sender("distributed", "DistributedWeightSender", self, target)


# --------------------------------------------------------------------------- the backend
@register_backend(
    "sglang", help="an SGLang server: launched locally on the policy, or running ones"
)
@dataclass
class SGLangBackendConfig(BackendConfig):
    """``backend=sglang``: :class:`~ar_torchrl.backends.SGLangBackend` over one or more servers."""

    url: Any = None  # None (launch num_servers) | a URL | a list of URLs
    # None/"none": the client spreads requests over the servers itself; "launch": an sglang-router
    # in front of them; a URL: a running sglang-router (then url is None: its workers are synced)
    router: Optional[str] = None
    num_servers: int = 1  # servers launched when url is None
    router_args: list[str] = field(default_factory=list)  # extra flags of a launched router
    router_health_checks: bool = False  # keep a launched router's periodic worker health checks
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
    # colocated GPU servers: release their memory before each update and resume it after
    # (ar_torchrl.backends.sglang.memory; launched servers get --enable-memory-saver); sync mode only
    release_memory_during_update: bool = False

    @property
    def urls(self) -> list[str] | None:
        """The server URLs (``None``: launch ``num_servers``, or a running router's workers)."""
        if self.url is None:
            return None
        return [self.url] if isinstance(self.url, str) else list(self.url)

    @property
    def router_mode(self) -> str:
        """``"none"``, ``"launch"`` or ``"url"`` (a running router at :attr:`router`)."""
        if self.router is None or self.router == "none":
            return "none"
        return "launch" if self.router == "launch" else "url"

    def check(self, prefix: str) -> None:
        if self.url is not None:
            urls = self.urls
            if not urls:
                raise ValueError(
                    f"{prefix}url must be null, a URL or a non-empty list of URLs, got []"
                )
            for url in urls:
                check_server_url(prefix, "url", url)
        self._check_router(prefix)
        check_choice(prefix, "device", self.device, ("cpu", "cuda"))
        check_timeout(prefix, "timeout_s", self.timeout_s)
        check_timeout(prefix, "sync_timeout_s", self.sync_timeout_s)
        check_stall_grace(  # real servers: the probe answers after 1 s at the earliest
            prefix,
            self.stall_grace_s,
            at_least=2,
            hint="SGLang answers the /health_generate probe after 1 s at the earliest; null disables "
            "the stall detection",
        )
        sender_options(
            self.weight_sync,
            dict(self.weight_sync_options),
            engine="sglang",
            prefix=f"{prefix}weight_sync_options.",
        )
        self._check_memory(prefix)

    def _check_memory(self, prefix: str) -> None:
        if not isinstance(self.release_memory_during_update, bool):
            raise TypeError(
                f"{prefix}release_memory_during_update must be true or false, got "
                f"{self.release_memory_during_update!r}"
            )
        launched = self.url is None and self.router_mode != "url"
        if self.release_memory_during_update and launched and self.device == "cpu":
            key = prefix.rpartition(": ")[2]
            raise ValueError(
                f"{prefix}release_memory_during_update=true releases the GPU memory of colocated "
                f"servers, but the servers launched here run on {key}device=cpu, where SGLang "
                "0.5.23's /release_memory_occupation kills the server (RuntimeError: Found no "
                f"NVIDIA driver on your system): set {key}device=cuda, or leave "
                "release_memory_during_update=false"
            )

    def releases_memory_during_update(self) -> bool:
        return self.release_memory_during_update

    def server_args(self) -> list[str]:
        """The flags a launched server gets beyond the launcher's: ``extra_args``, and
        ``--enable-memory-saver`` when its memory is released during updates.

        Example:
            >>> SGLangBackendConfig(device="cuda", release_memory_during_update=True).server_args()
            ['--enable-memory-saver']
        """
        extra = list(self.extra_args)
        if self.release_memory_during_update and "--enable-memory-saver" not in extra:
            extra.append("--enable-memory-saver")
        return extra

    def _check_router(self, prefix: str) -> None:
        mode, key = self.router_mode, prefix.rpartition(": ")[2]  # "backend." for the hints
        if mode == "url":
            if not isinstance(self.router, str) or "://" not in self.router:
                raise ValueError(
                    f"{prefix}router={self.router!r} must be none, launch, or the URL of a running "
                    "sglang-router (http://host:port)"
                )
            check_server_url(prefix, "router", self.router)
            if self.url is not None:
                raise ValueError(
                    f"{prefix}url={self.url!r} must be null when {key}router is a URL: the "
                    "servers are the router's workers (read from its GET /workers); list them in "
                    f"{key}url with {key}router=launch to start a router in front of them"
                )
        check_number(prefix, "num_servers", self.num_servers, ge=1, le=64, integer=True)
        if self.num_servers > 1 and self.url is not None:
            raise ValueError(
                f"{prefix}num_servers={self.num_servers} launches servers but {key}url names "
                f"running ones ({self.url!r}): set {key}url=null, or leave num_servers at 1"
            )
        if self.num_servers > 1 and mode == "url":
            raise ValueError(
                f"{prefix}num_servers={self.num_servers}: nothing is launched behind a running "
                f"router ({key}router={self.router!r}); leave num_servers at 1"
            )
        if mode != "launch" and (self.router_args or self.router_health_checks):
            raise ValueError(
                f"{prefix}router_args / {key}router_health_checks configure a launched router; "
                f"set {key}router=launch (it is {self.router!r})"
            )

    def starts_with_trainer_weights(self) -> bool:
        """Launched servers load the starting policy; running servers hold other weights."""
        return self.url is None and self.router_mode != "url"

    def build(self, context: BackendContext) -> Any:
        """Launch ``num_servers`` servers on the starting policy (stopped when the run ends) or
        connect to the given ones, with an sglang-router in front if asked (launched, or running);
        every server (and the router) must answer ``GET /health``."""
        from ar_torchrl.backends.sglang.client import SGLangBackend
        from ar_torchrl.backends.sglang.errors import SGLangUnavailableError

        urls, router_url = self.urls, None
        if urls is None and self.router_mode != "url":
            urls = self._launch_servers(context)
        if self.router_mode == "launch":
            from ar_torchrl.backends.sglang import router as sglang_router

            router = context.stack.enter_context(
                sglang_router.launch_sglang_router(
                    urls,
                    python=self.python,
                    health_checks=self.router_health_checks,
                    request_timeout_s=self.timeout_s + 60,
                    extra_args=list(self.router_args),
                    log_file=context.run_dir / "sglang_router.log",
                )
            )
            router_url = router.url
        elif self.router_mode == "url":
            router_url = self.router
        backend = SGLangBackend(
            urls,
            router_url=router_url,
            weight_sync=self.weight_sync,
            weight_sync_options=dict(self.weight_sync_options),
            options=SGLangClientOptions(
                timeout_s=self.timeout_s,
                stall_grace_s=self.stall_grace_s,
                sync_timeout_s=self.sync_timeout_s,
                vocab_size=context.model.config.vocab_size,
                show_progress=False,
            ),
        )
        context.stack.callback(backend.close)
        if not backend.health():  # said once, before anything reads as a weight-sync failure
            if self.router_mode == "url":
                raise SGLangUnavailableError(
                    f"backend.router={self.router}: the sglang-router or one of its workers does "
                    "not answer (GET /health, GET /workers); start them and check the URL"
                )
            raise SGLangUnavailableError(
                f"backend.url={urls}: no SGLang server answers GET /health there; start it (or "
                "set backend.url=null to launch one) and check the URL"
            )
        return backend

    def _launch_servers(self, context: BackendContext) -> list[str]:
        """``num_servers`` local servers on the starting policy, stopped when the run ends (one
        after the other: each takes 30-60 s to start on a CPU); their URLs."""
        from ar_torchrl.backends.sglang.launcher import launch_sglang_server

        model_dir, owned = context.start_dir, []
        if model_dir is None:  # the servers' start weights: deleted when they stop
            from ar_torchrl.backends.sglang import reaper
            from ar_torchrl.modules import save_policy

            model_dir = context.run_dir / "sglang_model"
            owned = [model_dir]  # also removed if this process is killed (the reaper)
            context.stack.callback(shutil.rmtree, model_dir, ignore_errors=True)
            reaper.guard_dir(model_dir)
            save_policy(context.model, model_dir, context.tokenizer)
        urls = []
        for i in range(self.num_servers):
            extra = self.server_args()
            if self.device == "cuda" and self.num_servers > 1 and "--base-gpu-id" not in extra:
                extra += ["--base-gpu-id", str(i * _tp_size(extra))]  # one GPU (or tp group) each
            name = "sglang_server.log" if self.num_servers == 1 else f"sglang_server-{i}.log"
            server = context.stack.enter_context(
                launch_sglang_server(
                    model_dir,
                    python=self.python,
                    device=self.device,
                    extra_args=extra,
                    log_file=context.run_dir / name,
                    owned_dirs=owned if i == 0 else [],  # the first one stops last
                )
            )
            urls.append(server.url)
        return urls


def _tp_size(args: list[str]) -> int:
    """``--tp-size``/``--tp`` in server flags (1 if absent).

    Example:
        >>> _tp_size(["--tp-size", "2"]), _tp_size(["--tp=4"]), _tp_size([])
        (2, 4, 1)
    """
    for k, arg in enumerate(args):
        flag, eq, value = str(arg).partition("=")
        if flag in ("--tp-size", "--tp"):
            return int(value if eq else args[k + 1])
    return 1
