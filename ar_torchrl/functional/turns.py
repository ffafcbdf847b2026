"""Turn-level GAE on multi-turn ``[B, L]`` rows: one GAE step per model turn (AReaL's
``gae_timestep_unit: turn``), and the ``turn_id`` checks it rests on."""

from __future__ import annotations

import torch
from torch import Tensor

from ar_torchrl.functional.gae import check_gae_inputs, token_gae
from ar_torchrl.utils.checks import check_number

__all__ = ["count_turns", "turn_gae"]

_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _turn_steps(
    loss_mask: Tensor, turn_id: Tensor, owner: str
) -> tuple[Tensor, Tensor, Tensor, int]:
    """Check ``turn_id`` against ``loss_mask`` and number each row's turns in order.

    Returns ``(step, start, count, max_count)``: ``step`` ``[B, L]`` int64 is the turn's step
    index (``0 .. count_b - 1``, in the order the turns appear) on trained tokens and -1 elsewhere;
    ``start`` ``[B, L]`` bool marks each turn's first trained token; ``count`` ``[B]`` int64 is the
    number of turns of each row and ``max_count`` their maximum. Every check and ``max_count`` come
    from one device sync.
    """
    if turn_id.shape != loss_mask.shape:
        raise ValueError(
            f"{owner}: turn_id has shape {tuple(turn_id.shape)} but loss_mask has shape "
            f"{tuple(loss_mask.shape)}; both must be [B, L]"
        )
    if turn_id.dtype not in _INTEGER_DTYPES:
        raise TypeError(
            f"{owner}: turn_id must be an integer tensor (int64: the turn index on trained tokens, "
            f"-1 elsewhere), got dtype {turn_id.dtype}"
        )
    tid = turn_id.long()
    batch, length = tid.shape
    if batch == 0 or length == 0:
        return tid.clone(), loss_mask.clone(), tid.new_zeros(batch), 0
    trained_id = torch.where(loss_mask, tid, -1)
    # turn of the previous trained token (-1 before the first): the running max, shifted by one
    prev = torch.nn.functional.pad(trained_id.cummax(-1).values[:, :-1], (1, 0), value=-1)
    stray = ~loss_mask & (tid != -1)
    negative = loss_mask & (tid < 0)
    backwards = loss_mask & (tid < prev)
    start = loss_mask & (tid > prev)  # first trained token of each turn
    count = start.sum(-1)
    flags = torch.stack(
        [stray.any().long(), negative.any().long(), backwards.any().long(), count.max()]
    ).tolist()
    if flags[0]:
        row, col = (int(i) for i in stray.nonzero()[0])
        raise ValueError(
            f"{owner}: turn_id is {int(tid[row, col])} at row {row}, position {col}, where loss_mask "
            f"is False ({int(stray.sum())} such tokens); turn_id must be -1 on prompt, "
            "tool/observation and padding tokens and the turn index on trained tokens only"
        )
    if flags[1]:
        row, col = (int(i) for i in negative.nonzero()[0])
        raise ValueError(
            f"{owner}: turn_id is {int(tid[row, col])} at row {row}, position {col}, a trained token "
            "(loss_mask True); trained tokens carry their turn index, >= 0"
        )
    if flags[2]:
        row, col = (int(i) for i in backwards.nonzero()[0])
        raise ValueError(
            f"{owner}: turn_id goes back from {int(prev[row, col])} to {int(tid[row, col])} at row "
            f"{row}, position {col}; turn ids must be non-decreasing along each row's trained "
            "tokens (the turns in the order they were generated)"
        )
    step = torch.where(loss_mask, start.cumsum(-1) - 1, -1)
    return step, start, count, int(flags[3])


def count_turns(loss_mask: Tensor, turn_id: Tensor) -> Tensor:
    """Number of turns of each row: distinct ``turn_id`` values on its trained tokens.

    Args:
        loss_mask: ``[B, L]`` bool.
        turn_id: ``[B, L]`` integer, the turn index on trained tokens, -1 elsewhere.

    Returns:
        ``[B]`` int64.

    Raises:
        ValueError / TypeError: as :func:`turn_gae` for a bad ``turn_id``.

    Example:
        >>> m = torch.tensor([[False, True, False, True, True]])
        >>> count_turns(m, torch.tensor([[-1, 0, -1, 1, 1]])).tolist()
        [2]
    """
    _check_mask_only(loss_mask)
    return _turn_steps(loss_mask, turn_id, "count_turns")[2]


def _check_mask_only(mask: Tensor) -> None:
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor, got dtype {mask.dtype}")
    if mask.ndim != 2:
        raise ValueError(f"loss_mask must be [B, L], got shape {tuple(mask.shape)}")


