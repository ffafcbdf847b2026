"""Weight-sync senders for SGLang 0.5.x servers, used by ``SGLangBackend.sync_weights``.

Three ways to ship the policy (``named_policy_tensors(model)``, HF names, never ``value_head.*``):

- :class:`DiskWeightSender` (``"disk"``): safetensors + the model's config files into a temp dir,
  then ``POST /update_weights_from_disk``. The server must see the same filesystem.
- :class:`TensorWeightSender` (``"tensor"``): ``POST /begin_weight_update``, buckets sent with
  ``POST /update_weights_from_tensor`` (``load_format="flattened_bucket"``, payload pickled with
  torch's multiprocessing reductions, so the tensors travel through shared memory), then
  ``POST /end_weight_update``. Same machine only. A 404 on begin/end means an older server that
  needs no session.
- :class:`DistributedWeightSender` (``"distributed"``): ``POST /init_weights_update_group`` once
  (gloo on CPU, nccl on GPU; the trainer is rank 0), then per bucket ``POST
  /update_weights_from_distributed`` while rank 0 broadcasts the flattened bucket.

Every sender passes ``weight_version`` (on the last request of a sync) and then checks that each
server reports ``weight_version == str(version)`` in ``GET /model_info``. Any failure raises
:class:`~ar_torchrl.weight_sync.errors.WeightSyncError` with the server's message.
"""

from __future__ import annotations

import abc
import atexit
import base64
import contextlib
import io
import logging
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal, Protocol

import torch
from safetensors.torch import save_file

from ar_torchrl.weight_sync.errors import WeightSyncError
from ar_torchrl.weight_sync.names import VALUE_HEAD_PREFIX

__all__ = [
    "DiskWeightSender",
    "DistributedWeightSender",
    "SGLangWeightSender",
    "TensorWeightSender",
    "bucketize",
    "check_shapes",
    "checkpoint_shapes",
    "flatten_bucket",
    "make_sender",
    "policy_tensors",
]

logger = logging.getLogger(__name__)

NamedTensors = list[tuple[str, torch.Tensor]]
DEFAULT_BUCKET_BYTES = 256 << 20
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


class SGLangClient(Protocol):
    """What a sender needs from the backend: its URLs and JSON ``post``/``get`` with retries."""

    urls: list[str]

    def post(
        self, url: str, path: str, body: Any, *, timeout_s: float | None = None, retry: bool = True
    ) -> Any: ...

    def get(self, url: str, path: str, *, timeout_s: float = 30.0) -> Any: ...


def policy_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> NamedTensors:
    """Materialise ``(name, tensor)`` pairs, dropping ``value_head.*`` (and asserting none is left).

    Raises:
        WeightSyncError: nothing left to send.

    Example:
        >>> items = policy_tensors([("a.weight", torch.ones(2)), ("value_head.weight", torch.ones(1, 2))])
        >>> [n for n, _ in items]
        ['a.weight']
    """
    items = [(name, t) for name, t in named_tensors if not name.startswith(VALUE_HEAD_PREFIX)]
    assert not any(name.startswith(VALUE_HEAD_PREFIX) for name, _ in items), "value_head leaked"
    if not items:
        raise WeightSyncError(
            "SGLang weight sync: no policy tensors to send (got an empty iterable?)"
        )
    return items


def bucketize(items: NamedTensors, bucket_bytes: int) -> list[NamedTensors]:
    """Split tensors into buckets of at most ``bucket_bytes`` (a bigger tensor gets its own bucket).

    Inside a bucket tensors are ordered by decreasing element size, so every tensor starts at a byte
    offset aligned to its dtype in the flattened ``uint8`` buffer (SGLang checks this).

    Example:
        >>> items = [("a", torch.zeros(4)), ("b", torch.zeros(4)), ("c", torch.zeros(8))]
        >>> [[n for n, _ in b] for b in bucketize(items, bucket_bytes=32)]
        [['a', 'b'], ['c']]
    """
    buckets: list[NamedTensors] = [[]]
    size = 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, t))
        size += nbytes
    return [sorted(b, key=lambda it: -it[1].element_size()) for b in buckets]


