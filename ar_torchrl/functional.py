"""Pure tensor math for token-level PPO/GRPO on language models.

Every function here works on plain tensors (no TensorDict), documents its shapes, and treats a
boolean ``mask`` with ``True`` = "this token is trained on" (generated tokens only, DESIGN.md
section 1). Masked positions never influence a result, a reduction or a gradient: inputs there are
replaced with zeros through :func:`torch.where` before any arithmetic, so even ``inf``/``nan``
garbage at masked positions is harmless.

References:
    GAE: Schulman et al. 2015, https://arxiv.org/abs/1506.02438
    PPO: Schulman et al. 2017, https://arxiv.org/abs/1707.06347
    GRPO: Shao et al. 2024, https://arxiv.org/abs/2402.03300
    DAPO (clip-higher, token-mean, dynamic sampling): Yu et al. 2025, https://arxiv.org/abs/2503.14476
    Dr.GRPO (no std scaling, constant length normaliser): Liu et al. 2025, https://arxiv.org/abs/2503.20783
    VAPO (decoupled / length-adaptive lambda): Yue et al. 2025, https://arxiv.org/abs/2504.05118
    Dual-clip PPO: Ye et al. 2020, https://arxiv.org/abs/1912.09729
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from ar_torchrl.checks import AGGREGATION_MODES, AggregationMode, check_number

__all__ = [
    "LOG_RATIO_CLAMP",
    "AggregationMode",
    "aggregate_loss",
    "check_finite_reward",
    "clipped_surrogate",
    "clipped_value_loss",
    "explained_variance",
    "grpo_advantage",
    "k3_kl",
    "length_adaptive_lmbda",
    "loss_normalizer",
    "masked_log_ratio",
    "masked_mean",
    "masked_whiten",
    "token_gae",
]

#: Log-ratios ``log pi - log pi_old`` are clamped to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` before
#: ``exp`` (as verl does): ``exp(88.7)`` already overflows float32, and one ``inf`` ratio turns the loss
#: (advantage 0: ``inf * 0``) or the gradient (``0 * inf`` through the unselected branch) into NaN.
LOG_RATIO_CLAMP = 20.0

# Largest |log(c**n)| a chunk may span: c**n and c**-n stay far from under/overflow (and float32
# denormals) in the compute dtype; longer rows are cut into chunks that carry values right to left.
_MAX_LOG_RANGE = {torch.float32: 70.0, torch.float64: 600.0}


def _check_same_shape(name: str, tensor: Tensor, ref_name: str, ref: Tensor) -> None:
    if tensor.shape != ref.shape:
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)} but {ref_name} has shape {tuple(ref.shape)}; "
            f"both must be [B, L] (squeeze a trailing 1 first)."
        )


def _check_mask(mask: Tensor, ref: Tensor, ref_name: str = "reward") -> None:
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor, got dtype {mask.dtype}")
    _check_same_shape("mask", mask, ref_name, ref)


# ----------------------------------------------------------------------------- masked reductions
def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is True (0 where nothing is selected).

    Args:
        x: any shape ``S``.
        mask: bool, shape ``S`` (no broadcasting).
        dim: reduce over this dim only (``None``: over everything).

    Example:
        >>> x = torch.tensor([[1.0, 2.0, 100.0]]); m = torch.tensor([[True, True, False]])
        >>> masked_mean(x, m).item()
        1.5
    """
    _check_mask(mask, x, "x")
    total = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    if dim is None:
        return total.sum() / mask.sum().clamp_min(1)
    return total.sum(dim) / mask.sum(dim).clamp_min(1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over ``mask`` (scalar); Bessel-corrected when ``unbiased`` and n > 1."""
    mean = masked_mean(x, mask)
    sq = masked_mean((x - mean) ** 2, mask)
    n = mask.sum()
    if unbiased and n > 1:
        sq = sq * n / (n - 1)
    return sq


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise ``x`` to zero mean / unit variance over ``mask``; 0 at masked positions.

    ``(x - mean) / sqrt(var + eps)`` with mean and the **unbiased** (Bessel-corrected, ``n - 1``)
    variance over the masked elements only. With ``shift_mean=False`` the mean is added back
    (scale-only whitening).

    Why unbiased: verl's and TRL's ``masked_whiten``, NeMo-RL, and TorchRL's own advantage
    normalisation (``advantage.std()`` in ``ClipPPOLoss``) all divide by ``n - 1``; using the same
    estimator makes whitened advantages comparable number for number with those implementations. The
    difference is a factor ``sqrt((n - 1) / n)`` on the result (0.07 % for 700 trained tokens). With a
    single trained element the variance is taken as 0, so the result is 0 there (never NaN).

    Args:
        x: any shape ``S``; mask: bool, shape ``S``.

    Example:
        >>> x = torch.tensor([1.0, 3.0, 1e6]); m = torch.tensor([True, True, False])
        >>> [round(v, 4) for v in masked_whiten(x, m).tolist()]
        [-0.7071, 0.7071, 0.0]
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask, out, torch.zeros((), dtype=out.dtype, device=out.device))


def explained_variance(value: Tensor, target: Tensor, mask: Tensor) -> Tensor:
    """``1 - Var[target - value] / Var[target]`` over ``mask`` (a finite scalar, always).

    A constant target (``Var[target] == 0``: e.g. one trained token, or every return equal) would
    give ``-inf`` or ``nan``. The convention is scikit-learn's ``explained_variance_score(...,
    force_finite=True)``: then the result is ``1.0`` if the residual ``target - value`` is constant
    too (a perfect prediction up to a shift, which explained variance ignores anyway), else ``0.0``.
    With no trained token it is ``0.0``. A variance counts as zero when it is below the dtype's
    ``eps`` times the mean square (so rounding in the mean of a constant does not count as spread).
    CleanRL and Stable-Baselines3 return ``nan`` here, verl and TorchRL add an epsilon to the
    denominator (a huge negative number); both would poison a logged curve.

    Args:
        value, target: ``[B, L]`` (any shape ``S``); mask: bool, shape ``S``.

    Example:
        >>> v = torch.tensor([1.0, 2.0, 9.0]); t = torch.tensor([1.0, 2.0, -9.0])
        >>> explained_variance(v, t, torch.tensor([True, True, False])).item()
        1.0
        >>> explained_variance(torch.tensor([0.0, 1.0]), torch.ones(2), torch.ones(2, dtype=torch.bool)).item()
        0.0
    """
    err = target - value
    var_t, var_err = masked_var(target, mask, False), masked_var(err, mask, False)
    eps = torch.finfo(var_t.dtype).eps
    flat_t = var_t <= eps * masked_mean(target * target, mask)
    flat_err = var_err <= eps * masked_mean(err * err, mask)
    ratio = var_err / torch.where(flat_t, torch.ones_like(var_t), var_t)
    out = torch.where(flat_t, flat_err.to(var_t.dtype), 1.0 - ratio)
    return torch.where(mask.any(), out, torch.zeros_like(out))


# ----------------------------------------------------------------------------- GAE
def _chunk_size(c: Tensor, length: int, dtype: torch.dtype) -> int:
    positive = c[c > 0]
    if positive.numel() == 0:
        return max(length, 1)
    log_c = -math.log(float(positive.min()))
    if log_c == 0.0:
        return max(length, 1)
    return max(1, min(length, int(_MAX_LOG_RANGE[dtype] / log_c)))


def _masked_discounted_cumsum(delta: Tensor, n: Tensor, c: Tensor) -> Tensor:
    """``X_t = sum_{k >= t} c**(n_k - n_t) * delta_k`` per row, in chunks, right to left.

    With ``delta`` zero on masked tokens and ``n_t`` the number of trained tokens before ``t``, this
    is ``X_t = delta_t + c * X_{next trained}`` on trained tokens, masked tokens skipped. Contiguous
    rows may pass ``n`` as plain positions ``[L]`` (the same differences inside the trained run).
    Each chunk is short enough for ``c**n`` and ``c**-n`` to stay representable.

    Shapes: delta ``[B, L]``, n ``[B, L]`` or ``[L]`` (delta's dtype), c ``[B, 1]`` in ``(0, 1]``.
    Returns ``[B, L]`` (pass-through values at masked positions).
    """
    batch, length = delta.shape
    # a batch-wide c keeps the weights 1-D when n is 1-D (contiguous rows): no [B, L] exp
    log_c = torch.log(c[:1, 0] if bool((c == c[0]).all()) else c)
    chunk = _chunk_size(c, length, delta.dtype)
    if chunk >= length:
        return _discounted_block(delta, n - n[..., :1], log_c, None)
    out = torch.empty_like(delta)
    carry = delta.new_zeros(batch, 1)
    for start in reversed(range(0, length, chunk)):
        end = min(start + chunk, length)
        rel = n[..., start:end] - n[..., start : start + 1]
        span = n[..., end : end + 1] - n[..., start : start + 1] if end < length else None
        block = _discounted_block(delta[:, start:end], rel, log_c, (span, carry))
        out[:, start:end] = block
        carry = block[:, :1]
    return out


def _discounted_block(delta: Tensor, rel: Tensor, log_c: Tensor, carry) -> Tensor:
    """One chunk: ``c**-rel * revcumsum(c**rel * delta) + c**(span - rel) * carry``."""
    weight = torch.exp(rel * log_c)  # c ** rel, [L] or [B, L]
    out = (delta * weight).flip(-1).cumsum(-1).flip(-1).mul_(torch.reciprocal(weight))
    if carry is not None and carry[0] is not None:
        span, value = carry
        out.add_(torch.exp((span - rel) * log_c) * value)
    return out


def _next_trained_value(value: Tensor, mask: Tensor) -> Tensor:
    """Value at the next trained position strictly after ``t`` (0 past the last one).

    Shapes: value ``[B, L]`` (0 at masked positions), mask ``[B, L]`` -> ``[B, L]``.
    """
    batch, length = value.shape
    pos = torch.arange(length, device=value.device).expand(batch, length)
    idx = torch.where(mask, pos, torch.full_like(pos, length))
    suffix_min = idx.flip(-1).cummin(-1).values.flip(-1)
    nxt = torch.cat([suffix_min[:, 1:], suffix_min.new_full((batch, 1), length)], dim=-1)
    return torch.cat([value, value.new_zeros(batch, 1)], dim=-1).gather(-1, nxt)


def _rows_are_contiguous(mask: Tensor) -> bool:
    """True when every row's trained tokens form one run (the usual prompt + response layout)."""
    starts = (mask[:, 1:] & ~mask[:, :-1]).sum(-1) + mask[:, 0]
    return bool((starts <= 1).all())


def _last_trained(mask: Tensor) -> Tensor:
    pos = torch.arange(mask.shape[-1], device=mask.device)
    return torch.where(mask, pos, -1).max(-1).values


def _as_row_coeff(x: float | Tensor, name: str, batch: int, like: Tensor) -> Tensor:
    t = torch.as_tensor(x, dtype=torch.float64, device=like.device)
    if t.ndim == 0:
        t = t.expand(batch)
    if t.shape != (batch,):
        raise ValueError(
            f"{name} must be a float or a [B]={batch} tensor, got shape {tuple(t.shape)}"
        )
    if ((t < 0) | (t > 1)).any() or not torch.isfinite(t).all():
        raise ValueError(f"{name} must be in [0, 1], got {t.tolist() if t.numel() < 9 else t}")
    return t.reshape(batch, 1)


def check_finite_reward(reward: Tensor, owner: str, name: str = "reward") -> None:
    """Raise if ``reward`` holds a NaN or inf, naming the first one's row (and position).

    A single non-finite reward would make a whole GAE batch NaN (every update step then skipped), or
    silently count as a zero-spread GRPO group; it is a bug in the reward function to fix.

    Args:
        reward: ``[B]`` or ``[B, L]``.
    """
    bad = ~torch.isfinite(reward)
    if not bool(bad.any()):
        return
    first = [int(i) for i in bad.nonzero()[0]]
    where = f"row {first[0]}" + (f", position {first[1]}" if len(first) > 1 else "")
    rows = bad.reshape(bad.shape[0], -1).any(-1)
    raise ValueError(
        f"{owner}: non-finite {name} {reward[tuple(first)].item()} at {where} "
        f"({int(rows.sum())} of {reward.shape[0]} rows hold NaN/inf rewards); fix the reward "
        "function or drop those rows before computing advantages"
    )


def _check_gae_inputs(reward: Tensor, value: Tensor, mask: Tensor) -> None:
    if reward.ndim != 2:
        raise ValueError(
            f"token_gae expects [B, L] tensors, got reward of shape {tuple(reward.shape)}; "
            "squeeze the trailing feature dim ([B, L, 1] -> [B, L])."
        )
    _check_same_shape("value", value, "reward", reward)
    _check_mask(mask, reward)
    check_finite_reward(reward, "token_gae")
    stray = (reward != 0) & ~mask
    if stray.any():
        row, col = (int(i) for i in stray.nonzero()[0])
        raise ValueError(
            f"token_gae: {int(stray.sum())} non-zero reward(s) on masked tokens (first at row {row}, "
            f"position {col}, reward {reward[row, col].item():g}). Put the task reward on the last "
            "generated token (loss_mask True) and shaping rewards on trained tokens only."
        )


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
    decoupled lambdas). Masked positions get ``advantage = value_target = 0``. Computed in float64
    for float64 inputs, else float32, in closed form (one matmul per block of 16 tokens, or chunks
    of ``c**n``-weighted cumsums; no Python loop over tokens), returned in ``reward.dtype``.

    Args:
        reward: ``[B, L]`` per-token reward; must be 0 wherever ``loss_mask`` is False.
        value: ``[B, L]`` V(s_t) (values at masked positions are ignored).
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
    _check_gae_inputs(reward, value, loss_mask)
    check_number("token_gae", "gamma", gamma, ge=0, le=1)
    batch, length = reward.shape
    dtype = torch.float64 if reward.dtype == torch.float64 else torch.float32
    if length == 0:
        return torch.zeros_like(reward), torch.zeros_like(reward)
    zero = torch.zeros((), dtype=dtype, device=reward.device)
    r = reward.to(dtype)
    v = torch.where(loss_mask, value.to(dtype), zero)
    # one trained run per row (the usual prompt + response layout): positions count trained tokens
    if _rows_are_contiguous(loss_mask):
        n = torch.arange(length, dtype=dtype, device=reward.device)
    else:
        n = torch.cumsum(loss_mask, dim=-1, dtype=dtype) - loss_mask.to(dtype)
    boot = None
    if bootstrap_value is not None:
        if bootstrap_value.shape != (batch,):
            raise ValueError(
                f"bootstrap_value must have shape [B]=({batch},), got {tuple(bootstrap_value.shape)}"
            )
        last = _last_trained(loss_mask)
        rows = (last >= 0).nonzero().flatten()
        boot = (rows, last[rows], gamma * bootstrap_value.to(dtype)[rows])
    lam = _as_row_coeff(lmbda, "lmbda", batch, reward)
    advantage = _advantage(r, v, loss_mask, n, gamma, lam, boot)
    if critic_lmbda is None:
        critic_adv = advantage
    else:
        c_lam = _as_row_coeff(critic_lmbda, "critic_lmbda", batch, reward)
        critic_adv = _advantage(r, v, loss_mask, n, gamma, c_lam, boot)
    value_target = critic_adv + v  # both 0 at masked positions
    return advantage.to(reward.dtype), value_target.to(reward.dtype)


