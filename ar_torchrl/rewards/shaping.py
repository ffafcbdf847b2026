"""Reward shaping that depends on the response's length only (no torch, no task)."""

from __future__ import annotations

__all__ = ["overlong_penalty"]


def overlong_penalty(
    length: int, max_len: int, buffer_len: int, penalty_factor: float = 1.0
) -> float:
    """DAPO's soft overlong punishment (a value ``<= 0`` added to the task reward).

    With ``expected = max_len - buffer_len``: ``min(0, -(length - expected) / buffer_len *
    penalty_factor)``, i.e. 0 up to ``expected`` tokens, then linear down to ``-penalty_factor`` at
    ``max_len`` (and below it beyond, as in DAPO's code).

    Args:
        length: generated tokens of the response.
        max_len: the generation cap (``max_new_tokens``).
        buffer_len: length of the punishment interval before ``max_len``.
        penalty_factor: penalty at ``length == max_len``.

    Example:
        >>> overlong_penalty(10, max_len=20, buffer_len=5), overlong_penalty(20, 20, 5, 1.0)
        (0.0, -1.0)
        >>> overlong_penalty(17, 20, 4, 0.5)
        -0.125
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(
            f"overlong_penalty: buffer_len must be in (0, max_len={max_len}], got {buffer_len}"
        )
    if length < 0:
        raise ValueError(f"overlong_penalty: length must be >= 0, got {length}")
    expected = max_len - buffer_len
    return min(0.0, -(length - expected) / buffer_len * penalty_factor)
