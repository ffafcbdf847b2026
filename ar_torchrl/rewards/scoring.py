"""Scoring samples off the calling thread, with a deadline, naming the row that failed.

The environment scores each batch here: every sample's ``reward.score`` and ``reward.correct`` run
in a small worker pool (one thread by default, so a reward need not be thread-safe), never on the
training thread, and each call has a deadline. A reward that raises, returns something that is not
a real number, or runs past the deadline is an error naming the reward, the batch row and the
dataset row's source; a reward that hangs cannot be killed from Python: its thread is abandoned
and the error says so.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

__all__ = ["RewardError", "RewardScorer"]


class RewardError(RuntimeError):
    """A reward raised, returned a non-number, or missed its deadline (the message names the row)."""


def _score_chunk(reward: Any, samples: Sequence[Any], rows: Sequence[int], progress: dict) -> list:
    """Score ``samples`` in order, recording which row is being scored (and since when)."""
    out = []
    for sample, row in zip(samples, rows):
        progress["current"] = (row, time.monotonic())
        try:
            value = reward.score(sample)
            ok = not isinstance(value, bool) and isinstance(value, numbers.Real)
            out.append((value, bool(reward.correct(sample, float(value))) if ok else False, None))
        except Exception as err:  # raised in the main thread, naming the row
            out.append((None, False, err))
            break
    progress["current"] = None
    return out


class RewardScorer:
    """Scores samples with ``reward`` in ``workers`` threads, each call within ``timeout_s``.

    Example:
        >>> from ar_torchrl.data.samples import Sample
        >>> from ar_torchrl.rewards.registry import SampleReward
        >>> scorer = RewardScorer(SampleReward(lambda s: len(s.text), name="chars"))
        >>> samples = [Sample([], text="ab"), Sample([], text="abc")]
        >>> scorer(samples)
        >>> [(s.reward, s.correct) for s in samples]
        [(2.0, True), (3.0, True)]
        >>> scorer.close()
    """

    def __init__(self, reward: Any, *, workers: int = 1, timeout_s: float = 60.0) -> None:
        if workers < 1 or not timeout_s > 0:
            raise ValueError(
                f"RewardScorer: workers must be >= 1 and timeout_s > 0, got {workers}, {timeout_s}"
            )
        self.reward, self.workers, self.timeout_s = reward, workers, timeout_s
        self._pool: ThreadPoolExecutor | None = None

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="reward")
        return self._pool

    def _where(self, sample: Any, row: int) -> str:
        source = f", {sample.source}" if sample.source else ""
        return f"batch row {row} (prompt index {sample.prompt_id}{source}, response {sample.text!r:.80})"

    def __call__(self, samples: Sequence[Any]) -> None:
        """Set ``reward`` and ``correct`` of every sample.

        The batch is split into one chunk per worker (one task each: no per-sample thread hop);
        while waiting, the row being scored is watched, and one that runs past ``timeout_s`` is an
        error naming it.

        Raises:
            RewardError: naming the reward and the row.
        """
        name = getattr(self.reward, "name", type(self.reward).__name__)
        k = min(self.workers, max(1, len(samples)))
        chunks = [list(range(i, len(samples), k)) for i in range(k)]
        jobs = []
        for rows in chunks:
            progress: dict = {"current": None}
            part = [samples[r] for r in rows]
            jobs.append(
                (
                    rows,
                    progress,
                    self._executor().submit(_score_chunk, self.reward, part, rows, progress),
                )
            )
        poll = min(1.0, self.timeout_s / 4)
        for rows, progress, future in jobs:
            while True:
                try:
                    results = future.result(timeout=poll)
                    break
                except FutureTimeout:
                    current = progress.get("current")
                    if current is not None and time.monotonic() - current[1] > self.timeout_s:
                        self._pool = None  # the stuck thread is abandoned; later: a fresh pool
                        row = current[0]
                        raise RewardError(
                            f"reward {name} took more than {self.timeout_s:g} s on "
                            f"{self._where(samples[row], row)}; its thread is abandoned (Python "
                            "cannot stop it): make the reward faster or raise its timeout"
                        ) from None
            for row, (value, correct, err) in zip(rows, results):
                sample = samples[row]
                if err is not None:
                    raise RewardError(
                        f"reward {name} raised {type(err).__name__}: {err} on {self._where(sample, row)}"
                    ) from err
                if isinstance(value, bool) or not isinstance(value, numbers.Real):
                    raise RewardError(
                        f"reward {name} returned {value!r} ({type(value).__name__}) for "
                        f"{self._where(sample, row)}; a reward must be a real number (int or float; "
                        "not a bool, a string, a list or None)"
                    )
                sample.reward, sample.correct = float(value), correct

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