# Below this lambda the telescoped form's 1/lambda would amplify rounding: use the delta form.
_MIN_TELESCOPE_LMBDA = 0.1


def _advantage(
    r: Tensor, v: Tensor, mask: Tensor, n: Tensor, gamma: float, lam: Tensor, boot
) -> Tensor:
    """GAE advantage ``[B, L]`` for per-row ``lam`` ``[B, 1]`` (0 at masked positions).

    Telescoped form (no next-value gather): with ``c = gamma * lam``,
    ``A_t = X_t - V_t / lam`` where ``X`` is the masked discounted suffix sum (factor ``c``) of
    ``u = r + (1 / lam - 1) * V`` (the ``gamma * V_next`` terms of consecutive deltas telescope).
    The bootstrap enters as ``+ gamma * V_boot`` on the last trained token, as in ``delta``.
    """
    dtype = r.dtype
    if gamma > 0 and float(lam.min()) >= _MIN_TELESCOPE_LMBDA:
        inv = (1.0 / lam).to(dtype)
        unit = bool((inv == 1).all())
        if unit:
            u = r if boot is None else r.clone()  # never modified in place below
        else:
            u = torch.addcmul(r, inv - 1, v)
        if boot is not None:
            u[boot[0], boot[1]] += boot[2]
        x = _discounted_suffix(u, n, gamma * lam)  # a new tensor (c > 0): in place is safe
        x = x.sub_(v) if unit else x.addcmul_(v, inv, value=-1)
        return torch.where(mask, x, 0.0)
    v_next = _next_trained_value(v, mask)
    delta = torch.add(r, v_next, alpha=gamma).sub_(v).mul_(mask)
    if boot is not None:
        delta[boot[0], boot[1]] += boot[2]
    return _discounted_suffix(delta, n, gamma * lam).mul_(mask)


