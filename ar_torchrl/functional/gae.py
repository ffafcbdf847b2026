"""Token-level GAE on ``[B, L]`` rows (prompt + response), its checks and VAPO's length-adaptive lambda."""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from ar_torchrl.functional._shapes import _check_mask, _check_same_shape, check_finite_reward
from ar_torchrl.utils.checks import check_number

__all__ = ["check_gae_inputs", "length_adaptive_lmbda", "token_gae"]


# ----------------------------------------------------------------------------- GAE
def _as_row_coeff(
    x: float | Tensor, name: str, batch: int, dtype: torch.dtype, device: torch.device
) -> float | Tensor:
    """A hyper-parameter in ``[0, 1]``: a float stays a float (checked on the host: no device
    sync), a ``[B]`` tensor becomes ``[B, 1]`` in ``dtype``."""
    if not torch.is_tensor(x) or x.ndim == 0:
        value = float(x)
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")
        return value
    if x.shape != (batch,):
        raise ValueError(
            f"{name} must be a float or a [B]={batch} tensor, got shape {tuple(x.shape)}"
        )
    t = x.to(dtype=torch.float64, device=device)
    if ((t < 0) | (t > 1)).any() or not torch.isfinite(t).all():
        raise ValueError(f"{name} must be in [0, 1], got {t.tolist() if t.numel() < 9 else t}")
    return t.to(dtype).reshape(batch, 1)


def check_gae_inputs(reward: Tensor, value: Tensor, mask: Tensor, owner: str = "token_gae") -> bool:
    """Check GAE's inputs (``reward``, ``value``: float ``[B, L]``; ``mask``: bool ``[B, L]``):
    shapes, finite rewards, no reward on an untrained token. Returns whether every row's trained
    tokens form one run (the usual prompt + response layout; multi-turn rows with tool spans do
    not). Both answers come from one device sync. ``owner`` names the caller in the messages.

    Example:
        >>> m = torch.tensor([[False, True, True], [True, False, True]])
        >>> check_gae_inputs(torch.zeros(2, 3), torch.zeros(2, 3), m)  # row 1 has a gap
        False
        >>> check_gae_inputs(torch.tensor([[1.0, 0, 0]]), torch.zeros(1, 3), m[:1])
        Traceback (most recent call last):
        ...
        ValueError: token_gae: 1 non-zero reward(s) on masked tokens (first at row 0, position 0, reward 1). Put the task reward on the last generated token (loss_mask True) and shaping rewards on trained tokens only.
    """
    if reward.ndim != 2:
        raise ValueError(
            f"{owner} expects [B, L] tensors, got reward of shape {tuple(reward.shape)}; "
            "squeeze the trailing feature dim ([B, L, 1] -> [B, L])."
        )
    _check_same_shape("value", value, "reward", reward)
    _check_mask(mask, reward)
    if reward.shape[1] == 0:
        check_finite_reward(reward, owner)
        return True
    stray = reward.ne(0).logical_and_(~mask)
    runs = (mask[:, 1:] & ~mask[:, :-1]).sum(-1, dtype=torch.int32) + mask[:, 0]
    # a NaN/inf anywhere makes the sum non-finite (one read; check_finite_reward then locates it)
    flags = torch.stack([reward.sum().isfinite(), stray.any(), (runs <= 1).all()])
    finite, has_stray, contiguous = flags.tolist()
    if not finite:
        check_finite_reward(reward, owner)
    if has_stray:
        row, col = (int(i) for i in stray.nonzero()[0])
        raise ValueError(
            f"{owner}: {int(stray.sum())} non-zero reward(s) on masked tokens (first at row {row}, "
            f"position {col}, reward {reward[row, col].item():g}). Put the task reward on the last "
            "generated token (loss_mask True) and shaping rewards on trained tokens only."
        )
    return bool(contiguous)


