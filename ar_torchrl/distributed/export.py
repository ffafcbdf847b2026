"""The end of a run: the trained policy (and a separate critic) written as HF directories by rank 0.

Every rank takes part in gathering the full tensors (:class:`~ar_torchrl.distributed.weights.
FullTensorStream`, one tensor at a time, moved to CPU on rank 0 as it arrives: at most one full
tensor beyond the CPU copy exists on the device); rank 0 writes them with
:func:`~ar_torchrl.models.export.export_policy` and :func:`~ar_torchrl.models.export.export_critic`.
A plain (unsharded) model in one process goes through the same path. If rank 0 fails to write,
every rank raises (no rank is left waiting in a collective).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from ar_torchrl.distributed.context import DistContext
from ar_torchrl.distributed.weights import FullTensorStream
from ar_torchrl.models.export import export_critic, export_policy
from ar_torchrl.modules import LMActorCritic, LMCritic

__all__ = ["export_trained", "gather_full_state"]

logger = logging.getLogger(__name__)


def _full(tensor: Tensor) -> Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()


def gather_full_state(
    model: nn.Module, ctx: DistContext, *, value_head: bool = False
) -> dict[str, Tensor]:
    """Every rank: the full tensors of ``model`` gathered in the same order; rank 0 gets
    ``{hf_name: CPU tensor}`` (the policy tensors, plus ``value_head.*`` when ``value_head``),
    the other ranks ``{}``.

    Example:
        >>> from ar_torchrl.models.tiny import build_tiny_qwen3
        >>> from ar_torchrl.modules import attach_value_head
        >>> model = attach_value_head(build_tiny_qwen3(99))
        >>> state = gather_full_state(model, DistContext(), value_head=True)
        >>> len(state), "value_head.bias" in state, state["lm_head.weight"].device.type
        (27, True, 'cpu')
    """
    model = model.model if isinstance(model, (LMActorCritic, LMCritic)) else model
    out = {name: t.cpu() for name, t in FullTensorStream(model, keep=ctx.is_main)}
    head = getattr(model, "value_head", None)
    if value_head and head is not None:
        for name, tensor in head.state_dict().items():  # the same order on every rank
            full = _full(tensor)
            if ctx.is_main:
                out[f"value_head.{name}"] = full.cpu()
    return out if ctx.is_main else {}


def export_trained(
    ctx: DistContext,
    out_dir: str | Path,
    *,
    policy: nn.Module,
    tokenizer=None,
    critic: nn.Module | None = None,
) -> dict[str, Path]:
    """Every rank: write ``out_dir/policy/`` (HF, safetensors, tokenizer, no ``value_head.*``) and,
    with a separate ``critic``, ``out_dir/critic/`` (backbone + ``value_head.safetensors``).

    Args:
        ctx: this process's :class:`DistContext` (``DistContext()`` for one plain process).
        out_dir: where ``policy/`` and ``critic/`` go (the run directory).
        policy: the trained policy (its HF model or the :class:`~ar_torchrl.modules.LMActorCritic`).
        tokenizer: saved with each (rank 0's; ``None`` elsewhere is fine).
        critic: the separate critic (:class:`~ar_torchrl.modules.LMCritic` or its HF model).

    Returns:
        rank 0: ``{"policy": path, "critic": path}`` (what was written); other ranks: ``{}``.

    Raises:
        RuntimeError: on every rank when rank 0 failed to write (rank 0 re-raises its own error).

    Example:
        >>> import tempfile
        >>> from ar_torchrl.models.tiny import build_tiny_qwen3
        >>> out = export_trained(DistContext(), tempfile.mkdtemp(), policy=build_tiny_qwen3(99))
        >>> sorted(out), out["policy"].name
        (['policy'], 'policy')
    """
    out_dir, written, error = Path(out_dir), {}, None
    jobs = [("policy", policy, export_policy)]
    if critic is not None:
        jobs.append(("critic", critic, export_critic))
    for name, model, write in jobs:
        state = gather_full_state(model, ctx, value_head=name == "critic")
        if ctx.is_main and error is None:
            hf = model.model if isinstance(model, (LMActorCritic, LMCritic)) else model
            try:
                written[name] = write(hf, out_dir / name, tokenizer, tensors=state.items())
            except Exception as err:  # noqa: BLE001 - re-raised below, after the other ranks
                error = err
        del state
    failed = ctx.all_reduce(torch.tensor([float(error is not None)]), op="max").item()
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"export_trained: rank 0 failed to write the export under {out_dir}")
    return written