def _discounted_suffix(x: Tensor, n: Tensor, c: Tensor) -> Tensor:
    """Masked discounted suffix sum with per-row ``c`` in [0, 1] (rows with c == 0 get ``x``).

    Contiguous rows (``n`` ``[L]``) with one batch-wide ``c < 1`` go through :func:`_blocked_suffix`,
    other ``c < 1`` through :func:`_masked_discounted_cumsum`.
    Shapes: x ``[B, L]`` (0 at masked positions), n ``[B, L]`` or ``[L]``, c ``[B, 1]``.
    """
    c = c.to(x.dtype)
    if bool((c == 1).all()):
        return x.flip(-1).cumsum(-1).flip(-1)
    zero_rows = c == 0
    if bool(zero_rows.all()):
        return x
    if n.ndim == 1 and bool((c == c[0]).all()):
        block = _block_size(float(c[0]))
        if block >= _MIN_BLOCK:
            return _blocked_suffix(x, float(c[0]), block)
    safe_c = torch.where(zero_rows, torch.ones_like(c), c)
    out = _masked_discounted_cumsum(x, n, safe_c)
    return torch.where(zero_rows, x, out) if bool(zero_rows.any()) else out


# Blocks of the Toeplitz path: K tokens per matmul, fewer when c**K would leave float32's normal
# range (c**K >= 1e-30); below _MIN_BLOCK tokens the chunked closed form is used instead.
_BLOCK = 16
_MIN_BLOCK = 8


