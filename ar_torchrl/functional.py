"""Pure tensor math for token-level PPO/GRPO on language models.

Every function here works on plain tensors (no TensorDict), documents its shapes, and treats a
boolean ``mask`` with ``True`` = "this token is trained on" (generated tokens only, docs/design.md
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


def _check_gae_inputs(reward: Tensor, value: Tensor, mask: Tensor) -> bool:
    """Check shapes and rewards; return whether every row's trained tokens form one run (the
    usual prompt + response layout). Both answers come from one device sync."""
    if reward.ndim != 2:
        raise ValueError(
            f"token_gae expects [B, L] tensors, got reward of shape {tuple(reward.shape)}; "
            "squeeze the trailing feature dim ([B, L, 1] -> [B, L])."
        )
    _check_same_shape("value", value, "reward", reward)
    _check_mask(mask, reward)
    if reward.shape[1] == 0:
        check_finite_reward(reward, "token_gae")
        return True
    stray = reward.ne(0).logical_and_(~mask)
    runs = (mask[:, 1:] & ~mask[:, :-1]).sum(-1, dtype=torch.int32) + mask[:, 0]
    # a NaN/inf anywhere makes the sum non-finite (one read; check_finite_reward then locates it)
    flags = torch.stack([reward.sum().isfinite(), stray.any(), (runs <= 1).all()])
    finite, has_stray, contiguous = flags.tolist()
    if not finite:
        check_finite_reward(reward, "token_gae")
    if has_stray:
        row, col = (int(i) for i in stray.nonzero()[0])
        raise ValueError(
            f"token_gae: {int(stray.sum())} non-zero reward(s) on masked tokens (first at row {row}, "
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

    Closed form, no loop over tokens: rows with gaps between trained tokens (multi-turn) are first
    compacted (each row's trained tokens moved next to each other), then ``A`` is the discounted
    suffix sum of ``delta`` (factor ``gamma * lmbda``, :func:`_discounted_suffix`). Computed in
    float64 for float64 inputs, else float32, returned in ``reward.dtype``; with float
    hyper-parameters the input check is the only device sync.

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
    contiguous = _check_gae_inputs(reward, value, loss_mask)
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
