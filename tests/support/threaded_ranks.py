"""Ranks as threads of one process, for tests of what crosses ranks without a process group."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping


class ThreadedRanks:
    """``plan.reduce`` across ``world`` threads: each call waits for every rank's values and returns
    their sum (``op="max"``/``"min"``: the extreme), as ``torch.distributed.all_reduce`` does. Every
    rank must make the same calls in the same order (a real collective hangs otherwise; here the
    barrier times out)."""

    def __init__(self, world: int, timeout_s: float = 60.0):
        self.world = world
        self._barrier = threading.Barrier(world, timeout=timeout_s)
        self._lock = threading.Lock()
        self._pending: list[dict[str, float]] = []

    def reduce(self, values: Mapping[str, float], op: str = "sum") -> dict[str, float]:
        with self._lock:
            self._pending.append({k: float(v) for k, v in values.items()})
        self._barrier.wait()
        pick = {"sum": sum, "max": max, "min": min}[op]
        combined = {k: pick(p[k] for p in self._pending) for k in sorted(values)}
        self._barrier.wait()
        with self._lock:
            self._pending.clear()
        self._barrier.wait()
        return combined

    def run(self, fn: Callable[[int], object]) -> list[object]:
        """``fn(rank)`` on every rank, each in its thread; their results by rank (an exception on
        any rank is raised here)."""
        results: list[object] = [None] * self.world
        errors: list[BaseException] = []

        def target(rank: int) -> None:
            try:
                results[rank] = fn(rank)
            except BaseException as err:  # re-raised in the caller
                errors.append(err)
                self._barrier.abort()

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results
