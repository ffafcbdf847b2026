"""Tensor-bucket weight sync for SGLang: ``/update_weights_from_tensor`` through shared memory.

Inside one weight-update session on every server (``/begin_weight_update`` ...
``/end_weight_update``; a 404 means an older server that needs none), each bucket of tensors is
flattened to one ``uint8`` buffer with SGLang's ``flattened_bucket`` metadata, pickled with torch's
multiprocessing reductions (the tensors travel through shared memory, so the servers must run on
this machine) and posted to every server in parallel. The last bucket carries ``weight_version``.

The ``file_system`` strategy makes torch start a ``torch_shm_manager`` daemon for this process (in
its own session, ~100 MB resident). Every server that opened one of our segments keeps a
connection to it for as long as it lives (torch caches the connection per manager), and the
manager only exits once no client is connected: so it would outlive this process for as long as
the servers do. It cannot be stopped while this process runs (torch keeps using that manager for
every later shared tensor of the process), so the sender registers it with
:mod:`~ar_torchrl.backends.sglang.reaper`, which stops it when this process ends, however it ends
(after this process's launched servers are stopped it exits by itself). A server that still maps
one of our segments at that moment (this process died in the middle of a sync) would fail when it
frees it; such a server is mid-update anyway.
"""

from __future__ import annotations

import base64
import functools
import io
import os
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from ar_torchrl.backends.sglang import reaper
from ar_torchrl.backends.sglang.senders.base import (
    SGLangClient,
    SGLangSender,
    on_each_server,
    post_update,
    weight_update_session,
)
from ar_torchrl.weight_sync.base import (
    DEFAULT_BUCKET_BYTES,
    NamedTensors,
    iter_buckets,
    with_last,
)

__all__ = ["TensorWeightSender", "flatten_bucket", "serialize_for_sglang", "shm_managers"]

_guarded_managers: set[int] = set()


def flatten_bucket(
    bucket: NamedTensors, *, shared: bool = False, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, list[SimpleNamespace]]:
    """Concatenate a bucket as raw bytes, with SGLang's ``FlattenedTensorMetadata`` fields.

    The metadata are ``types.SimpleNamespace`` objects (name, shape, dtype, start_idx, end_idx,
    numel): SGLang reads them by attribute and its safe unpickler allows ``SimpleNamespace``.

    Args:
        bucket: ``(name, tensor)`` pairs, all on one device.
        shared: CPU tensors only: concatenate straight into a new shared-memory segment, so that
            pickling it for a server copies nothing (without it the pickler moves the buffer into
            shared memory: a second full copy of the bucket, measured by
            ``benchmarks/bench_weight_sync.py``).
        out: a ``uint8`` buffer from an earlier call (``shared=False``) to write into when its size
            and device fit (a fresh CPU buffer costs a page fault per 4 KiB: ~6x the copy itself);
            else a new one is made. Never a buffer a server may still open by name (a reused
            shared-memory segment crashed SGLang 0.5.23: the tensor sender makes a new one each time).

    Returns:
        ``flat`` ``[total_bytes]`` uint8 and one metadata entry per tensor.

    Example:
        >>> flat, meta = flatten_bucket([("w", torch.ones(2, 3)), ("b", torch.zeros(3))])
        >>> flat.dtype, flat.numel(), (meta[1].name, meta[1].start_idx, meta[1].end_idx)
        (torch.uint8, 36, ('b', 24, 36))
        >>> flatten_bucket([("w", torch.ones(2, 3))], shared=True)[0].is_shared()
        True
    """
    chunks, meta, offset = [], [], 0
    for name, t in bucket:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        chunks.append(raw)
        meta.append(
            SimpleNamespace(
                name=name,
                shape=t.shape,
                dtype=t.dtype,
                start_idx=offset,
                end_idx=offset + raw.numel(),
                numel=raw.numel(),
            )
        )
        offset += raw.numel()
    device = chunks[0].device
    if out is not None and (out.numel(), out.device, out.dtype) == (offset, device, torch.uint8):
        return torch.cat(chunks, out=out), meta
    if not shared or device.type != "cpu":
        return torch.cat(chunks), meta
    flat = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(offset))
    return torch.cat(chunks, out=flat), meta