def token_gae(
    reward: Tensor,
    value: Tensor,
    loss_mask: Tensor,
    *,
    gamma: float,
    lmbda: float | Tensor,
    critic_lmbda: float | Tensor | None = None,
    bootstrap_value: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Token-level GAE over the trained tokens of each row, skipping masked tokens.

    Per row, backwards over ``t`` with ``loss_mask[t]`` True (masked tokens are skipped and do not
    change the carried ``V_next``, ``A_next``)::

        delta_t = r_t + gamma * V_next - V_t
        A_t     = delta_t + gamma * lmbda * A_next ;  V_next, A_next = V_t, A_t

    ``V_next`` starts at ``bootstrap_value`` (0 when ``None``: terminal), ``A_next`` at 0.
    ``value_target = A' + V`` where ``A'`` uses ``critic_lmbda`` (defaults to ``lmbda``; VAPO's
    decoupled lambdas). Masked positions get ``advantage = value_target = 0``.

    Multi-turn rows (docs/design.md section 1b: turns of trained tokens with tool/observation
    tokens between them, ``loss_mask`` False there) need nothing more: tool tokens, like prompt and
    padding, consume no step, and ``V_next``, ``A_next`` carry across them (verl's observation mask,
    volcengine/verl#2337, and NeMo-RL's carry-forward GAE compute the same numbers on trained
    tokens). So the last token of turn ``u`` bootstraps from ``V`` at the first trained token of
    turn ``u + 1`` (``state_value`` there is the value of the state after the observation). The
    outcome reward goes on the episode's last trained token and per-turn rewards (e.g. a tool-error
    penalty) on each turn's last trained token; a non-zero reward on a masked token is an error.
    ``bootstrap_value`` is added after the row's last trained token; for a truncated episode
    :class:`~ar_torchrl.objectives.TokenGAE` passes the value of the state after the row's last
    real token (tool output included). :func:`~ar_torchrl.functional.turn_gae` takes one step per
    turn instead.

    Closed form, no loop over tokens: rows with gaps between trained tokens (multi-turn) are first
    compacted (each row's trained tokens moved next to each other), then ``A`` is the discounted
    suffix sum of ``delta`` (factor ``gamma * lmbda``, :func:`_discounted_suffix`). Computed in
    float64 for float64 inputs, else float32, returned in ``reward.dtype``; with float
    hyper-parameters the input check is the only device sync.

    Args:
        reward: ``[B, L]`` per-token reward; must be 0 wherever ``loss_mask`` is False.
        value: ``[B, L]`` V(s_t), the state before token ``t`` (values at masked positions are
            ignored).
        loss_mask: ``[B, L]`` bool.
        gamma: discount in ``[0, 1]``.
        lmbda: GAE lambda in ``[0, 1]``, a float or a per-row ``[B]`` tensor (length-adaptive).
        critic_lmbda: lambda for ``value_target`` (float or ``[B]``); ``None`` = ``lmbda``.
        bootstrap_value: ``[B]`` value after the last trained token (truncated responses); ``None``
            means 0 for every row.

    Returns:
        ``(advantage, value_target)``, both ``[B, L]``.

    Raises:
        ValueError: mismatched shapes, a NaN/inf reward (naming its row and position), a non-zero
            reward on a masked token, or hyper-parameters outside ``[0, 1]``.

    Example:
        >>> r = torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0]])
        >>> v = torch.tensor([[9.0, 0.5, 0.5, 0.5, 9.0]])
        >>> m = torch.tensor([[False, True, True, True, False]])
        >>> adv, ret = token_gae(r, v, m, gamma=1.0, lmbda=1.0)
        >>> adv.tolist(), ret.tolist()
        ([[0.0, 0.5, 0.5, 0.5, 0.0]], [[0.0, 1.0, 1.0, 1.0, 0.0]])
    """
    contiguous = check_gae_inputs(reward, value, loss_mask)
    check_number("token_gae", "gamma", gamma, ge=0, le=1)
    batch, length = reward.shape
    if bootstrap_value is not None and bootstrap_value.shape != (batch,):
        raise ValueError(
            f"bootstrap_value must have shape [B]=({batch},), got {tuple(bootstrap_value.shape)}"
        )
    dtype = torch.float64 if reward.dtype == torch.float64 else torch.float32
    lam = _as_row_coeff(lmbda, "lmbda", batch, dtype, reward.device)
    c_lam = lam
    if critic_lmbda is not None:
        c_lam = _as_row_coeff(critic_lmbda, "critic_lmbda", batch, dtype, reward.device)
    if length == 0:
        return torch.zeros_like(reward), torch.zeros_like(reward)
    v = torch.where(loss_mask, value.to(dtype), 0.0)
    r, v_run, index = reward.to(dtype), v, None
    if not contiguous:
        r, v_run, index = _compact(r, v, loss_mask)
    delta = r - v_run  # delta_t = r_t + gamma * V_{t+1} - V_t along each run (0 after it)
    delta[:, :-1].add_(v_run[:, 1:], alpha=gamma)
    if bootstrap_value is not None:
        _add_bootstrap(delta, loss_mask, gamma * bootstrap_value.to(dtype), compact=not contiguous)
    advantage = _discounted_suffix(delta, gamma * lam)
    critic_adv = None if c_lam is lam else _discounted_suffix(delta, gamma * c_lam)
    advantage = _on_trained(advantage, loss_mask, index)
    critic_adv = advantage if critic_adv is None else _on_trained(critic_adv, loss_mask, index)
    value_target = critic_adv + v  # v is 0 on masked tokens
    return advantage.to(reward.dtype), value_target.to(reward.dtype)


def _on_trained(x: Tensor, mask: Tensor, index: Tensor | None) -> Tensor:
    """``x`` at the trained tokens of the original layout, 0 elsewhere (``index``: compacted)."""
    if index is None:
        return torch.where(mask, x, 0.0)
    return torch.nn.functional.pad(x, (0, 1)).gather(1, index)  # masked tokens read column L


def _compact(r: Tensor, v: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Move each row's trained tokens to columns ``0 .. n - 1`` (zeros after them).

    Returns ``(r, v, index)``: ``index[b, t]`` is the new column of trained token ``(b, t)``, ``L``
    for masked tokens. Shapes: ``[B, L]`` each (index int64).
    """
    batch, length = r.shape
    count = mask.to(torch.int32).cumsum(-1, dtype=torch.int32)
    index = torch.where(mask, count.long() - 1, length)
    out = r.new_zeros(2, batch, length + 1)
    out[0].scatter_(1, index, r)
    out[1].scatter_(1, index, v)
    return out[0, :, :length], out[1, :, :length], index


