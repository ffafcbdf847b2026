"""Disk weight sync for SGLang: safetensors shards in a temp dir, then ``/update_weights_from_disk``.

The tensors are written shard by shard (one ``model-000NN.safetensors`` per bucket, plus
``model.safetensors.index.json``) as they arrive, so the stream is never held in memory; the
model's non-weight files (``config.json``, tokenizer, ...) are copied next to them; then every
server loads the directory (in parallel). The servers must see the same filesystem.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from ar_torchrl.backends.sglang import reaper
from ar_torchrl.backends.sglang.senders.base import (
    SGLangClient,
    SGLangSender,
    check_shapes,
    checkpoint_shapes,
    on_each_server,
    post_update,
)
from ar_torchrl.weight_sync.base import DEFAULT_BUCKET_BYTES, NamedTensors, iter_buckets
from ar_torchrl.weight_sync.errors import WeightSyncError

__all__ = ["DiskWeightSender", "remove_if_orphaned"]

logger = logging.getLogger(__name__)

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
INDEX_FILE = "model.safetensors.index.json"
OWNER_FILE = ".ar_torchrl-owner"


class DiskWeightSender(SGLangSender):
    """Write safetensors shards + config to a temp dir; every server loads it from disk.

    Args:
        client: the backend (its URLs, ``post``/``get``).
        config_dir: directory whose non-weight files (``config.json``, tokenizer, ...) are copied
            next to the weights (default: the first server's model path, read from ``/model_info``).
        tmp_root: where temp dirs are made (must be readable by the servers).
        bucket_bytes: most bytes per shard file.

    Temp dirs are named ``ar_torchrl-*``. A weights directory is never removed while a server may
    serve it (report it as its ``model_path``): the latest sync's is kept; a sync that failed on
    some servers keeps its directory (the others may have loaded it) and the ones before it (the
    failed servers still serve those). They are removed once every server has moved on (at this
    sender's next successful sync, or at :meth:`close` when every server answers and none serves
    them), or when this process ends, whatever ends it (see
    :mod:`ar_torchrl.backends.sglang.reaper`), unless a live server still serves them; a directory
    left to a server is removed by the next client or launcher that sees it unserved
    (:func:`remove_if_orphaned`).

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
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        super().__init__(client)
        self.config_dir = Path(config_dir) if config_dir else None
        self.tmp_root, self.bucket_bytes = tmp_root, bucket_bytes
        self._dirs: list[Path] = []  # weights dirs written here that a server may serve
        self._snapshot: Path | None = None
        self._source: Path | None = None
        self._source_shapes: dict[str, tuple[int, ...]] = {}

    @property
    def _last_dir(self) -> Path | None:
        """The latest sync's directory (``None`` before the first)."""
        return self._dirs[-1] if self._dirs else None

    def _mkdtemp(self, kind: str, served: bool) -> Path:
        path = Path(tempfile.mkdtemp(prefix=f"ar_torchrl-{kind}-", dir=self.tmp_root))
        reaper.guard_dir(path, self.client.urls if served else (), self.client.api_key)
        (path / OWNER_FILE).write_text(f"{socket.gethostname()} {os.getpid()}")
        return path

    def _resolve_config_dir(self) -> Path:
        """A private snapshot of the served checkpoint's config files (and its tensor shapes).

        The server's ``model_path`` may be another sender's temp dir, which that sender deletes at
        its next sync: copying the small non-weight files once makes this sender independent of it.
        """
        if self._snapshot is None:
            if self.config_dir is not None:
                candidates = [self.config_dir]
            else:  # any server's: after a partly failed sync they may differ
                candidates = list(
                    dict.fromkeys(on_each_server(self.client.urls, self._served_path, "model_info"))
                )
            source = next((c for c in candidates if c.is_dir()), None)
            if source is None:
                shown = candidates[0] if len(candidates) == 1 else candidates
                raise WeightSyncError(
                    f"SGLang disk weight sync: the config source {shown} does not exist (the "
                    "server's model_path may be another client's removed temp dir); pass "
                    "weight_sync_options={'config_dir': <the model's HF directory>}"
                )
            snap = self._mkdtemp("config", served=False)
            for f in _config_files(source):
                shutil.copy2(f, snap / f.name)
            self._source_shapes = checkpoint_shapes(source)
            self._snapshot, self._source = snap, source
        return self._snapshot

    def _write(self, named_tensors: Iterable[tuple[str, torch.Tensor]], out: Path) -> None:
        weight_map, total = {}, 0
        for k, bucket in enumerate(iter_buckets(named_tensors, self.bucket_bytes)):
            check_shapes(bucket, self._source_shapes, self._source)
            name = f"model-{k + 1:05d}.safetensors"
            tensors = _unshared(bucket)
            save_file(tensors, str(out / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, name))
            total += sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=1))
        for f in _config_files(self._resolve_config_dir()):
            shutil.copy2(f, out / f.name)

    def _send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str) -> None:
        self._resolve_config_dir()
        served = on_each_server(self.client.urls, self._served_path, "model_info")
        out = self._mkdtemp("weights", served=True)
        try:
            self._write(named_tensors, out)
        except BaseException:  # no server has seen it
            _remove(out)
            raise
        self._dirs.append(out)
        body = {"model_path": str(out), "weight_version": version, "flush_cache": True}
        # A failure below may leave some servers on `out` and others on an older dir: all are
        # kept (see the class docstring).
        on_each_server(self.client.urls, lambda u: self._load(u, body), "update_weights_from_disk")
        for old in self._dirs[:-1]:  # every server serves `out` now
            _remove(old)
        self._dirs = [out]
        for path in set(served) - {out}:
            remove_if_orphaned(path)

    def close(self) -> None:
        """Remove the weights dirs of this sender that no server serves (when all answer)."""
        if not self._dirs:
            return
        try:
            served = set(on_each_server(self.client.urls, self._served_path, "model_info"))
        except Exception as exc:  # noqa: BLE001 - a server that does not answer may serve any
            logger.debug("DiskWeightSender.close: keeping %s (%s)", self._dirs, exc)
            return
        for path in [d for d in self._dirs if d not in served]:
            _remove(path)
            self._dirs.remove(path)

    def _served_path(self, url: str) -> Path:
        return Path(self.client.get(url, "/model_info")["model_path"])

    def _load(self, url: str, body: dict) -> None:
        post_update(self.client, url, "/update_weights_from_disk", body)
        self._applied()


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    reaper.release_dir(path)


