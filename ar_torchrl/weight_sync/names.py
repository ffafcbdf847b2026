"""The tensors a rollout engine loads: HF-named parameters and persistent buffers, no value head.

:func:`is_policy_tensor` is the one place that decides what is train-only (``value_head.*``):
:func:`policy_only`, :func:`named_policy_tensors`, the senders and the sharded loader all ask it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = [
    "VALUE_HEAD_PREFIX",
    "as_named_tensors",
    "is_policy_tensor",
    "named_policy_tensors",
    "policy_only",
]

logger = logging.getLogger(__name__)

VALUE_HEAD_PREFIX = "value_head."


def is_policy_tensor(name: str) -> bool:
    """Whether the rollout engine loads tensor ``name`` (everything but the train-only value head).

    Example:
        >>> is_policy_tensor("model.norm.weight"), is_policy_tensor("value_head.bias")
        (True, False)
    """
    return not name.startswith(VALUE_HEAD_PREFIX)


def policy_only(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the pairs lazily, dropping the train-only ones (``value_head.*``; logged at debug level).

    Example:
        >>> pairs = [("a.weight", torch.ones(2)), ("value_head.weight", torch.ones(1, 2))]
        >>> [n for n, _ in policy_only(pairs)]
        ['a.weight']
    """
    for name, tensor in named_tensors:
        if not is_policy_tensor(name):
            logger.debug("weight sync: dropping train-only tensor %s", name)
            continue
        yield name, tensor


def named_policy_tensors(
    model: nn.Module, *, detach: bool = True, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor of the policy the rollout engine loads.

    These are exactly the model's ``state_dict`` entries (parameters and persistent buffers, with
    the HF checkpoint names) minus ``value_head.*``, which is train-only. Tied weights appear once
    per name, as in ``state_dict``. Tensors are detached views, not copies, unless ``dtype`` asks
    for a conversion: then each floating-point tensor is converted on the fly, one at a time (the
    rollout engine's dtype, e.g. bf16 for an fp32 master copy); integer buffers are left alone.

    Args:
        model: an HF causal LM, optionally with an attached value head (DDP/FSDP ``module.``
            prefixes are not stripped: unwrap the model first).
        detach: return detached tensors (default).
        dtype: convert floating-point tensors to this dtype as they are yielded.

    Example:
        >>> from ar_torchrl.models.tiny import build_tiny_qwen3
        >>> from ar_torchrl.modules import attach_value_head
        >>> model = attach_value_head(build_tiny_qwen3(99))
        >>> names = [n for n, _ in named_policy_tensors(model)]
        >>> any(n.startswith("value_head.") for n in names), "model.embed_tokens.weight" in names
        (False, True)
        >>> {t.dtype for _, t in named_policy_tensors(model, dtype=torch.bfloat16)}
        {torch.bfloat16}
    """
    for name, tensor in policy_only(model.state_dict(keep_vars=not detach).items()):
        tensor = tensor.detach() if detach else tensor
        if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        yield name, tensor


def as_named_tensors(
    source: nn.Module | Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    *,
    dtype: torch.dtype | None = None,
    where: str = "weight sync",
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` pairs of a model (:func:`named_policy_tensors`) or of given weights
    (pairs or a mapping, consumed lazily), floating-point tensors converted to ``dtype`` on the fly.

    Raises:
        TypeError: ``source`` is none of these, or an FSDP-sharded model (its parameters are shards:
            gather them with :func:`ar_torchrl.distributed.push_weights`).

    Example:
        >>> pairs = as_named_tensors({"w": torch.ones(2), "step": torch.tensor(3)}, dtype=torch.bfloat16)
        >>> [(n, t.dtype) for n, t in pairs]
        [('w', torch.bfloat16), ('step', torch.int64)]
    """
    if isinstance(source, nn.Module):
        if any(isinstance(p, DTensor) for p in source.parameters()):
            raise TypeError(
                f"{where}: the policy is FSDP-sharded; push it from every rank with "
                "ar_torchrl.distributed.push_weights(model, ctx, collector.update_policy_weights_)"
            )
        return named_policy_tensors(source, dtype=dtype)
    if isinstance(source, Mapping):
        source = source.items()
    if isinstance(source, (str, bytes, torch.Tensor)) or not isinstance(source, Iterable):
        raise TypeError(
            f"{where}: pass the trainer's nn.Module, (name, tensor) pairs or a name -> tensor "
            f"mapping, got {type(source).__name__}"
        )
    return (
        (n, t.to(dtype) if dtype is not None and t.is_floating_point() else t) for n, t in source
    )