def _block_size(c: float) -> int:
    """Tokens per block for factor ``c``: at most ``_BLOCK``, and ``c**K >= 1e-30``."""
    return min(_BLOCK, int(69.0 / -math.log(c))) if 0.0 < c < 1.0 else _BLOCK


@functools.lru_cache(maxsize=16)
def _toeplitz(c: float, k: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """``T[i, j] = c**(i - j)`` for ``i >= j`` (0 above) ``[k, k]`` and ``c**(k - j)`` ``[k]``."""
    i = torch.arange(k, dtype=torch.float64)
    e = i[:, None] - i[None, :]
    toep = torch.where(e >= 0, c ** e.clamp_min(0), 0.0)
    return toep.to(dtype=dtype, device=device), (c ** (k - i)).to(dtype=dtype, device=device)


def _blocked_suffix(x: Tensor, c: float, k: int) -> Tensor:
    """``Y_t = x_t + c * Y_{t+1}`` along each row (``Y_L = 0``), in blocks of ``k`` tokens.

    Inside a block the suffix sum is one matmul with the constant Toeplitz matrix ``c**(i - j)``;
    the value entering block ``b`` from the right, ``Y`` at the start of block ``b + 1``, is the
    discounted (factor ``c**k``) suffix sum of the blocks' heads, computed on ``[B, L / k]`` in
    float64, and enters token ``j`` of the block as ``c**(k - j) * Y``. Every weight lies in
    ``[c**k, 1]``: no ``c**-n`` rescaling, so float32 keeps its precision on long rows.

    Shapes: x ``[B, L]``, c in ``(0, 1)``. Returns ``[B, L]``.
    """
    batch, length = x.shape
    nb = -(-length // k)
    if nb * k != length:  # zeros past the row end change no suffix sum
        x = torch.nn.functional.pad(x, (0, nb * k - length))
    toep, tail = _toeplitz(c, k, x.dtype, x.device)
    y = x.reshape(batch, nb, k).matmul(toep)  # in-block suffix sums
    head = y[:, :, 0].double()
    c_k = torch.full((batch, 1), c**k, dtype=torch.float64, device=x.device)
    blocks = torch.arange(nb, dtype=torch.float64, device=x.device)
    entering = _masked_discounted_cumsum(head, blocks, c_k)[:, 1:].to(x.dtype)
    y[:, :-1].addcmul_(entering.unsqueeze(-1), tail)
    return y.view(batch, nb * k)[:, :length]


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


# ----------------------------------------------------------------------------- GRPO
def grpo_advantage(
    seq_reward: Tensor, group_id: Tensor, *, scale: bool = True, eps: float = 1e-6
) -> tuple[Tensor, Tensor]:
    """Group-relative advantage: ``(r - mean_group) / (std_group + eps)``.

    ``std`` is the Bessel-corrected standard deviation over the group (as verl and TRL compute it);
    ``scale=False`` drops the division (Dr.GRPO). A group whose rewards are all equal (zero spread,
    which includes groups of one sample) gets advantage 0.

    Args:
        seq_reward: ``[B]`` float sequence rewards.
        group_id: ``[B]`` int64 group ids (all samples of one prompt share one id).
        scale: divide by the group std.
        eps: added to the std.

    Returns:
        ``(advantage [B], zero_spread [B] bool)``: ``zero_spread`` flags rows in zero-spread groups.

    Raises:
        ValueError: a NaN/inf sequence reward (naming its row), mismatched shapes.

    Example:
        >>> adv, flat = grpo_advantage(torch.tensor([1.0, -1.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1]))
        >>> [round(a, 4) for a in adv.tolist()], flat.tolist()
        ([0.7071, -0.7071, 0.0, 0.0], [False, False, True, True])
    """
    if seq_reward.ndim != 1 or group_id.shape != seq_reward.shape:
        raise ValueError(
            f"grpo_advantage expects seq_reward [B] and group_id [B], got "
            f"{tuple(seq_reward.shape)} and {tuple(group_id.shape)}"
        )
    if group_id.is_floating_point():
        raise TypeError(f"group_id must be an integer tensor, got {group_id.dtype}")
    check_finite_reward(seq_reward, "grpo_advantage", "sequence reward")
    _, inverse, counts = torch.unique(group_id, return_inverse=True, return_counts=True)
    r = seq_reward.to(torch.float64)
    sums = torch.zeros(counts.shape, dtype=torch.float64, device=r.device).index_add_(0, inverse, r)
    mean = (sums / counts)[inverse]
    sq = torch.zeros_like(sums).index_add_(0, inverse, (r - mean) ** 2)
    std = (sq / (counts - 1).clamp_min(1)).sqrt()[inverse]
    spread = (sq > 0)[inverse]
    adv = r - mean
    if scale:
        adv = adv / (std + eps)
    adv = torch.where(spread, adv, torch.zeros_like(adv))
    return adv.to(seq_reward.dtype), ~spread


# ----------------------------------------------------------------------------- aggregation
def _check_mode(mode: str) -> None:
    if mode not in AGGREGATION_MODES:
        raise ValueError(
            f"unknown loss aggregation mode {mode!r}; expected one of {AGGREGATION_MODES}"
        )


def loss_normalizer(mask: Tensor, mode: AggregationMode) -> Tensor:
    """The denominator :func:`aggregate_loss` uses by default for ``mask`` (a scalar tensor).

    ``token_mean``: number of trained tokens; every ``seq_*`` mode: number of rows with at least one
    trained token. Summing it over the micro-batches of a mini-batch (or all-reducing it across ranks)
    gives the *global normaliser* that makes gradient accumulation equal the full-batch gradient.

    Args:
        mask: ``[B, L]`` bool.

    Example:
        >>> m = torch.tensor([[True, True], [False, False], [True, False]])
        >>> loss_normalizer(m, "token_mean").item(), loss_normalizer(m, "seq_mean_token_mean").item()
        (3.0, 2.0)
    """
    _check_mode(mode)
    if mode == "token_mean":
        return mask.sum().to(torch.float32)
    return mask.any(-1).sum().to(torch.float32)


def aggregate_loss(
    loss: Tensor,
    mask: Tensor,
    mode: AggregationMode = "token_mean",
    normalizer: Tensor | float | None = None,
    *,
    norm_length: int | None = None,
) -> Tensor:
    """Reduce a per-token loss ``[B, L]`` to a scalar over ``mask``.

    - ``token_mean``: ``sum(loss * mask) / N_tokens`` (DAPO).
    - ``seq_mean_token_mean``: mean over rows of each row's token mean (GRPO paper).
    - ``seq_mean_token_sum``: mean over rows of each row's token sum.
    - ``seq_mean_token_sum_norm``: mean over rows of ``token sum / norm_length`` (Dr.GRPO; the
      constant ``norm_length``, e.g. the generation budget, is required).

    Rows without trained tokens contribute 0 and are not counted. ``normalizer`` replaces the
    default denominator (:func:`loss_normalizer`) with a global one for gradient accumulation.

    Args:
        loss: ``[B, L]`` float; mask: ``[B, L]`` bool.

    Example:
        >>> loss = torch.tensor([[1.0, 3.0], [2.0, 99.0]]); m = torch.tensor([[True, True], [True, False]])
        >>> aggregate_loss(loss, m, "token_mean").item(), aggregate_loss(loss, m, "seq_mean_token_mean").item()
        (2.0, 2.0)
    """
    _check_mode(mode)
    _check_mask(mask, loss, "loss")
    if loss.ndim != 2:
        raise ValueError(f"aggregate_loss expects loss [B, L], got shape {tuple(loss.shape)}")
    masked = torch.where(mask, loss, torch.zeros((), dtype=loss.dtype, device=loss.device))
    if mode == "token_mean":
        numerator = masked.sum()
    elif mode == "seq_mean_token_mean":
        numerator = (masked.sum(-1) / mask.sum(-1).clamp_min(1)).sum()
    elif mode == "seq_mean_token_sum":
        numerator = masked.sum()
    else:
        if norm_length is None or norm_length <= 0:
            raise ValueError(
                "aggregate_loss: mode 'seq_mean_token_sum_norm' needs a positive constant "
                f"`norm_length` (e.g. max_new_tokens), got {norm_length!r}"
            )
        numerator = masked.sum() / norm_length
    if normalizer is None:
        normalizer = loss_normalizer(mask, mode)
    normalizer = torch.as_tensor(normalizer, dtype=loss.dtype, device=loss.device)
    return numerator / normalizer.clamp_min(1)


# ----------------------------------------------------------------------------- PPO terms
def masked_log_ratio(log_prob: Tensor, old_log_prob: Tensor, mask: Tensor) -> Tensor:
    """``clamp(log_prob - old_log_prob, -20, 20)`` on ``mask``, 0 elsewhere (``[B, L]``).

    The clamp (:data:`LOG_RATIO_CLAMP`, as verl's ``compute_policy_loss``) keeps ``exp`` of it finite in
    float32; inside the range the result is exactly the difference. Beyond it a token's gradient
    through the ratio is 0 (the clamp is flat there).

    Example:
        >>> masked_log_ratio(torch.tensor([[0.5, 100.0, 7.0]]), torch.zeros(1, 3),
        ...                  torch.tensor([[True, True, False]])).tolist()
        [[0.5, 20.0, 0.0]]
    """
    zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    diff = torch.where(mask, log_prob - old_log_prob, zero)
    return diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def clipped_surrogate(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantage: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token clipped PPO policy loss (clip-higher and optional dual-clip).

    ``ratio = exp(log_prob - old_log_prob)``;
    ``loss = -min(ratio * A, clamp(ratio, 1 - clip_low, 1 + clip_high) * A)``; with ``dual_clip = c``
    (> 1), tokens with ``A < 0`` use ``min(loss, -c * A)``. Masked positions give loss 0, ratio 1 and
    zero gradient whatever their inputs hold. The log-ratio is clamped to ``[-20, 20]`` first
    (:func:`masked_log_ratio`, as verl): identical results inside that range, and finite losses and
    gradients outside it (an unclamped float32 ratio overflows above ~88.7).

    Args:
        log_prob, old_log_prob, advantage: ``[B, L]`` float; mask: ``[B, L]`` bool.

    Returns:
        ``(loss [B, L], ratio [B, L], clipped [B, L] bool)``; ``clipped`` marks tokens where the
        clipped branch was taken (the PPO ``clip_fraction`` numerator).

    Example:
        >>> lp = torch.tensor([[0.5, 0.0]]); old = torch.zeros(1, 2); a = torch.ones(1, 2)
        >>> loss, ratio, clipped = clipped_surrogate(lp, old, a, torch.ones(1, 2, dtype=torch.bool),
        ...                                          clip_low=0.2, clip_high=0.28)
        >>> [round(x, 2) for x in loss[0].tolist()], clipped.tolist()
        ([-1.28, -1.0], [[True, False]])
    """
    _check_mask(mask, log_prob, "log_prob")
    _check_same_shape("old_log_prob", old_log_prob, "log_prob", log_prob)
    _check_same_shape("advantage", advantage, "log_prob", log_prob)
    zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    adv = torch.where(mask, advantage, zero)
    ratio = torch.exp(masked_log_ratio(log_prob, old_log_prob, mask))
    surr = -ratio * adv
    surr_clipped = -ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    loss = torch.maximum(surr, surr_clipped)
    clipped = (surr_clipped > surr) & mask
    if dual_clip is not None:
        dual = torch.minimum(loss, -dual_clip * adv)
        clipped = clipped | ((adv < 0) & (dual < loss) & mask)
        loss = torch.where(adv < 0, dual, loss)
    return torch.where(mask, loss, zero), ratio, clipped


def clipped_value_loss(
    value: Tensor, old_value: Tensor, target: Tensor, mask: Tensor, *, clip_value: float | None
) -> tuple[Tensor, Tensor]:
    """Per-token clipped value loss ``0.5 * max((V - R)^2, (V_clip - R)^2)``.

    ``V_clip = V_old + clamp(V - V_old, -clip_value, clip_value)``; ``clip_value=None`` gives the
    plain ``0.5 * (V - R)^2``. Masked positions give 0 and zero gradient.

    Args:
        value, old_value, target: ``[B, L]`` float; mask: ``[B, L]`` bool.

    Returns:
        ``(loss [B, L], clipped [B, L] bool)`` where ``clipped`` marks tokens whose clipped branch is
        the larger one (``value_clip_fraction`` numerator).

    Example:
        >>> v = torch.tensor([[1.0]]); old = torch.zeros(1, 1); r = torch.tensor([[2.0]])
        >>> loss, clipped = clipped_value_loss(v, old, r, torch.ones(1, 1, dtype=torch.bool), clip_value=0.2)
        >>> round(loss.item(), 3), clipped.item()
        (1.62, True)
    """
    _check_mask(mask, value, "value")
    _check_same_shape("old_value", old_value, "value", value)
    _check_same_shape("target", target, "value", value)
    zero = torch.zeros((), dtype=value.dtype, device=value.device)
    v = torch.where(mask, value, zero)
    tgt = torch.where(mask, target, zero)
    unclipped = (v - tgt) ** 2
    if clip_value is None:
        return torch.where(mask, 0.5 * unclipped, zero), torch.zeros_like(mask)
    old = torch.where(mask, old_value, zero)
    v_clip = old + (v - old).clamp(-clip_value, clip_value)
    clipped_sq = (v_clip - tgt) ** 2
    loss = 0.5 * torch.maximum(unclipped, clipped_sq)
    return torch.where(mask, loss, zero), (clipped_sq > unclipped) & mask


def k3_kl(log_prob: Tensor, ref_log_prob: Tensor, mask: Tensor, *, clamp: float = 10.0) -> Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref): ``exp(ref - lp) - (ref - lp) - 1`` (>= 0).

    Schulman's low-variance estimator (http://joschu.net/blog/kl-approx.html), as GRPO uses it. The
    log-ratio is clamped to ``[-20, 20]`` and the result to ``[0, clamp]`` for stability (as verl's
    ``low_var_kl``). 0 at masked positions.

    Example:
        >>> m = torch.ones(1, 2, dtype=torch.bool)
        >>> k3_kl(torch.tensor([[0.0, -1.0]]), torch.tensor([[0.0, 0.0]]), m).tolist()[0][0]
        0.0
    """
    _check_mask(mask, log_prob, "log_prob")
    _check_same_shape("ref_log_prob", ref_log_prob, "log_prob", log_prob)
    zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    diff = masked_log_ratio(ref_log_prob, log_prob, mask)
    kl = (torch.exp(diff) - diff - 1.0).clamp(0.0, clamp)
    return torch.where(mask, kl, zero)
