"""Code-free storage for distributed checkpoints: JSON for states, an allowlist for DCP metadata.

``torch.distributed.checkpoint``'s file reader unpickles ``.metadata`` with a plain ``pickle.load``
and its default planner reads non-tensor items with ``torch.load(weights_only=False)``: either would
run code planted in a run directory. :class:`SafeReader` unpickles ``.metadata`` through an allowlist
of exact ``(module, name)`` pairs (:data:`METADATA_GLOBALS`): the classes DCP pickles there, found by
saving real checkpoints (model only, model + optimizer, FSDP2 in float32 and bfloat16, a separate
critic; ``tests/checkpoint/test_safe_io.py`` pins the list), torch's dtypes by name, and torch's
layout lookup (replaced by our own, which returns layouts only). A dotted name is refused: with pickle
protocol >= 4 ``find_class`` resolves ``"os.system"`` attribute by attribute through any module that
imports ``os``, so an allowlist by module lets a planted ``REDUCE`` call it. :class:`TensorsOnlyPlanner`
refuses pickled items (our checkpoints keep only tensors in DCP), and everything else (RNG states,
optimizer hyper-parameters, the caller's ``extra``) is JSON, tensors included (:func:`encode` /
:func:`decode`).
"""

from __future__ import annotations

import base64
import importlib
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
    "METADATA_GLOBALS",
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
            dtype, data = _dtype(obj["dtype"]), obj["__tensor__"]
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


def _dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) and "." not in name else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"checkpoint: {name!r} is not a torch dtype (damaged or forged JSON)")
    return dtype


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


def _layout(name: str) -> torch.layout:
    """``torch.serialization._get_layout`` (how a ``torch.layout`` pickles), returning layouts only."""
    layouts = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
    if not isinstance(name, str) or name not in layouts:
        raise pickle.UnpicklingError(
            f"checkpoint .metadata names the layout {name!r}, not a layout"
        )
    return layouts[name]


_DCP_META = "torch.distributed.checkpoint.metadata"
#: Every global DCP's ``.metadata`` may name: ``(module, name) -> what it resolves to`` (``None``:
#: the class of that name, checked to be a class when it is resolved).
METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    **{
        (_DCP_META, name): None
        for name in (
            "BytesStorageMetadata",  # a non-tensor item (refused at load, with its name)
            "ChunkStorageMetadata",
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "_MEM_FORMAT_ENCODING",  # TensorProperties' memory format (an Enum)
        )
    },
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): None,
    ("torch", "Size"): None,
    ("pathlib", "PosixPath"): None,  # StorageMeta.checkpoint_id
    ("torch.serialization", "_get_layout"): _layout,
    **{(("torch", n)): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` resolving only the exact pairs of :data:`METADATA_GLOBALS`."""

    def find_class(self, module: str, name: str):
        if (module, name) not in METADATA_GLOBALS:
            raise pickle.UnpicklingError(
                f"checkpoint .metadata refers to {module}.{name}, which is not one of the DCP "
                "metadata classes it may name; refusing to load it (it could run code)"
            )
        value = METADATA_GLOBALS[module, name]
        if value is None:  # a class, looked up by its exact (undotted) name
            value = getattr(importlib.import_module(module), name, None)
            if not isinstance(value, type):
                raise pickle.UnpicklingError(
                    f"checkpoint .metadata refers to {module}.{name}, which is not a class here "
                    f"({type(value).__name__}); refusing to load it"
                )
        return value


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
