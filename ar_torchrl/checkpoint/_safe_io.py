"""Code-free storage for distributed checkpoints: JSON for states, an allowlist for DCP metadata.

``torch.distributed.checkpoint``'s file reader unpickles ``.metadata`` with a plain ``pickle.load``
and its default planner reads non-tensor items with ``torch.load(weights_only=False)``: either would
run code planted in a run directory. :class:`SafeReader` unpickles ``.metadata`` through an allowlist
of DCP's own metadata classes, :class:`TensorsOnlyPlanner` refuses pickled items (our checkpoints
keep only tensors in DCP), and everything else (RNG states, optimizer hyper-parameters, the caller's
``extra``) is JSON, tensors included (:func:`encode` / :func:`decode`).
"""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

__all__ = [
    "SafeReader",
    "TensorsOnlyPlanner",
    "decode",
    "encode",
    "restore_rng",
    "rng_state",
    "write_json",
]


def encode(obj: Any) -> Any:
    """JSON-ready copy of ``obj`` (dicts with str keys, lists, numbers, strings, CPU tensors).

    A tensor is stored as base64 of its raw bytes (a rollout batch of an async run, 512 x 8k
    tokens, is ~4/3 of its size, not ~10x as decimal lists).
    """
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {
            "__tensor__": base64.b64encode(raw).decode("ascii"),
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
        }
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise TypeError(f"checkpoint extra: dict keys must be str, got {list(obj)[:4]}")
        return {k: encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [encode(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(
        f"checkpoint extra: cannot store a {type(obj).__name__} without pickling; use dicts, "
        "lists, numbers, strings and tensors"
    )


def decode(obj: Any) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            dtype, data = getattr(torch, obj["dtype"]), obj["__tensor__"]
            if isinstance(data, list):  # the first format: decimal lists
                return torch.tensor(data, dtype=dtype).reshape(obj["shape"])
            raw = bytearray(base64.b64decode(data))
            flat = (
                torch.frombuffer(raw, dtype=torch.uint8)
                if raw
                else torch.empty(0, dtype=torch.uint8)
            )
            return flat.view(dtype).reshape(obj["shape"]).clone()
        return {k: decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode(v) for v in obj]
    return obj


def rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return encode(state)


def restore_rng(state: dict[str, Any]) -> None:
    state = decode(state)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` allowing only DCP's metadata classes and plain torch values."""

    MODULES = ("torch.distributed.checkpoint.metadata",)
    NAMES = {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str):
        if module in self.MODULES or (module, name) in self.NAMES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"checkpoint .metadata refers to {module}.{name}, which is not a DCP metadata class; "
            "refusing to load it (it could run code)"
        )


class SafeReader(FileSystemReader):
    """DCP's file reader, except that ``.metadata`` goes through :class:`_MetadataUnpickler`
    (``FileSystemReader.read_metadata`` uses a plain ``pickle.load``)."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        with open(Path(str(self.path)) / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class TensorsOnlyPlanner(DefaultLoadPlanner):
    """DCP's planner, refusing pickled (non-tensor) items: ``DefaultLoadPlanner.load_bytes``
    uses ``torch.load(weights_only=False)``. Our checkpoints store only tensors in DCP."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        raise ValueError(
            f"checkpoint item {read_item.dest_index.fqn!r} is a pickled object, not a tensor; "
            "refusing to unpickle it"
        )