def serialize_for_sglang(obj: Any) -> str:
    """Pickle ``obj`` with torch's multiprocessing reductions and base64 it (SGLang's format).

    Tensors travel by reference (shared memory with the ``file_system`` strategy, CUDA IPC on GPU):
    keep them alive until the server has answered.

    Example:
        >>> isinstance(serialize_for_sglang({"a": 1}), str)
        True
    """
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers torch's reductions with ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


def shm_managers(parent: int | None = None) -> list[tuple[int, str | None]]:
    """The ``torch_shm_manager`` children of ``parent`` (default: this process) and the directory
    of each one's socket (``None`` if not found); Linux only (``[]`` elsewhere).

    Example:
        >>> shm_managers(parent=2**22 + 1)
        []
    """
    parent = os.getpid() if parent is None else parent
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if comm == "torch_shm_manag" and ppid == parent:  # comm is cut at 15 characters
            found.append((int(entry.name), _socket_dir(entry)))
    return found


def _socket_dir(entry: Path) -> str | None:
    """The ``torch-shm-dir-*`` directory of a manager's listening socket (``/proc/net/unix``)."""
    inodes = set()
    try:
        for fd in (entry / "fd").iterdir():
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
        lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) >= 8 and fields[6] in inodes:
            path = Path(fields[7])
            if path.name == "manager.sock" and path.parent.name.startswith("torch-shm-dir-"):
                return str(path.parent)
    return None


def _guard_shm_manager() -> None:
    """Hand this process's ``torch_shm_manager`` to the reaper (once; see the module docstring)."""
    if _guarded_managers:
        return
    for pid, socket_dir in shm_managers():
        reaper.guard_shm_manager(pid, socket_dir)
        _guarded_managers.add(pid)


class TensorWeightSender(SGLangSender):
    """Bucketed ``/update_weights_from_tensor`` (``flattened_bucket``) inside a weight-update session.

    Sets ``torch.multiprocessing.set_sharing_strategy("file_system")`` in this process (the
    default ``file_descriptor`` strategy makes the server fail with ``AuthenticationError``).

    Args:
        client: the backend (servers on this machine).
        bucket_bytes: maximum bytes per request.

    Example:
        >>> TensorWeightSender(client=None).bucket_bytes == 256 << 20
        True
    """

    name = "tensor"

    def __init__(self, client: SGLangClient, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        super().__init__(client)
        self.bucket_bytes = bucket_bytes
        self._tp: dict[str, int] = {}

    def _tp_size(self, url: str) -> int:
        if url not in self._tp:
            self._tp[url] = int(self.client.get(url, "/server_info").get("tp_size", 1))
        return self._tp[url]

    def _send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str) -> None:
        torch.multiprocessing.set_sharing_strategy("file_system")
        served = self.served_shapes()  # same machine: the served checkpoints are readable
        with weight_update_session(self.client):
            for bucket, last in with_last(iter_buckets(named_tensors, self.bucket_bytes)):
                self.check_bucket(bucket, served)
                flat, meta = flatten_bucket(bucket, shared=True)
                # Every server gets its own copy in its own shared-memory segment, pickled here in
                # one thread: a segment read by two servers was seen to vanish before the second
                # one opened it (SGLang 0.5.23 + torch's file_system strategy).
                copies = [flat] + [flat.clone() for _ in self.client.urls[1:]]
                ranks = {
                    url: [
                        serialize_for_sglang({"flattened_tensor": copy, "metadata": meta})
                        for _ in range(self._tp_size(url))
                    ]
                    for url, copy in zip(self.client.urls, copies)
                }
                _guard_shm_manager()  # torch has started it for the first shared segment
                body = {"load_format": "flattened_bucket", "flush_cache": last}
                if last:
                    body["weight_version"] = version
                post = functools.partial(self._post, ranks=ranks, body=body)
                on_each_server(self.client.urls, post, "update_weights_from_tensor")
                del flat, copies  # only after every server has answered

    def _post(self, url: str, *, ranks: dict[str, list[str]], body: dict) -> None:
        body = {**body, "serialized_named_tensors": ranks[url]}
        post_update(self.client, url, "/update_weights_from_tensor", body)
        self._applied()
