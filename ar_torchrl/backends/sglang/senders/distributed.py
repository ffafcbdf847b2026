"""Distributed weight sync for SGLang: the trainer broadcasts buckets to the servers' ranks.

``POST /init_weights_update_group`` on every server once (gloo on CPU, nccl on GPU; the trainer is
rank 0, each server's TP ranks follow), then per bucket ``POST /update_weights_from_distributed``
on every server while rank 0 broadcasts the flattened bucket. The rendezvous store listens on
``master_address`` only (a socket bound to that address is handed to ``TCPStore``; torch's default
would listen on every interface).
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Literal

import torch

from ar_torchrl.backends.sglang.senders.base import (
    SGLangClient,
    SGLangSender,
    on_each_server,
    post_checked,
    post_update,
    weight_update_session,
)
from ar_torchrl.backends.sglang.senders.tensor import flatten_bucket
from ar_torchrl.weight_sync.base import DEFAULT_BUCKET_BYTES, NamedTensors, iter_buckets, with_last
from ar_torchrl.weight_sync.errors import WeightSyncError

__all__ = [
    "DistributedWeightSender",
    "bound_store",
    "init_custom_process_group",
    "listening_socket",
]

logger = logging.getLogger(__name__)


def listening_socket(address: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to ``address`` only and listening (``port=0``: a free port).

    Example:
        >>> sock = listening_socket("127.0.0.1"); sock.getsockname()[0]
        '127.0.0.1'
        >>> sock.close()
    """
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((address, port))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


def bound_store(
    sock: socket.socket, world_size: int, timeout: timedelta
) -> torch.distributed.TCPStore:
    """The rendezvous ``TCPStore`` (this process is its master) serving on ``sock``'s address only.

    torch's default master listens on every interface; handing it a socket bound to one address
    (``master_listen_fd``) keeps the rendezvous there. The store owns the socket afterwards. The
    call returns once ``world_size`` members have connected, or raises after ``timeout``.

    Example:
        >>> store = bound_store(listening_socket("127.0.0.1"), 1, timedelta(seconds=5))
        >>> store.set("k", "v"); store.get("k")
        b'v'
    """
    address, port = sock.getsockname()[:2]
    return torch.distributed.TCPStore(
        address, port, world_size, True, timeout, master_listen_fd=sock.detach(), use_libuv=True
    )


def init_custom_process_group(
    backend: str,
    store: torch.distributed.Store,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: timedelta,
) -> torch.distributed.ProcessGroup:
    """A process group outside the default one (SGLang's ``init_custom_process_group``, same keys).

    The trainer's own default group (FSDP, DDP) is left untouched.
    """
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
    )

    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        store,
        group_name=group_name,
        backend_options=None,
        timeout=timeout,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


