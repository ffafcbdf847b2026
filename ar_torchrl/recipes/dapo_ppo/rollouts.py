"""A run's trained batches on disk (``train.save_rollouts=true``), for ``critic.pretrain_from``.

Each iteration's batch, as it was trained on (after the advantages), is one safetensors file
``<run_dir>/rollouts/step_<N>.safetensors``: its tensors only, nested keys joined with ``.``
(``next.reward``), the batch size and step in the file's metadata. What the weights of a later
run recompute is left out (the log-probs, the bootstrap values, the advantages and value targets:
:data:`RECOMPUTED`); the rest stays (tokens, masks, rewards and done flags, the rollout engine's
log-probs, the policy version of each token, prompt ids, turn ids, and ``state_value``, the run's
own critic's values: its ``critic/explained_variance`` can be recomputed from the file); integer
tensors whose values fit are stored as int32 and read back as int64.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tensordict import TensorDict, TensorDictBase

__all__ = ["RECOMPUTED", "ROLLOUTS_DIR", "load_rollout", "rollout_files", "save_rollout"]

#: The sub-directory of a run directory that holds its rollouts.
ROLLOUTS_DIR = "rollouts"

#: Keys a later run recomputes with its own weights (not saved).
RECOMPUTED = frozenset(
    {
        "sample_log_prob",
        "ref_log_prob",
        "next.state_value",
        "advantage",
        "value_target",
    }
)

_NAME = re.compile(r"step_(\d+)\.safetensors")


def save_rollout(run_dir: str | Path, step: int, td: TensorDictBase) -> Path:
    """Write ``td`` (a ``[B, L]`` batch) as ``<run_dir>/rollouts/step_<step>.safetensors`` (tensor
    leaves only, less :data:`RECOMPUTED`); returns the path.

    Example:
        >>> import tempfile
        >>> td = TensorDict({"tokens": torch.ones(2, 3, dtype=torch.long),
        ...                  "next": {"reward": torch.zeros(2, 3, 1)}}, [2, 3])
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     path = save_rollout(tmp, 7, td)
        ...     back = load_rollout(path)
        >>> path.name, back.batch_size, back["next", "reward"].shape
        ('step_7.safetensors', torch.Size([2, 3]), torch.Size([2, 3, 1]))
    """
    if td.batch_dims != 2:
        raise ValueError(
            f"save_rollout: expected a [B, L] batch, got batch_size {tuple(td.batch_size)}"
        )
    flat = td.flatten_keys(".")
    tensors = {
        key: value.detach().cpu().contiguous()
        for key, value in flat.items()
        if isinstance(value, torch.Tensor) and key not in RECOMPUTED
    }
    narrowed = sorted(k for k, v in tensors.items() if v.dtype == torch.int64 and _fits_int32(v))
    for key in narrowed:  # token ids, versions, prompt ids: half the bytes, restored on load
        tensors[key] = tensors[key].to(torch.int32)
    path = Path(run_dir) / ROLLOUTS_DIR / f"step_{int(step)}.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    metadata = {
        "step": str(int(step)),
        "batch_size": json.dumps(list(td.batch_size)),
        "int64": json.dumps(narrowed),
    }
    save_file(tensors, str(tmp), metadata=metadata)
    tmp.replace(path)  # a reader never sees half a file
    return path


def _fits_int32(x: torch.Tensor) -> bool:
    info = torch.iinfo(torch.int32)
    return x.numel() == 0 or (int(x.min()) >= info.min and int(x.max()) <= info.max)


def load_rollout(path: str | Path) -> TensorDict:
    """The batch :func:`save_rollout` wrote to ``path`` (on the CPU)."""
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        if "batch_size" not in metadata:
            raise ValueError(
                f"load_rollout: {path} has no batch_size in its metadata: not a file that "
                "train.save_rollouts wrote"
            )
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    for key in json.loads(metadata.get("int64", "[]")):
        tensors[key] = tensors[key].to(torch.int64)
    batch = json.loads(metadata["batch_size"])
    return TensorDict(tensors, batch_size=batch).unflatten_keys(".")


def rollout_files(run_dir: str | Path, *, key: str = "critic.pretrain_from") -> list[Path]:
    """The rollout files of a run directory, in step order.

    Raises:
        FileNotFoundError: ``run_dir`` has none (named with ``key``, and how to get them).
    """
    folder = Path(run_dir) / ROLLOUTS_DIR
    found = sorted(
        (int(m.group(1)), p)
        for p in (folder.iterdir() if folder.is_dir() else ())
        if (m := _NAME.fullmatch(p.name))
    )
    if not found:
        raise FileNotFoundError(
            f"{key}={str(run_dir)!r}: no saved rollouts in {folder} (run the earlier run with "
            "train.save_rollouts=true)"
        )
    return [p for _, p in found]
