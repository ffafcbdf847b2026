"""Wall-clock timing of the stages of a training iteration (``time/generate``, ``time/update``, ...)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["StageTimer"]


class StageTimer:
    """Accumulate seconds per named stage; :meth:`pop` returns ``{"time/<stage>": s}`` and resets.

    Example:
        >>> timer = StageTimer()
        >>> with timer("generate"):
        ...     pass
        >>> with timer("generate"):
        ...     pass
        >>> out = timer.pop()
        >>> list(out), out["time/generate"] >= 0.0, timer.pop()
        (['time/generate'], True, {})
    """

    def __init__(self, prefix: str = "time/") -> None:
        self.prefix = prefix
        self._totals: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            key = f"{self.prefix}{stage}"
            self._totals[key] = self._totals.get(key, 0.0) + time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        """Return the accumulated totals and start over."""
        out, self._totals = self._totals, {}
        return out