class DistributedWeightSender(SGLangSender):
    """Broadcast buckets from the trainer (rank 0) to the servers' ranks over a custom group.

    Args:
        client: the backend.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (GPU); default gloo without CUDA, else nccl.
        master_address: address of this (trainer) process that the servers can reach; the
            rendezvous listens there only.
        master_port: rendezvous port (default: a free one).
        group_name: SGLang's name of the group.
        bucket_bytes: maximum bytes per broadcast.
        timeout_s: group timeout (a broadcast nobody receives fails after it).

    Example:
        >>> DistributedWeightSender(client=None, backend="gloo").backend
        'gloo'
    """

    name = "distributed"

    def __init__(
        self,
        client: SGLangClient,
        *,
        backend: Literal["gloo", "nccl"] | None = None,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        group_name: str = "ar_torchrl_weight_sync",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 300.0,
    ) -> None:
        super().__init__(client)
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.master_address, self.master_port = master_address, master_port
        self.group_name, self.bucket_bytes, self.timeout_s = group_name, bucket_bytes, timeout_s
        self._group = self._store = None
        self._group_urls: list[str] = []  # the servers in the group (a router's may change)
        self._buffers: dict[
            int, torch.Tensor
        ] = {}  # bucket index -> flat buffer, refilled each sync

    @property
    def _device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _ensure_group(self) -> None:
        urls = list(self.client.urls)
        if self._group is not None and urls == self._group_urls:
            return
        if self._group is not None:  # the router's workers changed: a new group for the new set
            logger.warning(
                "SGLang distributed sync: the servers changed from %s to %s: new process group",
                self._group_urls,
                urls,
            )
            self._destroy_on([u for u in self._group_urls if u in urls])
            self._drop_group()
        tps = on_each_server(
            urls, lambda u: int(self.client.get(u, "/server_info").get("tp_size", 1)), "server_info"
        )
        world, timeout = 1 + sum(tps), timedelta(seconds=self.timeout_s)
        sock = listening_socket(self.master_address, self.master_port or 0)  # port known up front
        body = {
            "master_address": self.master_address,
            "master_port": sock.getsockname()[1],
            "world_size": world,
            "group_name": self.group_name,
            "backend": self.backend,
        }
        offsets = [1 + sum(tps[:i]) for i in range(len(urls))]
        with ThreadPoolExecutor(len(urls)) as pool:
            futures = [
                pool.submit(
                    post_checked,
                    self.client,
                    u,
                    "/init_weights_update_group",
                    {**body, "rank_offset": off},
                    retry=False,
                )
                for u, off in zip(urls, offsets)
            ]
            self._store = bound_store(sock, world, timeout)
            group = init_custom_process_group(
                self.backend, self._store, world, 0, self.group_name, timeout
            )
            for f in futures:
                f.result()
        self._group, self._group_urls = group, urls

    def _send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str) -> None:
        self._ensure_group()
        with weight_update_session(self.client):
            buckets = with_last(iter_buckets(named_tensors, self.bucket_bytes))
            for k, (bucket, last) in enumerate(buckets):
                self._broadcast(k, bucket, version if last else None)

    def _broadcast(self, k: int, bucket: NamedTensors, version: str | None) -> None:
        body = {
            "names": [n for n, _ in bucket],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
            "group_name": self.group_name,
            "load_format": "flattened_bucket",
            "flush_cache": version is not None,
        }
        if version is not None:
            body["weight_version"] = version
        flat, _ = flatten_bucket(
            [(n, t.to(self._device)) for n, t in bucket], out=self._buffers.get(k)
        )
        self._buffers[k] = flat  # the broadcast below has finished before the next sync refills it
        with ThreadPoolExecutor(len(self.client.urls)) as pool:
            futures = [
                pool.submit(
                    post_update,
                    self.client,
                    u,
                    "/update_weights_from_distributed",
                    body,
                    retry=False,
                )
                for u in self.client.urls
            ]
            work = torch.distributed.broadcast(flat, src=0, group=self._group, async_op=True)
            self._applied()
            errors = [f.exception() for f in futures]
            if any(errors):
                self._drop_group()  # a receiver that never joined leaves the group unusable
                raise WeightSyncError(
                    f"SGLang distributed weight sync failed: {next(e for e in errors if e)}"
                )
            work.wait()

    @property
    def store_port(self) -> int | None:
        """The rendezvous port while the group exists."""
        return None if self._store is None else self._store.port

    def _drop_group(self) -> None:
        group, self._group, self._store = self._group, None, None
        self._buffers.clear()  # a failed broadcast may still read its buffer
        if group is not None:
            with contextlib.suppress(Exception):
                torch.distributed.destroy_process_group(group)

    def _destroy_on(self, urls: list[str]) -> None:
        for url in urls:
            with contextlib.suppress(Exception):
                self.client.post(
                    url,
                    "/destroy_weights_update_group",
                    {"group_name": self.group_name},
                    retry=False,
                )

    def close(self) -> None:
        self._buffers.clear()
        if self._group is None:
            return
        self._destroy_on(self._group_urls)
        self._drop_group()
