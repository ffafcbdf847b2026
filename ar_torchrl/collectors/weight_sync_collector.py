"""WeightSyncCollector: iterate token-trajectory batches from an LLMEnv, re-syncing weights after updates.

Usage (the PPO loop)::

    collector = WeightSyncCollector(env, model, total_batches=100, mode="async", max_policy_lag=1)
    for batch in collector:          # batch["policy_version"] says which weights produced it
        ...                          # anchors, advantages, PPO epochs
        collector.update_policy_weights_()   # push named_policy_tensors(model), version += 1
    collector.shutdown()

The backend owns the weight version (``collector.policy_version`` reads it). ``mode="sync"``
generates each batch when it is asked for, with the latest weights (lag 0). ``mode="async"``
starts generating the next batch in one background thread as soon as a batch is handed out, so
generation overlaps the trainer's update ("one-step off-policy"). A lock orders generation and
syncs: a sync issued after a batch was handed out waits for the prefetch, so a batch is always
produced by exactly one weight version. A prefetched batch whose version is more than
``max_policy_lag`` behind the backend when it is handed out (the trainer synced more than once per
batch) is dropped, counted in ``stale_batches_dropped``, logged, and regenerated (blocking).

With ``dynamic_sampling=True`` each batch is gathered over up to ``max_sampling_rounds`` rounds,
keeping only groups with a reward spread (DAPO, see :mod:`ar_torchrl.collectors.sampling`);
``last_batch_stats`` describes every sample generated for the last batch (unbiased reward and
accuracy, groups generated / kept / dropped).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal

from tensordict import TensorDict, TensorDictBase
from torch import Tensor, nn
from torchrl.collectors import BaseCollector

from ar_torchrl.collectors.sampling import batch_policy_version, gather_batch
from ar_torchrl.envs.llm_env import LLMEnv
from ar_torchrl.weight_sync.errors import WeightSyncError
from ar_torchrl.weight_sync.names import as_named_tensors

__all__ = ["WeightSyncCollector", "batch_policy_version"]

logger = logging.getLogger(__name__)


class WeightSyncCollector(BaseCollector):
    """Iterable collector over :class:`~ar_torchrl.envs.LLMEnv` batches with versioned weight sync.

    Args:
        env: the environment (its ``backend`` receives the weights and owns the version).
        policy_model: the trainer's HF model (a ``value_head`` is never sent).
        total_batches: batches per pass over the collector (``None``: never stop). As with
            TorchRL's ``total_frames``, it counts from the start of iteration, so a resumed run
            asks for the batches it has left; ``batches_yielded`` is the lifetime counter saved in
            ``state_dict``.
        mode: ``"sync"`` or ``"async"`` (generate the next batch in the background).
        max_policy_lag: in async mode, the most versions a handed-out batch may lag (``>= 1``).
        dynamic_sampling: keep only groups with a reward spread, refilling over several rounds.
        max_sampling_rounds: most rounds per batch with ``dynamic_sampling`` (then the batch holds
            fewer groups, possibly none: ``batch.shape[0] == 0``; skip the update).
        critic_flat_groups: with ``dynamic_sampling``, keep the zero-spread groups for the value
            loss only (the batch's ``policy_mask``; see :func:`gather_batch`).

    Example:
        >>> from ar_torchrl.models.tiny import build_char_tokenizer, build_tiny_qwen3
        >>> from ar_torchrl.backends import SamplingParams, TransformersBackend
        >>> from ar_torchrl.data.datasets import arithmetic_dataset
        >>> tok = build_char_tokenizer(); model = build_tiny_qwen3(len(tok))
        >>> env = LLMEnv(arithmetic_dataset(8), tok, TransformersBackend(model), num_samples=2,
        ...              prompts_per_batch=1, sampling=SamplingParams(max_new_tokens=3))
        >>> collector = WeightSyncCollector(env, model, total_batches=2)
        >>> versions = []
        >>> for batch in collector:
        ...     versions.append(batch_policy_version(batch))
        ...     collector.update_policy_weights_()
        >>> versions, collector.policy_version, collector.last_batch_stats["groups_generated"]
        ([0, 1], 2, 1.0)
    """

    def __init__(
        self,
        env: LLMEnv,
        policy_model: nn.Module,
        *,
        total_batches: int | None = None,
        mode: Literal["sync", "async"] = "sync",
        max_policy_lag: int = 1,
        dynamic_sampling: bool = False,
        max_sampling_rounds: int = 4,
        critic_flat_groups: bool = False,
    ) -> None:
        super().__init__()
        _check_args(env, mode, max_policy_lag, total_batches, max_sampling_rounds)
        self.env, self.policy_model = env, policy_model
        self.total_batches, self.mode, self.max_policy_lag = total_batches, mode, max_policy_lag
        self.dynamic_sampling, self.max_sampling_rounds = dynamic_sampling, max_sampling_rounds
        if critic_flat_groups and not dynamic_sampling:
            raise ValueError(
                "WeightSyncCollector: critic_flat_groups=True keeps the groups dynamic sampling "
                "drops for the critic; without dynamic_sampling=True no group is dropped"
            )
        self.critic_flat_groups = critic_flat_groups
        self.batches_yielded = self.stale_batches_dropped = self.last_policy_lag = 0
        self.last_batch_stats: dict[str, float] = {}
        self.frames_per_batch = self.requested_frames_per_batch = int(env.batch_size[0])
        self.total_frames = -1 if total_batches is None else total_batches * self.frames_per_batch
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._state_before_pending: dict | None = None
        self._restored_version: int | None = None

    @property
    def policy_version(self) -> int:
        """The weight version the backend serves (the backend owns it)."""
        return self.env.backend.policy_version

    # ------------------------------------------------------------------ batches
    def _gather(self) -> tuple[TensorDictBase, dict]:
        return gather_batch(
            self.env,
            dynamic=self.dynamic_sampling,
            max_rounds=self.max_sampling_rounds,
            critic_flat_groups=self.critic_flat_groups,
        )

    def _collect(self) -> tuple[TensorDictBase, dict]:
        with self._lock:
            return self._gather()

    def _collect_then_release(self) -> tuple[TensorDictBase, dict]:
        try:
            return self._gather()
        finally:
            self._lock.release()

    def _prefetch(self) -> None:
        """Start the next batch in the background with the weights of *now*.

        The lock is taken here, in the trainer's thread, and released by the worker when the batch
        is done: a weight sync issued right after this call always waits for the batch, so the
        batch's version is deterministic (the version at hand-out of the previous batch).
        """
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout")
        self._lock.acquire()
        try:
            self._state_before_pending = self.env.state_dict()
            self._pending = self._executor.submit(self._collect_then_release)
        except BaseException:
            self._lock.release()
            raise

    def _next_batch(self) -> tuple[TensorDictBase, dict]:
        if self._pending is None:
            return self._collect()
        (batch, stats), self._pending, self._state_before_pending = (
            self._pending.result(),
            None,
            None,
        )
        lag = self.policy_version - batch_policy_version(batch) if batch.shape[0] else 0
        if lag > self.max_policy_lag:
            self.stale_batches_dropped += 1
            logger.warning(
                "WeightSyncCollector: dropped a prefetched batch of version %d (backend at %d, "
                "max_policy_lag=%d; %d dropped so far); regenerating",
                self.policy_version - lag,
                self.policy_version,
                self.max_policy_lag,
                self.stale_batches_dropped,
            )
            return self._collect()
        return batch, stats

    def iterator(self) -> Iterator[TensorDictBase]:
        """Yield token-trajectory batches until ``total_batches`` (stats in ``last_batch_stats``)."""
        if self._restored_version is not None:
            self.resync_policy_weights_()
        produced = 0
        while self.total_batches is None or produced < self.total_batches:
            batch, self.last_batch_stats = self._next_batch()
            if batch.shape[0]:
                self.last_policy_lag = self.policy_version - batch_policy_version(batch)
            produced += 1
            self.batches_yielded += 1
            if self.mode == "async" and (
                self.total_batches is None or produced < self.total_batches
            ):
                self._prefetch()
            yield batch

    # ------------------------------------------------------------------ weights
    def update_policy_weights_(
        self, policy_or_weights: nn.Module | Iterable[tuple[str, Tensor]] | None = None, **kwargs
    ) -> None:
        """Push the policy to the backend as version ``policy_version + 1``.

        Waits for an in-flight background generation first. The backend changes its version only
        if the sync succeeded.

        Args:
            policy_or_weights: ``None`` (``policy_model``), another model, or the weights
                themselves: ``(hf_name, tensor)`` pairs (or a name -> tensor mapping), consumed
                lazily, e.g. the :class:`~ar_torchrl.distributed.FullTensorStream` an FSDP rank 0
                passes (:func:`~ar_torchrl.distributed.push_weights`). Converted on the fly to the
                backend's ``weight_dtype``.
            **kwargs: TorchRL's other arguments (``worker_ids``, ...) are not supported.

        Raises:
            WeightSyncError: the backend rejected or failed the sync; ``policy_version`` is unchanged.
            TypeError: ``policy_or_weights`` is none of the above, or an FSDP-sharded model.
        """
        if kwargs:
            raise TypeError(
                f"WeightSyncCollector.update_policy_weights_: unsupported {sorted(kwargs)}"
            )
        source = self.policy_model if policy_or_weights is None else policy_or_weights
        with self._lock:
            self._push(source, self.policy_version + 1)

    def resync_policy_weights_(
        self, weights: nn.Module | Iterable[tuple[str, Tensor]] | None = None
    ) -> None:
        """Push the trainer's weights again without a new version number.

        After :meth:`load_state_dict` (resume) this pushes the restored weights under the restored
        version, so the backend serves what the checkpoint holds (iteration does it by itself if it
        was not called); otherwise it re-sends the current version (e.g. after a failed sync).
        ``weights``: as ``policy_or_weights`` of :meth:`update_policy_weights_`.
        """
        version = self.policy_version if self._restored_version is None else self._restored_version
        with self._lock:
            self._push(self.policy_model if weights is None else weights, version)
        self._restored_version = None

    def _push(self, source: nn.Module | Iterable, version: int) -> None:
        backend = self.env.backend
        named = as_named_tensors(source, dtype=backend.weight_dtype, where=type(self).__name__)
        try:
            backend.sync_weights(named, version)
        except WeightSyncError as err:
            logger.error("WeightSyncCollector: %s", err)
            raise

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self, timeout: float | None = None, close_env: bool = False) -> None:
        """Wait for (and discard) an in-flight batch, stop the thread; optionally close the backend."""
        if self._pending is not None:
            try:
                self._pending.result(timeout=timeout)
                logger.info("WeightSyncCollector: discarded 1 prefetched batch at shutdown")
            except Exception as err:  # already shutting down (possibly because of this error)
                logger.warning("WeightSyncCollector: the in-flight batch failed: %s", err)
            if self._state_before_pending is not None:  # rewind so the batch is not lost on resume
                self.env.load_state_dict(self._state_before_pending)
            self._pending = self._state_before_pending = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if close_env:
            self.env.backend.close()

    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        """Reseed the env's prompt order."""
        self.env.set_seed(seed)
        return seed

    def state_dict(self, *, include_pending: bool = False) -> dict:
        """Version, counters and the env's data position (tensors and plain data only).

        Args:
            include_pending: in async mode, wait for the batch being generated in the background
                and save it (a dict of tensors, with its sampling stats) with the env's position
                *after* it. A collector restored from this state hands that exact batch out first,
                with its original lag (1), so an async run resumes exactly as it would have
                continued. Without it the state is the env's position *before* the prefetched
                batch: a resumed run regenerates that batch with the restored (newer) weights,
                i.e. with lag 0 and other samples.
        """
        state = {
            "policy_version": self.policy_version,
            "batches_yielded": self.batches_yielded,
            "stale_batches_dropped": self.stale_batches_dropped,
        }
        if include_pending and self._pending is not None:
            batch, stats = self._pending.result()  # the worker released the lock: the env is idle
            state["env"] = self.env.state_dict()
            state["pending_batch"] = {
                "data": batch.to_dict(),
                "batch_size": list(batch.shape),
                "stats": stats,
            }
        else:
            state["env"] = self._state_before_pending or self.env.state_dict()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore before iterating; the restored version is pushed with the trainer's (restored)
        weights by :meth:`resync_policy_weights_` (or at the start of iteration)."""
        if self._pending is not None:
            raise RuntimeError("WeightSyncCollector.load_state_dict: shut down the collector first")
        self.env.load_state_dict(state_dict["env"])
        self._restored_version = int(state_dict["policy_version"])
        self.batches_yielded = int(state_dict["batches_yielded"])
        self.stale_batches_dropped = int(state_dict["stale_batches_dropped"])
        pending = state_dict.get("pending_batch")
        if pending is not None:  # handed out first by the next iteration (see state_dict)
            self._pending = Future()
            batch = TensorDict(pending["data"], pending["batch_size"])
            self._pending.set_result((batch, dict(pending.get("stats", {}))))

    def __len__(self) -> int:
        if self.total_batches is None:
            raise RuntimeError("WeightSyncCollector: total_batches=None has no length")
        return self.total_batches

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(mode={self.mode!r}, policy_version={self.policy_version}, "
            f"batches_yielded={self.batches_yielded}, total_batches={self.total_batches})"
        )


def _check_args(env, mode, max_policy_lag, total_batches, max_sampling_rounds) -> None:
    if mode not in ("sync", "async"):
        raise ValueError(f"WeightSyncCollector: mode must be 'sync' or 'async', got {mode!r}")
    if total_batches is not None and total_batches < 1:
        raise ValueError(
            f"WeightSyncCollector: total_batches must be >= 1 or None, got {total_batches}"
        )
    if max_sampling_rounds < 1:
        raise ValueError(
            f"WeightSyncCollector: max_sampling_rounds must be >= 1, got {max_sampling_rounds}"
        )
    if mode == "async" and max_policy_lag < 1:
        raise ValueError(
            f"WeightSyncCollector: async mode generates one batch ahead, so max_policy_lag must be "
            f">= 1 (got {max_policy_lag}); use mode='sync' for on-policy batches"
        )
    if mode == "async" and getattr(env.backend, "mode", None) == "share":
        raise ValueError(
            "WeightSyncCollector: async mode with a backend that shares the trainer's module "
            "(mode='share') would sample from weights being updated; use TransformersBackend(mode='copy')"
        )
