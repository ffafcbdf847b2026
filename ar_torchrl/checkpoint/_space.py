"""Disk-full errors that say so: which disk (the checkpoint directory), how many bytes the checkpoint
needs and how many were free, instead of what the writer happened to hit first (``torch.save``'s
zip writer says ``unexpected pos 704 vs 598``; DCP wraps it in a ``CheckpointException``)."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["free_bytes", "is_disk_full", "no_space_error", "tensor_bytes"]

_FULL = (errno.ENOSPC, errno.EDQUOT)


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in ``obj`` (nested dicts, lists, tuples), at their full (global) size:
    a DTensor counts as the whole tensor, whichever rank holds which shard."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def free_bytes(directory: str | os.PathLike) -> int | None:
    """Free bytes on the disk holding ``directory`` (``None`` when it cannot be asked)."""
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def _chain(err: BaseException) -> Iterator[BaseException]:
    """``err``, its causes and contexts, and the per-rank failures a DCP ``CheckpointException``
    carries (``failures: {rank: (exception, traceback)}``)."""
    seen: set[int] = set()
    todo = [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        for failure in (getattr(e, "failures", None) or {}).values():
            todo.append(failure[0] if isinstance(failure, tuple) else failure)


def is_disk_full(err: BaseException) -> bool:
    """Whether ``err`` (or what caused it) is ``ENOSPC`` / ``EDQUOT``."""
    return any(isinstance(e, OSError) and e.errno in _FULL for e in _chain(err))


def no_space_error(
    err: BaseException, directory: Path, *, needed: int, free: int | None, what: str
) -> OSError | None:
    """An ``OSError(ENOSPC)`` naming the disk and the bytes when ``err`` is a disk-full failure
    (``ENOSPC``/``EDQUOT`` anywhere in it, or less space was free than the checkpoint needs), else
    ``None``. ``free``: the free bytes measured when the save started.

    Example:
        >>> full = OSError(errno.ENOSPC, "No space left on device")
        >>> str(no_space_error(full, Path("/ckpts"), needed=2_000_000, free=640, what="step_4"))
        '[Errno 28] step_4: no space left on the disk holding /ckpts: the checkpoint needs about 2.0 MB (2000000 bytes) of tensors, 640 bytes were free when the save started; free space there or keep fewer checkpoints'
    """
    if isinstance(err, (KeyboardInterrupt, SystemExit, GeneratorExit)):
        return None  # (DCP's CheckpointException is a BaseException: it is not excluded)
    if not (is_disk_full(err) or (free is not None and free < needed)):
        return None
    had = "an unknown number of bytes" if free is None else _amount(free)
    return OSError(
        errno.ENOSPC,
        f"{what}: no space left on the disk holding {directory}: the checkpoint needs about "
        f"{_amount(needed)} of tensors, {had} were free when the save started; free space there "
        "or keep fewer checkpoints",
    )


def _amount(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit} ({n} bytes)"
    return f"{n} bytes"
