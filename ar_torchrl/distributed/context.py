"""Process-group setup from the ``torchrun`` environment and a small context object.

``torchrun --nproc-per-node N script.py`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT``; :func:`init_distributed` reads them, picks the device
(``cuda:LOCAL_RANK`` or ``cpu``) and the backend (NCCL for CUDA tensors plus gloo for CPU tensors;
gloo alone on CPU) and returns a :class:`DistContext`. A plain ``python script.py`` gets world size 1
and, unless asked for one (``process_group=True``, needed for FSDP2 at world size 1), no process group
at all, so single-process runs execute exactly the code they always did.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

__all__ = ["DistContext", "close_distributed", "distributed", "init_distributed"]

logger = logging.getLogger(__name__)

DeviceKind = Literal["auto", "cpu", "cuda"]


@dataclass
class DistContext:
    """Where this process stands: rank, world size, device, and whether a process group exists.

    Example:
        >>> ctx = DistContext()  # a single process without a process group
        >>> ctx.rank, ctx.world_size, ctx.is_main, ctx.is_distributed, ctx.device
        (0, 1, True, False, device(type='cpu'))
        >>> ctx.all_reduce(torch.tensor([2.0, 3.0])).tolist()  # the identity without a group
        [2.0, 3.0]
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None
    owns_group: bool = False
    _mesh: object = field(default=None, repr=False)

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that owns the collector, logs and pushes weights."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        """A process group exists (collectives run; possibly at world size 1)."""
        return self.backend is not None

    @property
    def mesh(self):
        """The 1-D ``DeviceMesh`` over all ranks (FSDP2's data-parallel mesh), built once."""
        if not self.is_distributed:
            raise RuntimeError(
                "DistContext.mesh: no process group; call init_distributed(process_group=True) "
                "to use FSDP2 in a single process"
            )
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(self.device.type, (self.world_size,))
        return self._mesh

    def all_reduce(self, tensor: torch.Tensor, op: Literal["sum", "max"] = "sum") -> torch.Tensor:
        """All-reduce ``tensor`` in place over every rank (the identity without a process group)."""
        if self.is_distributed and self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return tensor

    def barrier(self) -> None:
        """Wait for every rank (no-op without a process group)."""
        if self.is_distributed and self.world_size > 1:
            dist.barrier()

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        """``obj`` of rank ``src`` on every rank (a small picklable value made by this program)."""
        if not self.is_distributed or self.world_size == 1:
            return obj
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src)
        return box[0]


def _resolve_device(device: DeviceKind, local_rank: int) -> torch.device:
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(
            f"init_distributed: device must be 'auto', 'cpu' or 'cuda', got {device!r}"
        )
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("init_distributed: device='cuda' but no CUDA device is visible")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None else int(value)


def init_distributed(
    device: DeviceKind = "auto",
    *,
    process_group: bool | None = None,
    backend: str | None = None,
    init_method: str | None = None,
    timeout_s: float | None = None,
) -> DistContext:
    """Join the process group ``torchrun`` describes (or stay a single process) and return a context.

    Args:
        device: ``"cuda"`` (``cuda:LOCAL_RANK``), ``"cpu"``, or ``"auto"`` (CUDA when visible).
        process_group: create a process group. ``None`` (default): only under ``torchrun``
            (``WORLD_SIZE`` > 1). ``True`` at world size 1 makes a one-rank group from an in-memory
            store (FSDP2 needs one).
        backend: default ``"cpu:gloo,cuda:nccl"`` on CUDA (NCCL for GPU tensors, gloo for CPU
            scalars), ``"gloo"`` on CPU.
        init_method: default ``env://`` (``MASTER_ADDR``/``MASTER_PORT``); tests pass ``file://``.
        timeout_s: collective timeout (default: torch's, 10 min on NCCL).

    Example:
        >>> ctx = init_distributed("cpu")  # no torchrun variables: a plain single process
        >>> ctx.world_size, ctx.is_distributed
        (1, False)
    """
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", rank)
    torch_device = _resolve_device(device, local_rank)
    if process_group is None:
        process_group = world_size > 1
    if not process_group:
        if world_size > 1:
            raise ValueError(f"init_distributed: WORLD_SIZE={world_size} needs process_group=True")
        return DistContext(device=torch_device)
    if backend is None:
        backend = "cpu:gloo,cuda:nccl" if torch_device.type == "cuda" else "gloo"
    owns = not dist.is_initialized()
    if owns:
        kwargs = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
        if world_size == 1 and init_method is None:
            kwargs["store"] = dist.HashStore()  # one rank: no rendezvous, no port
        else:
            kwargs["init_method"] = init_method or "env://"
        dist.init_process_group(backend, rank=rank, world_size=world_size, **kwargs)
    ctx = DistContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=torch_device,
        backend=backend,
        owns_group=owns,
    )
    logger.info("rank %d/%d on %s (%s)", ctx.rank, ctx.world_size, ctx.device, backend)
    return ctx


def close_distributed(ctx: DistContext) -> None:
    """Destroy the process group if :func:`init_distributed` created it (idempotent)."""
    if ctx.owns_group and dist.is_initialized():
        dist.destroy_process_group()
    ctx.owns_group, ctx.backend, ctx._mesh = False, None, None


@contextlib.contextmanager
def distributed(device: DeviceKind = "auto", **kwargs) -> Iterator[DistContext]:
    """``with distributed("cpu") as ctx: ...``: :func:`init_distributed`, then a clean teardown.

    Example:
        >>> with distributed("cpu", process_group=True) as ctx:  # a one-rank gloo group
        ...     ctx.is_distributed, ctx.all_reduce(torch.ones(1)).item()
        (True, 1.0)
    """
    ctx = init_distributed(device, **kwargs)
    try:
        yield ctx
    finally:
        close_distributed(ctx)
