"""Argument checks shared by the library and the recipe's config schemas (the one source of ranges).

This module imports nothing heavy (no torch), so a recipe can validate its whole configuration
before it imports the training stack. Library classes call the same functions, so the recipe and
the library can never disagree on what a valid value is.

Every check raises ``ValueError`` (``TypeError`` for a wrong type) with the owner, the argument
name, the value received and what is accepted. An ``owner`` ending with ``.`` is a config key
prefix: ``check_optimizer_args("config: algo.", lr=-1e-3)`` says ``config: algo.lr must be > 0``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from typing import Any, Literal, get_args
from urllib.parse import urlparse

__all__ = [
    "AGGREGATION_MODES",
    "GAE_TIMESTEPS",
    "MAX_TIMEOUT_S",
    "AggregationMode",
    "GAETimestep",
    "check_actor_args",
    "check_bool",
    "check_choice",
    "check_clip_epsilon",
    "check_gae_args",
    "check_grad_clip",
    "check_grpo_args",
    "check_max_batch_size",
    "check_number",
    "check_optimizer_args",
    "check_ppo_loss_args",
    "check_ppo_update_args",
    "check_sampling_args",
    "check_timeout",
    "check_token_budget",
    "check_warm_start_args",
    "is_server_url",
]

#: Loss aggregation modes (``ar_torchrl.functional.aggregate_loss``), defined here so that a config
#: schema can check them without importing torch.
AggregationMode = Literal[
    "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"
]
AGGREGATION_MODES: tuple[str, ...] = get_args(AggregationMode)

#: GAE step units (``TokenGAE(timestep=...)``): one step per trained token, or one per turn of a
#: multi-turn episode (reads ``turn_id``).
GAETimestep = Literal["token", "turn"]
GAE_TIMESTEPS: tuple[str, ...] = get_args(GAETimestep)


def is_server_url(url: str) -> bool:
    """Whether ``url`` is ``http(s)://host:port`` (a path is allowed, e.g. behind a proxy).

    >>> is_server_url("http://127.0.0.1:30000"), is_server_url("http://h:x"), is_server_url("grpc://h:1")
    (True, False, False)
    """
    parsed = urlparse(url)
    try:
        port = parsed.port
    except ValueError:  # a port that is not a number, or out of range
        port = None
    return parsed.scheme in ("http", "https") and bool(parsed.hostname) and port is not None


def _key(owner: str, name: str) -> str:
    """How a message names an argument: ``"owner: name"``, or, for an ``owner`` ending with ``.``
    (a config key prefix such as ``"config: algo."``), the full key ``"config: algo.lr"``."""
    return f"{owner}{name}" if owner.endswith(".") else f"{owner}: {name}"


def _describe(gt, ge, lt, le) -> str:
    parts = []
    if gt is not None:
        parts.append(f"> {gt}")
    if ge is not None:
        parts.append(f">= {ge}")
    if lt is not None:
        parts.append(f"< {lt}")
    if le is not None:
        parts.append(f"<= {le}")
    return " and ".join(parts)


def check_number(
    owner: str,
    name: str,
    value: Any,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    integer: bool = False,
    allow_none: bool = False,
    hint: str | None = None,
) -> Any:
    """Check that ``value`` is a finite number (an ``int`` if ``integer``) within the bounds.

    Booleans are not numbers here (``iterations=true`` is a mistake, not ``1``); numpy scalars are
    (``numbers.Real`` / ``numbers.Integral``). ``hint`` is appended to a range error in parentheses.

    Returns:
        ``value`` unchanged.

    Example:
        >>> check_number("TokenGAE", "lmbda", 0.95, ge=0, le=1)
        0.95
        >>> check_number("recipe", "train.iterations", True, ge=1, integer=True)
        Traceback (most recent call last):
        ...
        TypeError: recipe: train.iterations must be an integer, got True (bool)
        >>> check_number("ppo_update", "grad_clip", -1.0, gt=0)
        Traceback (most recent call last):
        ...
        ValueError: ppo_update: grad_clip must be > 0, got -1.0
    """
    if value is None:
        if allow_none:
            return value
        raise TypeError(f"{_key(owner, name)} must be a number, got None")
    kind = "an integer" if integer else "a number"
    ok_type = isinstance(value, numbers.Integral if integer else numbers.Real)
    if isinstance(value, bool) or not ok_type:
        raise TypeError(
            f"{_key(owner, name)} must be {kind}, got {value!r} ({type(value).__name__})"
        )
    if not math.isfinite(value):
        raise ValueError(f"{_key(owner, name)} must be finite, got {value!r}")
    bad = (
        (gt is not None and not value > gt)
        or (ge is not None and not value >= ge)
        or (lt is not None and not value < lt)
        or (le is not None and not value <= le)
    )
    if bad:
        extra = f" ({hint})" if hint else ""
        raise ValueError(
            f"{_key(owner, name)} must be {_describe(gt, ge, lt, le)}, got {value!r}{extra}"
        )
    return value


def check_bool(owner: str, name: str, value: Any) -> bool:
    """Check that ``value`` is a ``bool`` (a string ``"false"`` is truthy: a classic config bug).

    Example:
        >>> check_bool("GRPOAdvantage", "scale", "no")
        Traceback (most recent call last):
        ...
        TypeError: GRPOAdvantage: scale must be true or false, got 'no' (str)
    """
    if not isinstance(value, bool):
        raise TypeError(
            f"{_key(owner, name)} must be true or false, got {value!r} ({type(value).__name__})"
        )
    return value


def check_choice(owner: str, name: str, value: Any, choices: Iterable[Any]) -> Any:
    """Check that ``value`` is one of ``choices``.

    Example:
        >>> check_choice("recipe", "train.mode", "fast", ("sync", "async"))
        Traceback (most recent call last):
        ...
        ValueError: recipe: train.mode='fast' is not one of ['sync', 'async']
    """
    choices = list(choices)
    if value not in choices:
        raise ValueError(f"{_key(owner, name)}={value!r} is not one of {choices}")
    return value


def check_clip_epsilon(
    owner: str, value: Any, *, name: str = "clip_epsilon"
) -> float | tuple[float, float]:
    """PPO ratio clip: ``eps`` in ``(0, 1)`` or ``(eps_low, eps_high)``, ``0 < eps_low < 1 < ...``.

    ``eps_low`` must be in ``(0, 1)`` (the ratio's lower bound ``1 - eps_low`` stays positive);
    ``eps_high`` only has to be positive (DAPO's clip-higher uses 0.28; larger values are legal).

    Returns:
        ``eps`` or the ``(low, high)`` tuple as floats.

    Example:
        >>> check_clip_epsilon("TokenPPOLoss", [0.2, 0.28])
        (0.2, 0.28)
        >>> check_clip_epsilon("TokenPPOLoss", (1.2, 0.28))
        Traceback (most recent call last):
        ...
        ValueError: TokenPPOLoss: clip_epsilon must be a float in (0, 1) or (low, high) with 0 < low < 1 and high > 0, got (1.2, 0.28)
    """
    msg = (
        f"{_key(owner, name)} must be a float in (0, 1) or (low, high) with 0 < low < 1 and "
        f"high > 0, got {value!r}"
    )
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != 2 or any(isinstance(v, bool) for v in value):
            raise ValueError(msg)
        try:
            low, high = float(value[0]), float(value[1])
        except (TypeError, ValueError) as err:
            raise ValueError(msg) from err
        if not (0 < low < 1 and 0 < high and math.isfinite(high)):
            raise ValueError(msg)
        return (low, high)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ValueError(msg)
    return float(value)


#: The longest deadline a timeout option accepts: one week (in seconds). Python's and the OS's
#: timers overflow a little above 9.2e9 s (``threading.TIMEOUT_MAX``), so ``1e10`` would pass a
#: plain ``> 0`` check and raise ``OverflowError`` at the first wait.
MAX_TIMEOUT_S = 7 * 24 * 3600.0


def check_timeout(owner: str, name: str, value: Any, *, allow_none: bool = False) -> float | None:
    """A deadline in seconds: ``> 0`` and at most :data:`MAX_TIMEOUT_S` (a week); ``None`` (no
    deadline) where ``allow_none``. Every timeout option of the library and of the recipe's
    configuration is checked here.

    Example:
        >>> check_timeout("config: tools.", "timeout_s", 1e10, allow_none=True)
        Traceback (most recent call last):
        ...
        ValueError: config: tools.timeout_s must be <= 604800 (seconds: a week), got 10000000000.0 (None: no deadline)
        >>> check_timeout("Toolbox", "timeout_s", 5)
        5.0
    """
    hint = "None: no deadline" if allow_none else None
    value = check_number(owner, name, value, gt=0, allow_none=allow_none, hint=hint)
    if value is None:
        return None
    if value > MAX_TIMEOUT_S:
        extra = f" ({hint})" if hint else ""
        raise ValueError(
            f"{_key(owner, name)} must be <= {MAX_TIMEOUT_S:.0f} (seconds: a week), got "
            f"{value!r}{extra}"
        )
    return float(value)


def check_token_budget(owner: str, value: Any, *, name: str = "token_budget") -> int:
    """Tokens (rows x padded width) of one micro-batch: an integer ``>= 1``.

    Example:
        >>> check_token_budget("plan_micro_batches", 0)
        Traceback (most recent call last):
        ...
        ValueError: plan_micro_batches: token_budget must be >= 1, got 0 (the tokens of one micro-batch: rows x padded width)
    """
    hint = "the tokens of one micro-batch: rows x padded width"
    return check_number(owner, name, value, ge=1, integer=True, hint=hint)


def check_sampling_args(
    owner: str = "SamplingParams",
    *,
    max_new_tokens: Any = 64,
    temperature: Any = 1.0,
    top_p: Any = 1.0,
    top_k: Any = -1,
) -> dict[str, Any]:
    """How to sample (:class:`~ar_torchrl.backends.SamplingParams`): ``max_new_tokens >= 1``,
    ``temperature >= 0`` (0: greedy), ``top_p`` in ``(0, 1]``, ``top_k`` -1 (off) or ``>= 1``.

    Example:
        >>> check_sampling_args(top_k=0)
        Traceback (most recent call last):
        ...
        ValueError: SamplingParams: top_k must be -1 (off) or >= 1, got 0
    """
    args = {
        "max_new_tokens": check_number(owner, "max_new_tokens", max_new_tokens, ge=1, integer=True),
        "temperature": check_number(owner, "temperature", temperature, ge=0),
        "top_p": check_number(owner, "top_p", top_p, gt=0, le=1),
        "top_k": check_number(owner, "top_k", top_k, integer=True),
    }
    if not (top_k == -1 or top_k >= 1):
        raise ValueError(f"{_key(owner, 'top_k')} must be -1 (off) or >= 1, got {top_k}")
    return args


def check_grad_clip(owner: str, value: Any, *, name: str = "grad_clip") -> float | None:
    """Max global gradient norm: ``None`` (no clipping) or a finite number ``> 0``.

    ``0`` would silently freeze training and a negative value flips the gradient's sign in
    ``clip_grad_norm_``: both are errors.

    Example:
        >>> check_grad_clip("ppo_update", None) is None
        True
        >>> check_grad_clip("ppo_update", 0)
        Traceback (most recent call last):
        ...
        ValueError: ppo_update: grad_clip must be > 0, got 0 (None disables clipping)
    """
    if value is None:
        return None
    try:
        return float(check_number(owner, name, value, gt=0))
    except ValueError as err:
        raise ValueError(f"{err} (None disables clipping)") from None


# ----------------------------------------------------------------------------- one function per group
# Each checks every numeric/option argument of one library entry point, with the argument names as
# the library spells them, and returns them as a dict (floats where the library wants floats). A
# config schema calls the same function with ``owner`` naming its config group, so the recipe and the
# library can never disagree on a range.


def check_gae_args(
    owner: str = "TokenGAE",
    *,
    gamma: Any = 1.0,
    lmbda: Any = 0.95,
    critic_lmbda: Any = None,
    adaptive_lmbda_alpha: Any = None,
    normalize_advantage: Any = False,
    bootstrap_truncated: Any = False,
    timestep: Any = "token",
) -> dict[str, Any]:
    """Arguments of :class:`~ar_torchrl.objectives.TokenGAE` (``gamma``, lambdas in ``[0, 1]``,
    ``timestep`` one of :data:`GAE_TIMESTEPS`).

    Example:
        >>> check_gae_args(gamma=1.0, lmbda=1.2)
        Traceback (most recent call last):
        ...
        ValueError: TokenGAE: lmbda must be >= 0 and <= 1, got 1.2
        >>> check_gae_args("config: algo.gae.", timestep="episode")
        Traceback (most recent call last):
        ...
        ValueError: config: algo.gae.timestep='episode' is not one of ['token', 'turn']
    """
    return {
        "gamma": float(check_number(owner, "gamma", gamma, ge=0, le=1)),
        "lmbda": float(check_number(owner, "lmbda", lmbda, ge=0, le=1)),
        "critic_lmbda": _opt_float(
            check_number(owner, "critic_lmbda", critic_lmbda, ge=0, le=1, allow_none=True)
        ),
        "adaptive_lmbda_alpha": _opt_float(
            check_number(owner, "adaptive_lmbda_alpha", adaptive_lmbda_alpha, gt=0, allow_none=True)
        ),
        "normalize_advantage": check_bool(owner, "normalize_advantage", normalize_advantage),
        "bootstrap_truncated": check_bool(owner, "bootstrap_truncated", bootstrap_truncated),
        "timestep": check_choice(owner, "timestep", timestep, GAE_TIMESTEPS),
    }


def check_grpo_args(
    owner: str = "GRPOAdvantage",
    *,
    scale: Any = True,
    eps: Any = 1e-6,
    critic_targets: Any = False,
    gamma: Any = 1.0,
) -> dict[str, Any]:
    """Arguments of :class:`~ar_torchrl.objectives.GRPOAdvantage` (``eps >= 0``, ``gamma`` in [0, 1]).

    Example:
        >>> check_grpo_args(eps=-1e-6)
        Traceback (most recent call last):
        ...
        ValueError: GRPOAdvantage: eps must be >= 0, got -1e-06
    """
    return {
        "scale": check_bool(owner, "scale", scale),
        "eps": float(check_number(owner, "eps", eps, ge=0)),
        "critic_targets": check_bool(owner, "critic_targets", critic_targets),
        "gamma": float(check_number(owner, "gamma", gamma, ge=0, le=1)),
    }


def check_ppo_loss_args(
    owner: str = "TokenPPOLoss",
    *,
    clip_epsilon: Any = 0.2,
    dual_clip: Any = None,
    clip_value: Any = 0.2,
    entropy_coeff: Any = 0.0,
    critic_coeff: Any = 1.0,
    kl_coeff: Any = 0.0,
    loss_agg_mode: Any = "token_mean",
    norm_length: Any = None,
    tis_cap: Any = None,
    kl_estimator: Any = "k3",
) -> dict[str, Any]:
    """Arguments of :class:`~ar_torchrl.objectives.TokenPPOLoss`.

    ``clip_epsilon``: see :func:`check_clip_epsilon`; ``dual_clip > 1``; ``clip_value > 0``;
    coefficients ``>= 0``; ``norm_length`` a positive integer, required by
    ``seq_mean_token_sum_norm``; ``tis_cap > 0``. ``None`` switches the optional ones off.

    Example:
        >>> check_ppo_loss_args(clip_value=-0.2)
        Traceback (most recent call last):
        ...
        ValueError: TokenPPOLoss: clip_value must be > 0, got -0.2 (None disables value clipping)
    """
    check_choice(owner, "loss_agg_mode", loss_agg_mode, AGGREGATION_MODES)
    check_choice(owner, "kl_estimator", kl_estimator, ("k1", "k2", "k3", "k3_unbiased"))
    norm_length = check_number(
        owner, "norm_length", norm_length, ge=1, integer=True, allow_none=True
    )
    if loss_agg_mode == "seq_mean_token_sum_norm" and norm_length is None:
        raise ValueError(
            f"{_key(owner, 'loss_agg_mode')}='seq_mean_token_sum_norm' needs norm_length "
            "(e.g. max_new_tokens)"
        )
    off = "None disables it"
    return {
        "clip_epsilon": check_clip_epsilon(owner, clip_epsilon),
        "dual_clip": _opt_float(
            check_number(owner, "dual_clip", dual_clip, gt=1, allow_none=True, hint="e.g. 3.0")
        ),
        "clip_value": _opt_float(
            check_number(
                owner,
                "clip_value",
                clip_value,
                gt=0,
                allow_none=True,
                hint="None disables value clipping",
            )
        ),
        "entropy_coeff": float(check_number(owner, "entropy_coeff", entropy_coeff, ge=0)),
        "critic_coeff": _opt_float(
            check_number(owner, "critic_coeff", critic_coeff, ge=0, allow_none=True, hint=off)
        ),
        "kl_coeff": float(check_number(owner, "kl_coeff", kl_coeff, ge=0)),
        "loss_agg_mode": loss_agg_mode,
        "norm_length": norm_length,
        "tis_cap": _opt_float(check_number(owner, "tis_cap", tis_cap, gt=0, allow_none=True)),
        "kl_estimator": kl_estimator,
    }


def check_ppo_update_args(
    owner: str = "ppo_update", *, epochs: Any = 1, num_minibatches: Any = 1, grad_clip: Any = 1.0
) -> dict[str, Any]:
    """Arguments of :func:`~ar_torchrl.training.ppo_update` (integers ``>= 1``, see :func:`check_grad_clip`).

    Example:
        >>> check_ppo_update_args(epochs=0)
        Traceback (most recent call last):
        ...
        ValueError: ppo_update: epochs must be >= 1, got 0
    """
    return {
        "epochs": check_number(owner, "epochs", epochs, ge=1, integer=True),
        "num_minibatches": check_number(
            owner, "num_minibatches", num_minibatches, ge=1, integer=True
        ),
        "grad_clip": check_grad_clip(owner, grad_clip),
    }


def check_optimizer_args(
    owner: str, *, lr: Any, value_lr: Any = None, weight_decay: Any = 0.0
) -> dict[str, Any]:
    """Learning rates (``lr > 0``; a value-head ``value_lr >= 0``, 0 = frozen head) and ``weight_decay >= 0``.

    A negative learning rate trains the wrong way (gradient ascent on the loss): an error.

    Example:
        >>> check_optimizer_args("algo", lr=-1e-3)
        Traceback (most recent call last):
        ...
        ValueError: algo: lr must be > 0, got -0.001
    """
    return {
        "lr": float(check_number(owner, "lr", lr, gt=0)),
        "value_lr": _opt_float(check_number(owner, "value_lr", value_lr, ge=0, allow_none=True)),
        "weight_decay": float(check_number(owner, "weight_decay", weight_decay, ge=0)),
    }


def check_actor_args(
    owner: str = "LMActorCritic",
    *,
    temperature: Any = 1.0,
    logits_chunk_tokens: Any = None,
    return_entropy: Any = False,
    critic: Any = True,
    logits_memory_budget: Any = 2**30,
) -> dict[str, Any]:
    """Arguments of :class:`~ar_torchrl.modules.LMActorCritic` (``temperature > 0``, chunk ``>= 1``
    or ``None``, memory budget ``>= 1`` byte).

    Example:
        >>> check_actor_args(temperature=0.0)
        Traceback (most recent call last):
        ...
        ValueError: LMActorCritic: temperature must be > 0, got 0.0 (log-probs of greedy decoding use 1.0)
    """
    return {
        "temperature": float(
            check_number(
                owner, "temperature", temperature, gt=0, hint="log-probs of greedy decoding use 1.0"
            )
        ),
        "logits_chunk_tokens": check_number(
            owner, "logits_chunk_tokens", logits_chunk_tokens, ge=1, integer=True, allow_none=True
        ),
        "logits_memory_budget": check_number(
            owner, "logits_memory_budget", logits_memory_budget, ge=1, integer=True
        ),
        "return_entropy": check_bool(owner, "return_entropy", return_entropy),
        "critic": check_bool(owner, "critic", critic),
    }


def check_warm_start_args(
    owner: str = "supervised_warm_start",
    *,
    steps: Any = 300,
    batch_size: Any = 32,
    lr: Any = 3e-3,
    final_lr_ratio: Any = 0.1,
    correct_fraction: Any = 0.3,
    grad_clip: Any = 1.0,
) -> dict[str, Any]:
    """Arguments of :func:`~ar_torchrl.models.warmstart.supervised_warm_start`.

    Example:
        >>> check_warm_start_args(lr=0.0)
        Traceback (most recent call last):
        ...
        ValueError: supervised_warm_start: lr must be > 0, got 0.0
    """
    return {
        "steps": check_number(owner, "steps", steps, ge=1, integer=True),
        "batch_size": check_number(owner, "batch_size", batch_size, ge=1, integer=True),
        "lr": float(check_number(owner, "lr", lr, gt=0)),
        "final_lr_ratio": float(check_number(owner, "final_lr_ratio", final_lr_ratio, gt=0, le=1)),
        "correct_fraction": float(
            check_number(owner, "correct_fraction", correct_fraction, ge=0, le=1)
        ),
        "grad_clip": float(check_number(owner, "grad_clip", grad_clip, gt=0)),
    }


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def check_max_batch_size(owner: str, value: Any) -> int | None:
    """Most sequences per generation forward: ``None`` (all at once) or an integer ``>= 1``; the
    check of both ``backend.max_batch_size`` and ``TransformersBackend(max_batch_size=...)``.

    Example:
        >>> check_max_batch_size("TransformersBackend", 0)
        Traceback (most recent call last):
        ...
        ValueError: TransformersBackend: max_batch_size must be >= 1, got 0
    """
    return check_number(owner, "max_batch_size", value, ge=1, integer=True, allow_none=True)
