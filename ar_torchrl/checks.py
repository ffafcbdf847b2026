"""Argument checks shared by the library and the recipe's config schemas (the one source of ranges).

This module imports nothing heavy (no torch), so a recipe can validate its whole configuration
before it imports the training stack. Library classes call the same functions, so the recipe and
the library can never disagree on what a valid value is.

Every check raises ``ValueError`` (``TypeError`` for a wrong type) with the owner, the argument
name, the value received and what is accepted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["check_choice", "check_clip_epsilon", "check_grad_clip", "check_number"]


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
) -> Any:
    """Check that ``value`` is a finite number (an ``int`` if ``integer``) within the bounds.

    Booleans are not numbers here (``iterations=true`` is a mistake, not ``1``).

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
        raise TypeError(f"{owner}: {name} must be a number, got None")
    kind = "an integer" if integer else "a number"
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type:
        raise TypeError(f"{owner}: {name} must be {kind}, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{owner}: {name} must be finite, got {value!r}")
    bad = (
        (gt is not None and not value > gt)
        or (ge is not None and not value >= ge)
        or (lt is not None and not value < lt)
        or (le is not None and not value <= le)
    )
    if bad:
        raise ValueError(f"{owner}: {name} must be {_describe(gt, ge, lt, le)}, got {value!r}")
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
        raise ValueError(f"{owner}: {name}={value!r} is not one of {choices}")
    return value


def check_clip_epsilon(owner: str, value: Any) -> float | tuple[float, float]:
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
        f"{owner}: clip_epsilon must be a float in (0, 1) or (low, high) with 0 < low < 1 and "
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


def check_grad_clip(owner: str, value: Any) -> float | None:
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
        return float(check_number(owner, "grad_clip", value, gt=0))
    except ValueError as err:
        raise ValueError(f"{err} (None disables clipping)") from None
