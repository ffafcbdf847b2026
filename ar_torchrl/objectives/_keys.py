"""Key helpers shared by the TensorDict modules: a missing key and a ``[B, L, 1]`` feature, named."""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey

__all__ = [
    "MissingKeyError",
    "policy_tokens",
    "require_key",
    "squeeze_feature",
    "stored_advantages",
]


class MissingKeyError(KeyError):
    """A ``KeyError`` whose message prints as written (``KeyError`` would quote and escape it)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def require_key(td: TensorDictBase, key: NestedKey, owner: str, hint: str) -> torch.Tensor:
    """``td.get(key)`` with an error that names the key, what is present and how to fix it."""
    value = td.get(key, None)
    if value is None:
        present = sorted(str(k) for k in td.keys(include_nested=True, leaves_only=True))
        raise MissingKeyError(
            f"{owner}: missing key {key!r} ({hint}); the TensorDict holds {present}"
        )
    return value


def squeeze_feature(
    x: torch.Tensor, key: NestedKey, batch_shape: torch.Size, owner: str
) -> torch.Tensor:
    """``[B, L, 1]`` or ``[B, L]`` -> ``[B, L]``; anything else is an error naming ``key``."""
    if x.shape == batch_shape:
        return x
    if x.shape == (*batch_shape, 1):
        return x.squeeze(-1)
    raise ValueError(
        f"{owner}: {key!r} has shape {tuple(x.shape)}; expected {tuple(batch_shape)} or "
        f"{(*tuple(batch_shape), 1)} (the token-trajectory layout [B, L])"
    )


def policy_tokens(
    td: TensorDictBase, key: NestedKey, mask: torch.Tensor, owner: str
) -> torch.Tensor:
    """``mask & td[key]`` when the batch has the optional ``policy_mask`` entry ``key`` (bool
    ``[B, L]`` or ``[B, L, 1]``: rows kept for the critic only), else ``mask``."""
    policy = td.get(key, None)
    if policy is None:
        return mask
    policy = squeeze_feature(policy, key, td.batch_size, owner)
    if policy.dtype != torch.bool:
        raise TypeError(f"{owner}: {key!r} must be bool, got {policy.dtype}")
    return mask & policy


def stored_advantages(td: TensorDictBase, key: NestedKey, owner: str, why: str) -> TensorDictBase:
    """The ``inv`` side of a batch-level advantage transform registered on a replay buffer with
    ``rb.append_transform(<owner>(), invert=True)``: a sample keeps the advantages computed when the
    batch was written (``key`` present). Reached without them (registered without
    ``invert=True``), it refuses, saying ``why`` computing on a sample would be wrong."""
    if td.get(key, None) is not None:
        return td
    raise RuntimeError(
        f"{owner}: reached through inv() on a batch without {key!r}. On a replay buffer, register "
        f"it as rb.append_transform({owner}(), invert=True) so that {why}."
    )