def _add_bootstrap(delta: Tensor, mask: Tensor, boot: Tensor, compact: bool) -> None:
    """``delta[last trained token] += boot`` in place, per row with a trained token.

    Shapes: delta, mask ``[B, L]``, boot ``[B]``. ``compact``: delta is in the compacted layout
    (the last trained token is at column ``n - 1``).
    """
    if compact:
        last = mask.sum(-1) - 1
    else:
        pos = torch.arange(mask.shape[-1], device=mask.device)
        last = torch.where(mask, pos, -1).amax(-1)
    add = torch.where(last >= 0, boot, 0.0)
    delta.scatter_add_(1, last.clamp_min(0).unsqueeze(-1), add.unsqueeze(-1))


# Tokens per block of _discounted_suffix for a batch-wide factor (per-row factors use ~sqrt(L)).
_BLOCK = 16


def _discounted_suffix(x: Tensor, c: float | Tensor) -> Tensor:
    """``Y_t = x_t + c * Y_{t+1}`` along each row (``Y_L = 0``), with ``c`` in ``[0, 1]``.

    Two levels of the constant Toeplitz matrix ``W[i, j] = c**(i - j)`` (``i >= j``): one matmul
    gives the suffix sums inside blocks of ``k`` tokens, a second the suffix sums ``S`` from each
    block's start (factor ``c**k`` between blocks), and token ``j`` of a block adds
    ``c**(k - j) * S`` of the next block. Every weight lies in ``[0, 1]`` (no ``c**-n``
    rescaling), so float32 keeps its precision on long rows; ``c = 1`` is a reversed cumsum.

    Shapes: x ``[B, L]``; c a float or ``[B, 1]`` (one factor per row). Returns ``[B, L]``.
    """
    batch, length = x.shape
    if isinstance(c, float) and c == 1.0:
        return x.flip(-1).cumsum(-1).flip(-1)
    k = _BLOCK if isinstance(c, float) else max(_BLOCK, math.isqrt(length - 1) + 1)
    blocks = -(-length // k)
    if blocks * k != length:  # zeros past the row end change no suffix sum
        x = torch.nn.functional.pad(x, (0, blocks * k - length))
    y = x.view(batch, blocks, k) @ _powers(c, k, x)  # suffix sums inside each block
    starts = y[:, :, 0].unsqueeze(1) @ _powers(c**k, blocks, x)  # [B, 1, blocks]
    tail = _powers(c, k + 1, x)[..., k, :k]  # c**(k - j): [k] or [B, k]
    y[:, :-1].addcmul_(starts[:, 0, 1:, None], tail if tail.ndim == 1 else tail.unsqueeze(1))
    return y.view(batch, blocks * k)[:, :length]


def _powers(c: float | Tensor, n: int, like: Tensor) -> Tensor:
    """``W[i, j] = c**(i - j)`` for ``i >= j``, else 0: ``[n, n]`` for a float ``c`` (cached on
    ``like``'s device), ``[B, n, n]`` for ``c`` ``[B, 1]``. Weights below ``eps**2`` of ``like``'s
    dtype are 0 (they change no sum, and denormal arithmetic is slow on CPUs)."""
    if isinstance(c, float):
        return _float_powers(c, n, like.dtype, like.device)
    return _geometric(c.to(like.dtype).view(-1, 1, 1), n, torch.finfo(like.dtype).eps ** 2)


@functools.lru_cache(maxsize=32)
def _float_powers(c: float, n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    weights = _geometric(torch.tensor(c, dtype=torch.float64), n, torch.finfo(dtype).eps ** 2)
    return weights.to(dtype=dtype, device=device)


def _geometric(c: Tensor, n: int, tiny: float) -> Tensor:
    i = torch.arange(n, dtype=c.dtype, device=c.device)
    exponent = i[:, None] - i[None, :]
    weights = torch.pow(c, exponent.clamp_min(0))
    return torch.where((exponent >= 0) & (weights >= tiny), weights, 0.0)


def length_adaptive_lmbda(response_length: Tensor, alpha: float = 0.05) -> Tensor:
    """VAPO's length-adaptive lambda ``1 - 1 / (alpha * l)`` per row, clamped to ``[0, 1]``.

    Args:
        response_length: ``[B]`` number of trained tokens per row.

    Example:
        >>> length_adaptive_lmbda(torch.tensor([100, 1000])).tolist()
        [0.8, 0.98]
    """
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    lengths = response_length.to(torch.float64).clamp_min(1.0)
    return (1.0 - 1.0 / (alpha * lengths)).clamp(0.0, 1.0)
