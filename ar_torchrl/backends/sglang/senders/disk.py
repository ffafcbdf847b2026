"""Disk weight sync for SGLang: safetensors shards in a temp dir, then ``/update_weights_from_disk``.

The tensors are written shard by shard (one ``model-000NN.safetensors`` per bucket, plus
``model.safetensors.index.json``) as they arrive, so the stream is never held in memory; the
model's non-weight files (``config.json``, tokenizer, ...) are copied next to them; then every
server loads the directory (in parallel). The servers must see the same filesystem.
"""

from __future__ import annotations

import json
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
    post_checked,
)
from ar_torchrl.weight_sync.base import DEFAULT_BUCKET_BYTES, NamedTensors, iter_buckets
from ar_torchrl.weight_sync.errors import WeightSyncError

__all__ = ["DiskWeightSender", "remove_if_orphaned"]

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

    Temp dirs are named ``ar_torchrl-*``. The directory of the latest sync is kept while it is
    served (the servers' ``model_path`` points at it); it is removed at this sender's next
    successful sync, or when this process ends, whatever ends it (see :mod:`ar_torchrl.backends.sglang.reaper`),
    unless a live server still serves it.

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
        self._last_dir: Path | None = None
        self._snapshot: Path | None = None
        self._source: Path | None = None
        self._source_shapes: dict[str, tuple[int, ...]] = {}

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
            source = self.config_dir or Path(
                self.client.get(self.client.urls[0], "/model_info")["model_path"]
            )
            if not source.is_dir():
                raise WeightSyncError(
                    f"SGLang disk weight sync: the config source {source} does not exist (the "
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
            body = {"model_path": str(out), "weight_version": version, "flush_cache": True}
            on_each_server(
                self.client.urls, lambda u: self._load(u, body), "update_weights_from_disk"
            )
        except BaseException:
            shutil.rmtree(out, ignore_errors=True)
            reaper.release_dir(out)
            raise
        # The servers' model_path now points at `out`: keep it until the next sync replaces it.
        if self._last_dir is not None:
            shutil.rmtree(self._last_dir, ignore_errors=True)
            reaper.release_dir(self._last_dir)
        self._last_dir = out
        for path in set(served) - {out}:
            remove_if_orphaned(path)

    def _served_path(self, url: str) -> Path:
        return Path(self.client.get(url, "/model_info")["model_path"])

    def _load(self, url: str, body: dict) -> None:
        post_checked(self.client, url, "/update_weights_from_disk", body)
        self._applied()


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
