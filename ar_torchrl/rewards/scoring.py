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
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

__all__ = ["RewardError", "RewardScorer"]


class RewardError(RuntimeError):
    """A reward raised, returned a non-number, or missed its deadline (the message names the row)."""


def _score_one(reward: Any, sample: Any) -> tuple[Any, bool]:
    value = reward.score(sample)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return value, False
    return value, bool(reward.correct(sample, float(value)))


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

        Raises:
            RewardError: naming the reward and the row.
        """
        name = getattr(self.reward, "name", type(self.reward).__name__)
        futures = [self._executor().submit(_score_one, self.reward, s) for s in samples]
        for row, (sample, future) in enumerate(zip(samples, futures)):
            try:
                value, correct = future.result(timeout=self.timeout_s)
            except FutureTimeout:
                self._pool = None  # the stuck thread is abandoned; later calls get a fresh pool
                raise RewardError(
                    f"reward {name} took more than {self.timeout_s:g} s on {self._where(sample, row)}"
                    "; its thread is abandoned (Python cannot stop it): make the reward faster or "
                    "raise its timeout"
                ) from None
            except Exception as err:
                raise RewardError(
                    f"reward {name} raised {type(err).__name__}: {err} on {self._where(sample, row)}"
                ) from err
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise RewardError(
                    f"reward {name} returned {value!r} ({type(value).__name__}) for "
                    f"{self._where(sample, row)}; a reward must be a real number (int or float; not "
                    "a bool, a string, a list or None)"
                )
            sample.reward, sample.correct = float(value), correct

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