def flatten_bucket(bucket: NamedTensors) -> tuple[torch.Tensor, list[SimpleNamespace]]:
    """Concatenate a bucket as raw bytes, with SGLang's ``FlattenedTensorMetadata`` fields.

    The metadata are ``types.SimpleNamespace`` objects (name, shape, dtype, start_idx, end_idx,
    numel): SGLang reads them by attribute and its safe unpickler allows ``SimpleNamespace``.

    Returns:
        ``flat`` ``[total_bytes]`` uint8 and one metadata entry per tensor.

    Example:
        >>> flat, meta = flatten_bucket([("w", torch.ones(2, 3)), ("b", torch.zeros(3))])
        >>> flat.dtype, flat.numel(), (meta[1].name, meta[1].start_idx, meta[1].end_idx)
        (torch.uint8, 36, ('b', 24, 36))
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
            )  # fmt: skip
        )
        offset += raw.numel()
    return torch.cat(chunks), meta


def _post_checked(client: SGLangClient, url: str, path: str, body: dict, **kw: Any) -> dict:
    answer = client.post(url, path, body, **kw)
    if isinstance(answer, dict) and answer.get("success") is False:
        raise WeightSyncError(f"SGLang {url}{path} failed: {answer.get('message')}")
    return answer


class SGLangWeightSender(abc.ABC):
    """Base of the senders: filter, send, then check ``weight_version`` on every server."""

    name = "base"

    def __init__(self, client: SGLangClient) -> None:
        self.client = client

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str) -> None:
        """Ship the tensors to every server and tag them ``version``; raise ``WeightSyncError`` on failure."""
        items = policy_tensors(named_tensors)
        try:
            self._send(items, str(version))
        except WeightSyncError:
            raise
        except Exception as exc:  # transport errors carry the server's message
            raise WeightSyncError(
                f"SGLang {self.name} weight sync (version {version}) failed: {exc}"
            ) from exc
        self._check_versions(str(version))
        logger.info("SGLang %s weight sync: %d tensors, version %s", self.name, len(items), version)

    @abc.abstractmethod
    def _send(self, items: NamedTensors, version: str) -> None: ...

    def _check_versions(self, version: str) -> None:
        for url in self.client.urls:
            got = self.client.get(url, "/model_info").get("weight_version")
            if got != version:
                raise WeightSyncError(
                    f"SGLang {url}: after a {self.name} sync the server reports weight_version={got!r}, "
                    f"expected {version!r}"
                )

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (process groups). Idempotent."""


# Temp dirs this process keeps, with the server URLs that may be serving them.
_KEPT_DIRS: dict[Path, tuple[str, ...]] = {}


def _served_by_live_server(path: Path, urls: Sequence[str]) -> bool:
    import requests

    for url in urls:
        try:
            info = requests.get(f"{url}/model_info", timeout=1.0).json()
        except Exception:  # server gone or not answering: nobody serves the dir from there
            continue
        if info.get("model_path") == str(path):
            return True
    return False


@atexit.register
def _remove_kept_dirs() -> None:
    """Remove this process's temp dirs, except one a live server still reports as its model_path
    (a shared server outliving this client: its next client reads the config from there)."""
    for d, urls in list(_KEPT_DIRS.items()):
        if urls and _served_by_live_server(d, urls):
            logger.info("keeping %s: a live SGLang server still serves it", d)
            continue
        shutil.rmtree(d, ignore_errors=True)


class DiskWeightSender(SGLangWeightSender):
    """Write safetensors + config to a temp dir, ``POST /update_weights_from_disk`` to each server.

    Args:
        client: the backend.
        config_dir: directory whose non-weight files (``config.json``, tokenizer, ...) are copied
            next to the weights (default: the server's model path, read once from ``/model_info``).
        tmp_root: where temp dirs are made (must be readable by the server).

    The directory of the latest sync is kept (the servers' ``model_path`` points at it, and a later
    sender reads the config from there); it is removed at this sender's next successful sync, or
    when the interpreter exits unless a live server still serves it (a shared server's next
    client reads its config from there).

    Example:
        >>> DiskWeightSender(client=None, config_dir="/tmp").name
        'disk'
    """

    name = "disk"

    def __init__(
        self,
        client: SGLangClient,
        *,
        config_dir: str | Path | None = None,
        tmp_root: str | Path | None = None,
    ) -> None:
        super().__init__(client)
        self.config_dir = Path(config_dir) if config_dir else None
        self.tmp_root = tmp_root
        self._last_dir: Path | None = None
        self._snapshot: Path | None = None
        self._served_shapes: dict[str, tuple[int, ...]] = {}

    def _resolve_config_dir(self) -> Path:
        """A private snapshot of the served checkpoint's config files (and its tensor shapes).

        The server's ``model_path`` may be another sender's temp dir, which that sender deletes at
        its next sync: copying the small non-weight files once makes this sender independent of it.
        """
        if self._snapshot is None:
            source = self.config_dir or Path(
                self.client.get(self.client.urls[0], "/model_info")["model_path"]
            )
            if not source.is_dir():
                raise WeightSyncError(
                    f"SGLang disk weight sync: the config source {source} does not exist (the "
                    "server's model_path may be another client's removed temp dir); pass "
                    "weight_sync_options={'config_dir': <the model's HF directory>}"
                )
            snap = Path(tempfile.mkdtemp(prefix="ar_torchrl-config-", dir=self.tmp_root))
            _KEPT_DIRS[snap] = ()
            for f in source.iterdir():
                if (
                    f.is_file()
                    and not f.name.endswith(_WEIGHT_SUFFIXES)
                    and not f.name.endswith(".index.json")
                ):
                    shutil.copy2(f, snap / f.name)
            self._served_shapes = checkpoint_shapes(source)
            self._snapshot = snap
        return self._snapshot

    def _write(self, items: NamedTensors, out: Path) -> None:
        tensors, seen = {}, set()
        for name, t in items:
            t = t.detach().to("cpu").contiguous()
            key = (t.untyped_storage().data_ptr(), t.storage_offset())
            tensors[name] = t.clone() if key in seen else t  # safetensors refuses shared storage
            seen.add(key)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        for f in self._resolve_config_dir().iterdir():
            shutil.copy2(f, out / f.name)

    def _send(self, items: NamedTensors, version: str) -> None:
        where = self._resolve_config_dir()
        check_shapes(items, self._served_shapes, where)
        out = Path(tempfile.mkdtemp(prefix="ar_torchrl-weights-", dir=self.tmp_root))
        try:
            self._write(items, out)
            body = {"model_path": str(out), "weight_version": version, "flush_cache": True}
            for url in self.client.urls:
                _post_checked(self.client, url, "/update_weights_from_disk", body)
        except BaseException:
            shutil.rmtree(out, ignore_errors=True)
            raise
        # The servers' model_path now points at `out`: keep it until the next sync replaces it
        # (or until this interpreter exits).
        if self._last_dir is not None:
            shutil.rmtree(self._last_dir, ignore_errors=True)
            _KEPT_DIRS.pop(self._last_dir, None)
        self._last_dir = out
        _KEPT_DIRS[out] = tuple(self.client.urls)


def checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of the safetensors files in ``model_dir`` (headers only; ``{}`` if none).

    Example:
        >>> checkpoint_shapes(Path("/nonexistent"))
        {}
    """
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            shapes.update({k: tuple(sf.get_slice(k).get_shape()) for k in sf.keys()})
    return shapes


def check_shapes(items: NamedTensors, shapes: dict[str, tuple[int, ...]], where: object) -> None:
    """Refuse tensors whose shapes differ from the served checkpoint's (``shapes``) before sending.

    SGLang 0.5.23 does not survive a wrong-shaped disk update (its rollback re-reads the same bad
    files and the scheduler dies), so a mismatch is refused here. Names absent from the
    checkpoint (e.g. a tied ``lm_head.weight``) are not checked; the server ignores unknown names.

    Raises:
        WeightSyncError: naming the first mismatching tensors.

    Example:
        >>> check_shapes([("w", torch.ones(2))], {"w": (3,)}, "ckpt")
        Traceback (most recent call last):
        ...
        ar_torchrl.weight_sync.errors.WeightSyncError: SGLang weight sync: shapes differ from the served checkpoint ckpt for 1 tensors, e.g. (name, sent, served) [('w', (2,), (3,))]; send the same architecture
    """
    bad = [
        (n, tuple(t.shape), shapes[n])
        for n, t in items
        if n in shapes and tuple(t.shape) != shapes[n]
    ]
    if bad:
        raise WeightSyncError(
            f"SGLang weight sync: shapes differ from the served checkpoint {where} for "
            f"{len(bad)} tensors, e.g. (name, sent, served) {bad[:3]}; send the same architecture"
        )


class _SessionMixin:
    """``/begin_weight_update`` / ``/end_weight_update`` (404 = older server, no session)."""

    client: SGLangClient

    def _session(self, url: str, path: str) -> None:
        try:
            _post_checked(self.client, url, path, {})
        except Exception as exc:
            if getattr(exc, "status", None) == 404:
                logger.debug(
                    "SGLang %s%s: 404, older server without weight-update sessions", url, path
                )
                return
            raise

    @contextlib.contextmanager
    def _sessions(self, urls: Sequence[str]):
        opened = []
        try:
            for url in urls:
                self._session(url, "/begin_weight_update")
                opened.append(url)
            yield
        finally:
            for url in opened:
                self._session(url, "/end_weight_update")


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


class TensorWeightSender(_SessionMixin, SGLangWeightSender):
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

    def _send(self, items: NamedTensors, version: str) -> None:
        torch.multiprocessing.set_sharing_strategy("file_system")
        buckets = bucketize(items, self.bucket_bytes)
        for url in self.client.urls:  # same machine: the served checkpoint is readable
            served = Path(self.client.get(url, "/model_info")["model_path"])
            check_shapes(items, checkpoint_shapes(served), served)
            with self._sessions([url]):
                for k, bucket in enumerate(buckets):
                    flat, meta = flatten_bucket(bucket)
                    payload = {"flattened_tensor": flat, "metadata": meta}
                    body = {
                        "serialized_named_tensors": [
                            serialize_for_sglang(payload) for _ in range(self._tp_size(url))
                        ],
                        "load_format": "flattened_bucket",
                        "flush_cache": k == len(buckets) - 1,
                    }
                    if k == len(buckets) - 1:
                        body["weight_version"] = version
                    _post_checked(self.client, url, "/update_weights_from_tensor", body)
                    del flat, payload


def init_custom_process_group(
    backend: str, init_method: str, world_size: int, rank: int, group_name: str, timeout: timedelta
) -> torch.distributed.ProcessGroup:
    """A process group outside the default one (SGLang's ``init_custom_process_group``, same keys).

    The trainer's own default group (FSDP, DDP) is left untouched.
    """
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
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


class DistributedWeightSender(_SessionMixin, SGLangWeightSender):
    """Broadcast buckets from the trainer (rank 0) to the servers' ranks over a custom group.

    Args:
        client: the backend.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (GPU); default gloo without CUDA, else nccl.
        master_address: address of this (trainer) process that the servers can reach.
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
        self._group = None

    @property
    def _device(self) -> torch.device:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if self.backend == "nccl"
            else torch.device("cpu")
        )

    def _ensure_group(self) -> None:
        if self._group is not None:
            return
        from ar_torchrl.backends.sglang import free_port

        urls = self.client.urls
        tps = [int(self.client.get(u, "/server_info").get("tp_size", 1)) for u in urls]
        offsets = [1 + sum(tps[:i]) for i in range(len(urls))]
        port = self.master_port or free_port(self.master_address)
        body = {"master_address": self.master_address, "master_port": port, "world_size": 1 + sum(tps),
                "group_name": self.group_name, "backend": self.backend}  # fmt: skip
        with ThreadPoolExecutor(len(urls)) as pool:
            futures = [pool.submit(_post_checked, self.client, u, "/init_weights_update_group",
                                   {**body, "rank_offset": off}, retry=False) for u, off in zip(urls, offsets)]  # fmt: skip
            group = init_custom_process_group(
                self.backend, f"tcp://{self.master_address}:{port}", 1 + sum(tps), 0,
                self.group_name, timedelta(seconds=self.timeout_s),
            )  # fmt: skip
            for f in futures:
                f.result()
        self._group = group

    def _send(self, items: NamedTensors, version: str) -> None:
        self._ensure_group()
        buckets = bucketize(items, self.bucket_bytes)
        with self._sessions(self.client.urls):
            for k, bucket in enumerate(buckets):
                self._broadcast(bucket, version if k == len(buckets) - 1 else None)

    def _broadcast(self, bucket: NamedTensors, version: str | None) -> None:
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
        flat, _ = flatten_bucket([(n, t.to(self._device)) for n, t in bucket])
        with ThreadPoolExecutor(len(self.client.urls)) as pool:
            futures = [pool.submit(_post_checked, self.client, u, "/update_weights_from_distributed", body,
                                   retry=False) for u in self.client.urls]  # fmt: skip
            work = torch.distributed.broadcast(flat, src=0, group=self._group, async_op=True)
            errors = [f.exception() for f in futures]
            if any(errors):
                self._drop_group()  # a receiver that never joined leaves the group unusable
                raise WeightSyncError(
                    f"SGLang distributed weight sync failed: {next(e for e in errors if e)}"
                )
            work.wait()

    def _drop_group(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            with contextlib.suppress(Exception):
                torch.distributed.destroy_process_group(group)

    def close(self) -> None:
        if self._group is None:
            return
        for url in self.client.urls:
            with contextlib.suppress(Exception):
                self.client.post(
                    url,
                    "/destroy_weights_update_group",
                    {"group_name": self.group_name},
                    retry=False,
                )
        self._drop_group()


_SENDERS = {
    "disk": DiskWeightSender,
    "tensor": TensorWeightSender,
    "distributed": DistributedWeightSender,
}


def make_sender(
    mode: Literal["disk", "tensor", "distributed"], client: SGLangClient, **options: Any
) -> SGLangWeightSender:
    """Build the sender for ``mode`` (``SGLangBackend(weight_sync=mode, weight_sync_options=...)``).

    Example:
        >>> type(make_sender("disk", client=None, config_dir="/tmp")).__name__
        'DiskWeightSender'
    """
    if mode not in _SENDERS:
        raise ValueError(f"SGLang weight_sync must be one of {sorted(_SENDERS)}, got {mode!r}")
    return _SENDERS[mode](client, **options)
