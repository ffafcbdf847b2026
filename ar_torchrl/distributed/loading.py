"""Large checkpoints: build on the meta device, shard, then read each rank's rows from safetensors.

No rank ever holds a full fp32 copy of the model: :func:`build_meta_model` creates the parameters on
the meta device (buffers such as rotary frequencies are computed normally),
:func:`~ar_torchrl.distributed.shard_actor_critic` shards them (still meta), and
:func:`load_pretrained_weights` allocates each rank's fp32 shards and reads, tensor by tensor, only
the rows of its shard from the HF ``*.safetensors`` files (``safe_open(...).get_slice``), upcasting
exactly. The value head is zero after a base checkpoint and loaded from ``value_head.safetensors``
when the directory has one (a policy saved by :func:`~ar_torchrl.modules.save_policy`); its
confidence features (``value_head.confidence``), when attached and not in that file, start from
:meth:`~ar_torchrl.modules.ConfidenceFeatures.initial_state` (the same on every rank).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from ar_torchrl.modules import LMActorCritic, LMCritic, attach_value_head
from ar_torchrl.modules.value_head import VALUE_HEAD_FILE, ConfidenceFeatures, confidence_of
from ar_torchrl.weight_sync.names import is_policy_tensor

__all__ = ["build_meta_model", "load_pretrained_weights", "parameters_on_meta"]

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device; buffers are built normally.

    (``accelerate.init_empty_weights(include_buffers=False)`` does the same.) The patch of
    ``nn.Module.register_parameter`` is process-wide while the block runs: build nothing else
    concurrently.

    Example:
        >>> with parameters_on_meta():
        ...     bn = nn.BatchNorm1d(3)
        >>> bn.weight.device.type, bn.running_mean.device.type
        ('meta', 'cpu')
    """
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def build_meta_model(
    path: str | Path, *, attn_implementation: str | None = None, value_head: bool = True
) -> nn.Module:
    """An HF causal LM from ``path/config.json`` with float32 parameters on meta and (unless
    ``value_head=False``) a value head.

    Example:
        >>> import tempfile
        >>> from ar_torchrl.models.tiny import save_tiny_model
        >>> model = build_meta_model(save_tiny_model(tempfile.mkdtemp()))
        >>> model.lm_head.weight.device.type, model.value_head.weight.device.type
        ('meta', 'meta')
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kwargs)
        if value_head:
            attach_value_head(model)
    return model.eval()


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"load_pretrained_weights: no model.safetensors(.index.json) in {str(path)!r}; "
        "save the model with save_pretrained(..., safe_serialization=True)"
    )


def _local_rows(target: torch.Tensor, shape: list[int]) -> tuple[torch.Tensor, int]:
    """The tensor to write (this rank's shard) and its first row in the full tensor."""
    if not isinstance(target, DTensor):
        return target, 0
    if target.device_mesh.ndim != 1 or tuple(target.placements) != (Shard(0),):
        raise NotImplementedError(
            f"load_pretrained_weights: only 1-D Shard(0) sharding (FSDP2's default) is supported, "
            f"got {target.placements} on a {target.device_mesh.ndim}-D mesh"
        )
    chunk = math.ceil(shape[0] / target.device_mesh.size())
    return target.to_local(), chunk * target.device_mesh.get_local_rank()


@torch.no_grad()
def _copy(target: torch.Tensor, reader, name: str) -> None:
    """Copy ``target``'s local rows from ``reader``: a safetensors slice or a full tensor."""
    shape = list(reader.shape if isinstance(reader, torch.Tensor) else reader.get_shape())
    if list(target.shape) != shape:
        raise ValueError(
            f"load_pretrained_weights: {name} has shape {shape} in the checkpoint but "
            f"{list(target.shape)} in the model (another model config?)"
        )
    local, first = _local_rows(target, shape)
    if local.numel() == 0:
        return
    rows = reader[first : first + local.shape[0]] if shape else reader[:]
    local.copy_(rows.reshape(local.shape))


def _tied_parameters(root: nn.Module) -> list[tuple[tuple[nn.Module, str], tuple[nn.Module, str]]]:
    """``((module, name), (first module, name))`` for every repeated use of a parameter, in FSDP2's
    traversal order (the first use is the one FSDP2 tracks)."""
    first: dict[int, tuple[nn.Module, str]] = {}
    repeats = []
    for _, module in root.named_modules(remove_duplicate=False):
        for name, param in module._parameters.items():
            if param is None:
                continue
            if id(param) in first:
                repeats.append(((module, name), first[id(param)]))
            else:
                first[id(param)] = (module, name)
    return repeats


def _materialize(root: nn.Module, device: torch.device) -> None:
    """Allocate meta parameters on ``device`` (uninitialised), keeping the real buffers' values."""
    if not any(p.is_meta for p in root.parameters()):
        return
    if any(isinstance(p, DTensor) for p in root.parameters()) and not isinstance(root, FSDPModule):
        raise ValueError(
            "load_pretrained_weights: the model is sharded; pass the FSDP root (the LMActorCritic "
            f"given to shard_actor_critic), not {type(root).__name__}"
        )
    buffers = {n: b.detach().clone() for n, b in root.named_buffers()}
    meta = sorted(n for n, b in buffers.items() if b.is_meta)
    if meta:
        raise ValueError(
            f"load_pretrained_weights: buffers {meta[:4]} are on the meta device and cannot be "
            "recomputed; build the model with build_meta_model (parameters only on meta)"
        )
    tied = _tied_parameters(root)
    root.to_empty(device=device)  # FSDP2 re-registers its padded shards here
    for (module, name), (first, first_name) in tied:  # to_empty makes one new tensor per module
        module._parameters[name] = first._parameters[first_name]
    with torch.no_grad():
        for name, value in buffers.items():
            root.get_buffer(name).copy_(value)


def _load_value_head(model: nn.Module, path: Path) -> str:
    if not isinstance(getattr(model, "value_head", None), nn.Module):
        return "none"
    head = dict(model.value_head.named_parameters())
    # confidence features (value_head.confidence) a file lacks start fresh, as attached eagerly
    fresh = [n for n in head if n.startswith(CONFIDENCE_PREFIX)]
    file = path / VALUE_HEAD_FILE
    if not file.is_file():
        with torch.no_grad():
            for name, param in head.items():
                if name not in fresh:
                    (param.to_local() if isinstance(param, DTensor) else param).zero_()
        _fresh_confidence(model, head, fresh)
        return "zero"
    buffers = dict(model.value_head.named_buffers())  # PopArt's statistics, when both have them
    with safe_open(str(file), framework="pt", device="cpu") as f:
        keys = set(f.keys())
        if any(f"value_head.{n}" in keys for n in fresh):
            fresh = []  # the file has them: all are loaded (a missing one is named below)
        for name, param in head.items():
            key = f"value_head.{name}"
            if name in fresh:
                continue
            if key not in keys:
                raise KeyError(
                    f"load_pretrained_weights: {file} lacks {key}; it has {sorted(keys)}"
                )
            _copy(param, f.get_slice(key), key)
        for name, buffer in buffers.items():
            if f"value_head.{name}" in keys:
                with torch.no_grad():
                    buffer.copy_(f.get_tensor(f"value_head.{name}"))
    _fresh_confidence(model, head, fresh)
    return str(file)


CONFIDENCE_PREFIX = "confidence."


def _fresh_confidence(model: nn.Module, head: dict[str, nn.Parameter], names: list[str]) -> None:
    """Write :meth:`ConfidenceFeatures.initial_state` into the value head's confidence parameters
    ``names`` (keys of ``head``, the head's named parameters; their local shards): a meta-built
    model has no values there, and zeros would leave the MLP without a gradient."""
    feats = confidence_of(model)
    if not names or feats is None:
        return
    state = ConfidenceFeatures.initial_state(feats.net[0].out_features)
    with torch.no_grad():
        for name in names:
            _copy(head[name], state[name[len(CONFIDENCE_PREFIX) :]], f"value_head.{name}")


def load_pretrained_weights(
    module: nn.Module, path: str | Path, *, device: torch.device | str = "cpu"
) -> dict[str, object]:
    """Fill a (meta, FSDP-sharded or plain) model from the HF safetensors checkpoint at ``path``.

    Args:
        module: the :class:`LMActorCritic` or :class:`LMCritic` (the FSDP root) or the HF model.
        path: an HF directory (``model.safetensors`` or sharded with an index).
        device: where meta parameters are allocated (``ctx.device``).

    Returns:
        ``{"tensors": number loaded, "unexpected": checkpoint keys the model lacks,
        "value_head": "zero", the head file, or "none" (a model without a value head)}``.

    Raises:
        KeyError: a model parameter (other than the value head) is in no checkpoint file.
        ValueError: a shape differs between the checkpoint and the model.
    """
    path = Path(path)
    model = module.model if isinstance(module, (LMActorCritic, LMCritic)) else module
    _materialize(module, torch.device(device))
    targets = dict(model.named_parameters(remove_duplicate=False))
    targets.update(model.named_buffers())
    loaded, unexpected = set(), []
    for file in _weight_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                if key not in targets:
                    unexpected.append(key)
                    continue
                _copy(targets[key], f.get_slice(key), key)
                loaded.add(id(targets[key]))
    missing = sorted(
        n for n, p in model.named_parameters() if id(p) not in loaded and is_policy_tensor(n)
    )
    if missing:
        raise KeyError(
            f"load_pretrained_weights: {str(path)!r} has no {missing[:8]} "
            f"({len(missing)} parameters missing)"
        )
    if unexpected:
        logger.warning(
            "load_pretrained_weights: ignored %d checkpoint tensors the model lacks: %s",
            len(unexpected),
            unexpected[:8],
        )
    return {
        "tensors": len(loaded),
        "unexpected": unexpected,
        "value_head": _load_value_head(model, path),
    }