def _config_files(directory: Path) -> list[Path]:
    """The model's non-weight files (config, tokenizer, ...): no weights, index or owner file."""
    skip = _WEIGHT_SUFFIXES + (".index.json", OWNER_FILE)
    return [f for f in directory.iterdir() if f.is_file() and not f.name.endswith(skip)]


def remove_if_orphaned(path: Path) -> None:
    """Remove a weights dir a server no longer serves when the process that wrote it is gone.

    A process that exits while a shared server serves its dir keeps that dir (the server may
    still read it); the next sender that moves the server off it, or the launcher that stops the
    server, removes it if it was written on this host by a process that no longer runs (its
    ``.ar_torchrl-owner`` file says who).

    Example:
        >>> remove_if_orphaned(Path("/nonexistent/ar_torchrl-weights-x"))  # not ours: untouched
    """
    try:
        host, pid = (path / OWNER_FILE).read_text().split()
    except (OSError, ValueError):
        return  # not one of ours (e.g. the model's own directory)
    if not path.name.startswith("ar_torchrl-weights-") or host != socket.gethostname():
        return
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        shutil.rmtree(path, ignore_errors=True)
    except PermissionError:  # alive, another user's
        pass


def _unshared(bucket: NamedTensors) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors; a tensor sharing storage with an earlier one is cloned
    (safetensors refuses shared storage, e.g. tied embeddings)."""
    tensors, seen = {}, set()
    for name, t in bucket:
        t = t.detach().to("cpu").contiguous()
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        tensors[name] = t.clone() if key in seen else t
        seen.add(key)
    return tensors
