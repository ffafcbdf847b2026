"""Concatenate token trajectories of different widths into one ``[sum B_i, max L_i]`` batch.

Each batch of docs/design.md section 1 has its own width ``L_i = P_i + R_i``: prompts left-padded
to the batch's longest prompt ``P_i``, responses right-padded after column ``P_i``. Batches from
different iterations (a replay buffer holding several of them) cannot be stacked as they are:
TorchRL's ``LazyTensorStorage`` refuses a second width (``indexed destination TensorDict batch
size ... differs``) and ``LazyStackStorage`` samples a ragged lazy stack that the micro-batch plan,
the old-log-prob pass and the loss cannot stack. :func:`pad_trajectories` re-pads each batch to the common
layout: prompts padded on the left to the widest prompt part, responses on the right to the widest
response part, so every row's response starts at the same column again. It is also the
``collate_fn`` of a ``ReplayBuffer(storage=LazyStackStorage(...))``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase
from tensordict.utils import NestedKey, is_non_tensor

__all__ = ["ROW_KEYS", "pad_trajectories"]

#: Keys that hold one value per row, broadcast along ``L``: padding repeats the row's value.
ROW_KEYS: tuple[NestedKey, ...] = ("prompt_id", "policy_version")

_OWNER = "pad_trajectories"


def _as_batches(trajectories) -> list[TensorDictBase]:
    """The input as ``[B_i, L_i]`` TensorDicts (a lazy stack of rows counts one batch per row)."""
    if isinstance(trajectories, LazyStackedTensorDict) and trajectories.stack_dim == 0:
        trajectories = trajectories.tensordicts
    elif isinstance(trajectories, TensorDictBase):
        trajectories = [trajectories]
    if not isinstance(trajectories, Sequence) or not trajectories:
        raise ValueError(
            f"{_OWNER}: pass a non-empty list of [B, L] token trajectories (or a ReplayBuffer "
            f"sample of them), got {type(trajectories).__name__}"
            + (" of length 0" if isinstance(trajectories, Sequence) else "")
        )
    batches = []
    for i, td in enumerate(trajectories):
        if not isinstance(td, TensorDictBase) or td.batch_dims not in (1, 2):
            got = tuple(td.batch_size) if isinstance(td, TensorDictBase) else type(td).__name__
            raise ValueError(
                f"{_OWNER}: trajectory {i} must be a [B, L] (or one [L] row) TensorDict, got {got}"
            )
        batches.append(td.unsqueeze(0) if td.batch_dims == 1 else td)
    return batches


def _monotone(mask: torch.Tensor, increasing: bool) -> torch.Tensor:
    """Rows of a bool ``[B, W]`` mask that are ``[False*, True*]`` (``increasing``) or ``[True*, False*]``."""
    step = mask[:, 1:].int() - mask[:, :-1].int()
    return (step >= 0).all(-1) if increasing else (step <= 0).all(-1)


def _prompt_width(td: TensorDictBase, i: int, keys: tuple[NestedKey, NestedKey]) -> int:
    """``P_i``, the column where every row's response starts (first trained column), after checking
    that prompts are left-padded (right-aligned at ``P_i``) and responses right-padded."""
    attention, loss_mask = (td.get(k, None) for k in keys)
    for key, mask in zip(keys, (attention, loss_mask)):
        if mask is None or mask.dtype != torch.bool or mask.shape != td.batch_size:
            got = "missing" if mask is None else f"{mask.dtype} {tuple(mask.shape)}"
            raise ValueError(
                f"{_OWNER}: trajectory {i} needs {key!r} as a bool [B, L] = "
                f"{tuple(td.batch_size)} mask (docs/design.md section 1), got {got}"
            )
    trained = loss_mask.any(0).nonzero()
    if trained.numel() == 0:
        raise ValueError(
            f"{_OWNER}: trajectory {i} has no trained token ({keys[1]!r} all False): the "
            "prompt/response boundary cannot be found; drop it before padding"
        )
    width = int(trained[0])
    left = _monotone(attention[:, :width], increasing=True)
    right = _monotone(attention[:, width:], increasing=False)
    bad = (~(left & right)).nonzero()
    if bad.numel():
        raise ValueError(
            f"{_OWNER}: trajectory {i}, row {int(bad[0])}: {keys[0]!r} is not a left-padded prompt "
            f"ending at column {width} (the first trained column) followed by a right-padded "
            "response; build trajectories with completions_to_trajectory or TokenTrajectory"
        )
    return width


def _pad_value(batches, tokens_key, attention_key, pad_token_id) -> int | None:
    """The pad id: ``pad_token_id``, else the one id found at every padded position."""
    if pad_token_id is not None:
        return int(pad_token_id)
    found = set()
    for td in batches:
        found.update(td.get(tokens_key)[~td.get(attention_key)].unique().tolist())
    if len(found) > 1:
        raise ValueError(
            f"{_OWNER}: the inputs use several ids at padded positions of {tokens_key!r} "
            f"({sorted(found)}); pass pad_token_id="
        )
    return found.pop() if found else None


def _leaf_keys(batches: list[TensorDictBase]) -> list[NestedKey]:
    keys = list(batches[0].keys(include_nested=True, leaves_only=True))
    for i, td in enumerate(batches):
        other = set(td.keys(include_nested=True, leaves_only=True))
        if other != set(keys):
            diff = sorted(map(str, other.symmetric_difference(keys)))
            raise ValueError(
                f"{_OWNER}: trajectory {i} has different keys than trajectory 0 (differing: "
                f"{diff}); every trajectory must carry the same keys"
            )
        for key in keys:
            if is_non_tensor(td.get(key)):
                raise TypeError(
                    f"{_OWNER}: trajectory {i} holds non-tensor data at {key!r}; only tensors can "
                    "be padded (exclude it first: td.exclude(key))"
                )
    return keys


def _place(x: torch.Tensor, key, width: int, offset: int, fill, row_key: bool, i: int):
    """``x`` ``[B, L_i, *F]`` written at columns ``[offset, offset + L_i)`` of a ``[B, width, *F]``
    tensor filled with ``fill`` (a row key repeats each row's value instead)."""
    if row_key:
        if not (x == x[:, :1]).all():
            raise ValueError(
                f"{_OWNER}: trajectory {i}: {key!r} is a per-row key (row_keys) but varies along L"
            )
        return x[:, :1].expand(x.shape[0], width, *x.shape[2:]).clone()
    if offset == 0 and x.shape[1] == width:  # already in place: no padding to write (nor a pad id)
        return x
    out = x.new_full((x.shape[0], width, *x.shape[2:]), fill)
    out[:, offset : offset + x.shape[1]] = x
    return out


def pad_trajectories(
    trajectories: Sequence[TensorDictBase] | TensorDictBase,
    *,
    pad_token_id: int | None = None,
    row_keys: Sequence[NestedKey] = ROW_KEYS,
    tokens_key: NestedKey = "tokens",
    attention_mask_key: NestedKey = "attention_mask",
    loss_mask_key: NestedKey = "loss_mask",
    trim: bool = True,
) -> TensorDict:
    """Concatenate ``[B_i, L_i]`` token trajectories into one ``[sum B_i, W]`` batch.

    Each batch's prompt/response boundary ``P_i`` is its first trained column (``loss_mask``);
    its columns move right by ``max P_i - P_i`` so every response starts at ``P = max P_i``, and
    ``W = P + max(L_i - P_i)``. New positions get ``pad_token_id`` in ``tokens``, ``False`` in bool
    entries and 0 elsewhere, except the ``row_keys`` (``prompt_id``, ``policy_version``), which
    repeat each row's value. Every leaf ``[B_i, L_i, *F]`` is handled, ``("next", ...)`` included.
    With ``trim``, columns that are padding in every row (``attention_mask`` False) are then cut at
    both ends, so ``W`` is the batch's own width (docs/design.md section 1).

    Also the ``collate_fn`` of a TorchRL ``ReplayBuffer(storage=LazyStackStorage(n))`` holding
    several batches: a sample is a lazy stack of ``[L_j]`` rows, each padded as a batch of one row.

    Args:
        trajectories: ``[B_i, L_i]`` TensorDicts (or ``[L]`` rows), or a lazy stack of them.
        pad_token_id: id written in new padding of ``tokens`` (default: the id the inputs use at
            their padded positions; not needed when nothing has to be padded, e.g. batches of
            one width whose rows have no padding at all).
        row_keys: keys holding one value per row.
        tokens_key, attention_mask_key, loss_mask_key: the layout's keys.
        trim: cut columns that are padding in every row.

    Raises:
        ValueError: empty input, a batch that is not in the layout (no trained token, prompts not
            left-padded, responses not right-padded), differing keys, an ambiguous pad id.

    Example (prompt ``[5]``, response ``[6, 7]``; prompt ``[4, 5, 6]``, response ``[8, 9, 2]``):
        >>> a = TensorDict({"tokens": torch.tensor([[0, 5, 6, 7]]),
        ...                 "attention_mask": torch.tensor([[False, True, True, True]]),
        ...                 "loss_mask": torch.tensor([[False, False, True, True]])}, [1, 4])
        >>> b = TensorDict({"tokens": torch.tensor([[4, 5, 6, 8, 9, 2]]),
        ...                 "attention_mask": torch.ones(1, 6, dtype=torch.bool),
        ...                 "loss_mask": torch.tensor([[False] * 3 + [True] * 3])}, [1, 6])
        >>> out = pad_trajectories([a, b])
        >>> out.batch_size, out["tokens"].tolist()
        (torch.Size([2, 6]), [[0, 0, 5, 6, 7, 0], [4, 5, 6, 8, 9, 2]])
        >>> out["loss_mask"].int().tolist()
        [[0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]]
    """
    batches = _as_batches(trajectories)
    mask_keys = (attention_mask_key, loss_mask_key)
    prompt_widths = [_prompt_width(td, i, mask_keys) for i, td in enumerate(batches)]
    width_p = max(prompt_widths)
    width = width_p + max(td.batch_size[1] - p for td, p in zip(batches, prompt_widths))
    keys = _leaf_keys(batches)
    pad = _pad_value(batches, tokens_key, attention_mask_key, pad_token_id)
    repad = any(width_p - p or width - td.batch_size[1] for td, p in zip(batches, prompt_widths))
    if pad is None and repad:
        raise ValueError(
            f"{_OWNER}: the inputs have no padding to read the pad id from and need new padding; "
            "pass pad_token_id="
        )
    rows = {_norm(k) for k in row_keys}
    out = TensorDict(batch_size=[sum(td.batch_size[0] for td in batches), width])
    for key in keys:
        parts = []
        for i, (td, p) in enumerate(zip(batches, prompt_widths)):
            x = td.get(key)
            fill = (
                pad if _norm(key) == _norm(tokens_key) else (False if x.dtype == torch.bool else 0)
            )
            parts.append(_place(x, key, width, width_p - p, fill, _norm(key) in rows, i))
        _check_parts(key, parts)
        out.set(key, torch.cat(parts))
    return _trim(out, attention_mask_key) if trim else out


def _norm(key: NestedKey) -> tuple[str, ...]:
    return (key,) if isinstance(key, str) else tuple(key)


def _check_parts(key: NestedKey, parts: list[torch.Tensor]) -> None:
    for i, part in enumerate(parts[1:], start=1):
        if part.dtype != parts[0].dtype or part.shape[2:] != parts[0].shape[2:]:
            raise ValueError(
                f"{_OWNER}: {key!r} is {parts[0].dtype} {tuple(parts[0].shape[2:])} per position in "
                f"trajectory 0 but {part.dtype} {tuple(part.shape[2:])} in trajectory {i}"
            )


def _trim(td: TensorDict, attention_mask_key: NestedKey) -> TensorDict:
    """Cut the leading and trailing columns that are padding in every row."""
    used = td.get(attention_mask_key).any(0).nonzero()
    if used.numel() == 0:
        return td
    start, end = int(used[0]), int(used[-1]) + 1
    return td if (start, end) == (0, td.batch_size[1]) else td[:, start:end].clone()