def turn_gae(
    reward: Tensor,
    value: Tensor,
    loss_mask: Tensor,
    turn_id: Tensor,
    *,
    gamma: float,
    lmbda: float | Tensor,
    critic_lmbda: float | Tensor | None = None,
    bootstrap_value: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Turn-level GAE: one step per turn of each multi-turn row (AReaL's ``gae_timestep_unit: turn``).

    A turn is the set of a row's trained tokens (``loss_mask`` True) sharing one ``turn_id``; turns
    are taken in the order they appear (ids need not be consecutive: gaps consume no step). For the
    turns ``u = 0 .. U - 1`` of a row::

        r_u = sum of reward over the turn's tokens      V_u = value at the turn's first trained token
        delta_u = r_u + gamma * V_{u+1} - V_u ;  A_u = delta_u + gamma * lmbda * A_{u+1}

    with ``V_U = bootstrap_value`` (0 when ``None``: terminal) and ``A_U = 0``. ``A_u`` and the value
    target ``A'_u + V_u`` (``A'`` with ``critic_lmbda``, default ``lmbda``) are broadcast to every
    trained token of turn ``u``; prompt, tool and padding tokens get 0. Since ``value`` is
    ``V(s_t)`` (the state before token ``t``), ``V_u`` is the value of the state in which the turn
    starts: after the previous tool output. This is :func:`token_gae` run over the sequence of
    turns (its closed form, no Python loop over turns or tokens).

    Args:
        reward: ``[B, L]`` per-token reward (outcome on the last trained token, optional per-turn
            rewards on each turn's last trained token); 0 wherever ``loss_mask`` is False.
        value: ``[B, L]`` V(s_t); only the values at each turn's first trained token are read.
        loss_mask: ``[B, L]`` bool, True on trained tokens.
        turn_id: ``[B, L]`` integer: the turn index on trained tokens, -1 on prompt, tool and
            padding tokens, non-decreasing along each row (``build_trajectory`` writes it when
            segments carry a ``turn``).
        gamma: discount per turn in ``[0, 1]``.
        lmbda: GAE lambda in ``[0, 1]``, a float or a per-row ``[B]`` tensor.
        critic_lmbda: lambda for the value target (float or ``[B]``); ``None`` = ``lmbda``.
        bootstrap_value: ``[B]`` value after the last turn (truncated episodes); ``None`` = 0.

    Returns:
        ``(advantage, value_target)``, both ``[B, L]`` in ``reward.dtype`` (computed in float64
        for float64 inputs, else float32).

    Raises:
        ValueError: mismatched shapes, a NaN/inf reward, a non-zero reward on a masked token, a
            ``turn_id`` other than -1 on an untrained token, a negative one on a trained token,
            turn ids that decrease along a row, or hyper-parameters outside ``[0, 1]``.
        TypeError: a non-bool ``loss_mask`` or a non-integer ``turn_id``.

    Example:
        >>> m = torch.tensor([[False, True, True, False, True, True]])  # prompt, turn, tool, turn
        >>> tid = torch.tensor([[-1, 0, 0, -1, 1, 1]])
        >>> r = torch.tensor([[0.0, 0.0, -0.5, 0.0, 0.0, 1.0]])  # tool-error penalty, outcome
        >>> v = torch.tensor([[0.0, 0.25, 9.0, 0.0, 0.5, 9.0]])
        >>> adv, ret = turn_gae(r, v, m, tid, gamma=1.0, lmbda=1.0)
        >>> adv.tolist(), ret.tolist()
        ([[0.0, 0.25, 0.25, 0.0, 0.5, 0.5]], [[0.0, 0.5, 0.5, 0.0, 1.0, 1.0]])
    """
    check_gae_inputs(reward, value, loss_mask, owner="turn_gae")
    check_number("turn_gae", "gamma", gamma, ge=0, le=1)
    step, start, count, turns = _turn_steps(loss_mask, turn_id, "turn_gae")
    batch = reward.shape[0]
    if turns == 0:
        if bootstrap_value is not None and bootstrap_value.shape != (batch,):
            raise ValueError(
                f"bootstrap_value must have shape [B]=({batch},), got {tuple(bootstrap_value.shape)}"
            )
        return torch.zeros_like(reward), torch.zeros_like(reward)
    dtype = torch.float64 if reward.dtype == torch.float64 else torch.float32
    # column of each token in the [B, turns + 1] turn layout; the last column collects the rest
    col = torch.where(loss_mask, step, turns)
    turn_reward = reward.new_zeros(batch, turns + 1, dtype=dtype)
    turn_reward.scatter_add_(1, col, torch.where(loss_mask, reward.to(dtype), 0.0))
    turn_value = reward.new_zeros(batch, turns + 1, dtype=dtype)  # V at each turn's first token
    turn_value.scatter_add_(
        1, torch.where(start, step, turns), torch.where(start, value.to(dtype), 0.0)
    )
    turn_mask = torch.arange(turns, device=reward.device) < count.unsqueeze(-1)
    adv, target = token_gae(
        turn_reward[:, :turns],
        turn_value[:, :turns],
        turn_mask,
        gamma=gamma,
        lmbda=lmbda,
        critic_lmbda=critic_lmbda,
        bootstrap_value=bootstrap_value,
    )
    adv = torch.nn.functional.pad(adv, (0, 1)).gather(1, col)  # untrained tokens read the 0 column
    target = torch.nn.functional.pad(target, (0, 1)).gather(1, col)
    return adv.to(reward.dtype), target.to(reward.dtype)
