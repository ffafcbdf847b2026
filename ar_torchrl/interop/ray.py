"""Rollouts on Ray through TorchRL: engines in ``RayLLMCollector`` actors, weights from the learner.

TorchRL 0.14.1 scales its LLM loop past one machine with :class:`~torchrl.collectors.llm.RayLLMCollector`
(an ``LLMCollector`` as a Ray actor: the env and the engine wrapper are built *on the worker*). This
module puts several of them behind one object and gives them this library's critic:

- :class:`RayRollout`: ``num_workers`` ``RayLLMCollector`` actors (one CPU or GPU each; Ray's
  ``SPREAD`` strategy places them on different nodes), each running TorchRL's env and a TorchRL LLM
  wrapper built by your factories, the library's :class:`~ar_torchrl.interop.TokenTrajectory` as
  postproc. :meth:`RayRollout.collect` asks every worker for a batch at once and returns them as one
  ``[B, L]`` token trajectory (:func:`~ar_torchrl.data.pad_trajectories`). A worker that dies is named
  (:class:`RolloutWorkerLost`: its index, node and Ray's error) and the rollout stops cleanly.
- The weight push, TorchRL's scheme pattern (``torchrl/weight_update/_ray.py``'s ``RayTransport``):
  the learner (rank 0 of a torchrun job, or one process) opens a **dedicated** gloo process group of
  its own (a fresh ``TCPStore``; the learner's default group, FSDP2's, is never touched) with the
  workers as ranks ``1..N``; each push sends a version tensor and then every policy tensor in a fixed
  order (``value_head.*`` never: :func:`~ar_torchrl.weight_sync.named_policy_tensors`), one tensor in
  flight at a time, so a lazy :class:`~ar_torchrl.distributed.weights.FullTensorStream` (FSDP2's
  all-gathered tensors) is published without ever holding the model twice. On each worker,
  :class:`GroupWeightReceiver` receives them and loads them through
  :class:`~ar_torchrl.backends.torchrl.TorchRLBackend`'s sender: ``TransformersWrapper`` in place
  (names and shapes checked), ``vLLMWrapper`` through TorchRL's double buffer, ``SGLangWrapper`` into
  the worker's server (this library's senders).

Why a ``WeightUpdaterBase``: ``RayLLMCollector`` in TorchRL 0.14.1 takes no ``weight_sync_schemes``
(its remote ``LLMCollector`` is built with a ``weight_updater`` only), so the receiving end is that
collector's weight updater; ``RayLLMCollector.init_updater`` and ``update_policy_weights_`` are the
remote calls that drive it. TorchRL marks the base deprecated for its other collectors; the warning
raised when the class is defined is silenced there (``tests/interop/test_ray_rollout.py`` pins that
``RayLLMCollector`` still has no scheme argument, so the switch is noticed when TorchRL adds one).

``ray`` is optional (``pip install ar_torchrl[ray]``); it is imported when a :class:`RayRollout` is
built. docs/scale-out.md shows the multi-node launch.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import uuid
import warnings
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

from ar_torchrl.weight_sync.errors import WeightSyncError

__all__ = [
    "GroupWeightReceiver",
    "RayRollout",
    "RayWeightPublisher",
    "RolloutWorkerLost",
    "local_cluster",
    "tensor_spec",
]

logger = logging.getLogger(__name__)

#: ``(hf_name, shape, dtype)`` of each policy tensor, in the order every push sends them.
TensorSpec = list[tuple[str, tuple[int, ...], torch.dtype]]

_VERSION_TAG = 0  # the version tensor; policy tensor i travels with tag i + 1


def tensor_spec(named_tensors: Iterable[tuple[str, Tensor]]) -> TensorSpec:
    """The names, (global) shapes and dtypes of a policy's tensors, in iteration order.

    Reads only metadata: with FSDP2's DTensors the shapes are the full ones and nothing is gathered.

    Example:
        >>> tensor_spec([("a", torch.zeros(2, 3)), ("b", torch.ones(4, dtype=torch.bfloat16))])
        [('a', (2, 3), torch.float32), ('b', (4,), torch.bfloat16)]
    """
    return [(name, tuple(t.shape), t.dtype) for name, t in named_tensors]


class RolloutWorkerLost(RuntimeError):
    """A Ray rollout worker died (its process was killed, its node left the cluster, ...).

    ``worker`` is the worker's index in :class:`RayRollout`, ``node`` the Ray node id it ran on.
    The rollout is stopped when this is raised: its other workers are shut down, and a run restarts
    from its last checkpoint.

    Example:
        >>> err = RolloutWorkerLost(1, "9c1f", "ActorDiedError: the actor died unexpectedly")
        >>> (err.worker, err.node)
        (1, '9c1f')
        >>> print(err)
        rollout worker 1 (Ray node 9c1f) is lost: ActorDiedError: the actor died unexpectedly; the rollout was stopped (its other workers shut down): restart the run from its last checkpoint
    """

    def __init__(self, worker: int, node: str, reason: str) -> None:
        super().__init__(
            f"rollout worker {worker} (Ray node {node}) is lost: {reason}; the rollout was stopped "
            "(its other workers shut down): restart the run from its last checkpoint"
        )
        self.worker = worker
        self.node = node


# TorchRL deprecates subclassing WeightUpdaterBase in favour of weight-sync schemes, which
# RayLLMCollector 0.14.1 cannot take (module docstring): the one place this library subclasses it.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from torchrl.collectors import WeightUpdaterBase

    class GroupWeightReceiver(WeightUpdaterBase):
        """The worker's end of :class:`RayWeightPublisher`: the ``weight_updater`` of each remote
        ``LLMCollector`` of a :class:`RayRollout` (built on the learner, pickled to the worker).

        ``init(...)`` (``RayLLMCollector.init_updater``) joins the dedicated process group as rank
        ``rank`` and allocates one receive buffer per policy tensor of ``spec``; each
        ``update_policy_weights_()`` then receives the version and the tensors from rank 0 and loads
        them into the collector's policy through :class:`~ar_torchrl.backends.torchrl.TorchRLBackend`
        (its sender checks names and shapes before applying anything). ``policy_version`` is the
        last version loaded (``None`` before the first).

        Example:
            >>> receiver = GroupWeightReceiver()
            >>> receiver.policy_version is None, receiver.all_worker_ids() is None
            (True, True)
            >>> receiver.push_weights()  # not connected yet
            Traceback (most recent call last):
            ...
            ar_torchrl.weight_sync.errors.WeightSyncError: GroupWeightReceiver: not connected to the learner's weight group; RayWeightPublisher connects it (RayLLMCollector.init_updater) before the first push
        """

        def __init__(self) -> None:
            self._group = None
            self._store = None
            self._buffers: list[Tensor] | None = None
            self._names: list[str] | None = None
            self._engine = None
            self._pending_version: int | None = None
            self.policy_version: int | None = None

        def __getstate__(self):
            # Only the configuration travels to the worker: no group, store, buffers or engine.
            state = self.__dict__.copy()
            state.update(_group=None, _store=None, _buffers=None, _engine=None)
            state.pop("_collector_wrs", None)
            return state

        def init(
            self,
            *,
            address: str,
            port: int,
            prefix: str,
            rank: int,
            world_size: int,
            spec: TensorSpec,
            timeout_s: float,
        ) -> None:
            """Join the weight group as ``rank`` of ``world_size`` and allocate the buffers (the
            learner checked ``spec`` against this worker's engine first: ``_spec_mismatch``)."""
            timeout = timedelta(seconds=timeout_s)
            self._store = torch.distributed.TCPStore(
                address, port, is_master=False, timeout=timeout
            )
            self._group = torch.distributed.ProcessGroupGloo(
                torch.distributed.PrefixStore(prefix, self._store), rank, world_size, timeout
            )
            self._names = [name for name, _, _ in spec]
            self._buffers = [torch.empty(shape, dtype=dtype) for _, shape, dtype in spec]
            logger.info(
                "rank %d of the weight group %s: %d policy tensors", rank, prefix, len(spec)
            )

        def _policy(self) -> Any:
            collector = self.collector
            if collector is None:
                raise WeightSyncError(
                    f"{type(self).__name__}: no collector registered; pass it as "
                    "RayLLMCollector(weight_updater=...)",
                    partial=False,
                )
            return collector.policy

        def _get_server_weights(self) -> dict[str, Tensor]:
            if self._group is None:
                raise WeightSyncError(
                    f"{type(self).__name__}: not connected to the learner's weight group; "
                    "RayWeightPublisher connects it (RayLLMCollector.init_updater) before the "
                    "first push",
                    partial=False,
                )
            version = torch.zeros(1, dtype=torch.int64)
            self._group.recv([version], 0, _VERSION_TAG).wait()
            for i, buffer in enumerate(self._buffers):
                self._group.recv([buffer], 0, i + 1).wait()
            self._pending_version = int(version)
            return dict(zip(self._names, self._buffers, strict=True))

        def _maybe_map_weights(self, server_weights: dict[str, Tensor]) -> dict[str, Tensor]:
            return server_weights

        def all_worker_ids(self) -> None:
            return None

        def _sync_weights_with_worker(
            self, *, worker_id: int | None = None, server_weights: dict[str, Tensor]
        ) -> None:
            if self._engine is None:
                from ar_torchrl.backends.torchrl import TorchRLBackend

                self._engine = TorchRLBackend(self._policy())
            version = self._pending_version
            self._engine.sync_weights(server_weights.items(), version)
            self.policy_version = version
            # the batches' policy_version (LLMCollector(track_policy_version=True)) is the
            # learner's, as TorchRL's own receivers set it (Collector._set_received_policy_version)
            # TorchRL then bumps it by one (Collector.update_policy_weights_ in
            # torchrl/collectors/_single.py ends with increment_version()).
            tracker = getattr(self.collector, "policy_version_tracker", None)
            if tracker is not None:
                tracker.version = version - 1


def _spec_mismatch(spec: TensorSpec, collector: Any) -> str | None:
    """Run on a worker (``RayRollout.run_on_workers``) before it joins the weight group: how its
    ``TransformersWrapper`` model's policy tensors differ from ``spec`` (``None``: they match, or
    a server-backed wrapper, whose sender checks against the server). A message, not an
    exception: the learner raises it, so a mismatch never leaves it waiting in the group's
    rendezvous for a worker that will not join."""
    from ar_torchrl.weight_sync import named_policy_tensors

    model = getattr(collector.policy, "model", None)
    if not isinstance(model, torch.nn.Module):
        return None
    have = {name: tuple(t.shape) for name, t in named_policy_tensors(model)}
    want = {name: tuple(shape) for name, shape, _ in spec}
    if have == want:
        return None
    unknown = sorted(set(want) - set(have))[:5]
    missing = sorted(set(have) - set(want))[:5]
    wrong = [(n, want[n], have[n]) for n in want if n in have and want[n] != have[n]]
    return (
        f"learner-only tensors {unknown}, worker-only {missing}, shapes (name, learner, worker) "
        f"{wrong[:3]}"
    )


class RayWeightPublisher:
    """The learner's end of the weight push to :class:`RayRollout`'s workers (module docstring).

    Built by :meth:`RayRollout.connect`; call it on the learner process that drives the rollout
    (rank 0 under torchrun: the other ranks drain their ``FullTensorStream``). ``publish`` sends
    the version and the tensors rank by rank, one tensor at a time, while every worker's
    ``update_policy_weights_`` call receives and loads them; it returns once every worker has
    loaded the new weights.

    Args:
        rollout: the workers.
        spec: :func:`tensor_spec` of the policy tensors (names, full shapes, dtypes) every push
            sends, in this order.
        address: where the workers reach this process (default: Ray's address of this node).
        timeout_s: how long any side of the group waits for the other.
    """

    def __init__(
        self,
        rollout: RayRollout,
        spec: TensorSpec,
        *,
        address: str | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        if not spec:
            raise ValueError("RayWeightPublisher: the policy has no tensors to publish (spec=[])")
        import ray

        self.spec = list(spec)
        differ = rollout.run_on_workers(functools.partial(_spec_mismatch, self.spec))
        for worker, message in enumerate(differ):
            if message is not None:
                raise WeightSyncError(
                    f"RayWeightPublisher: worker {worker}'s model and the learner's policy differ "
                    f"({message}); build the workers' engines from the learner's architecture",
                    partial=False,
                )
        self.rollout = rollout
        self.timeout_s = float(timeout_s)
        self.address = address or ray.util.get_node_ip_address()
        self.world_size = rollout.num_workers + 1
        self.prefix = f"ar_torchrl/weights/{uuid.uuid4().hex}"
        timeout = timedelta(seconds=self.timeout_s)
        self._store = torch.distributed.TCPStore(
            self.address, 0, is_master=True, timeout=timeout, wait_for_workers=False
        )
        joined = rollout._each(
            lambda i, c: c.init_updater(
                address=self.address,
                port=self._store.port,
                prefix=self.prefix,
                rank=i + 1,
                world_size=self.world_size,
                spec=self.spec,
                timeout_s=self.timeout_s,
            ),
            wait=False,
        )
        self._group = torch.distributed.ProcessGroupGloo(
            torch.distributed.PrefixStore(self.prefix, self._store), 0, self.world_size, timeout
        )
        rollout._gather(joined)
        logger.info(
            "weight group %s: learner + %d workers at %s:%d",
            self.prefix,
            rollout.num_workers,
            self.address,
            self._store.port,
        )

    def publish(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Send ``version`` and the policy tensors (``value_head.*`` dropped) to every worker.

        Raises:
            WeightSyncError: a tensor's name or shape is not the ``spec``'s (nothing more is
                sent), or a worker's engine refused the tensors (the worker is named); the rollout
                is shut down (its engines may hold part of the push, or no longer agree).
            RolloutWorkerLost: a worker died during the push.
        """
        from ar_torchrl.weight_sync import policy_only

        if self._group is None:
            raise WeightSyncError("RayWeightPublisher is closed", partial=False)
        receiving = self.rollout._each(lambda _, c: c.update_policy_weights_(), wait=False)
        ranks = range(1, self.world_size)
        try:
            version_t = torch.tensor([int(version)], dtype=torch.int64)
            for work in [self._group.send([version_t], r, _VERSION_TAG) for r in ranks]:
                work.wait()
            sent = 0
            for i, (name, tensor) in enumerate(policy_only(named_tensors)):
                want = self.spec[i] if i < len(self.spec) else None
                if want is None or name != want[0] or tuple(tensor.shape) != want[1]:
                    raise WeightSyncError(
                        f"RayWeightPublisher: tensor {i} is {name!r} {tuple(tensor.shape)}, the "
                        f"spec's is {want[:2] if want else 'nothing (more tensors than spec)'}; "
                        "publish the same named_policy_tensors the rollout was connected with",
                        partial=True,
                    )
                payload = tensor.detach().to("cpu", want[2]).contiguous()
                for work in [self._group.send([payload], r, i + 1) for r in ranks]:
                    work.wait()
                sent += 1
            if sent != len(self.spec):
                raise WeightSyncError(
                    f"RayWeightPublisher: {sent} tensors sent, the spec has {len(self.spec)}",
                    partial=True,
                )
        except BaseException:
            # the workers wait in a receive that will not complete: stop them (their update calls
            # then fail at once instead of after the group's timeout) and stop the rollout
            self.rollout.shutdown(graceful=False)
            with contextlib.suppress(Exception):
                self.rollout._gather(receiving)
            raise
        self._loaded(receiving, version)

    def _loaded(self, receiving: list[concurrent.futures.Future], version: int) -> None:
        """Wait for every worker's load; one that failed (its engine refused the tensors) stops
        the rollout, named in a :class:`WeightSyncError` (the engines no longer agree)."""
        import ray

        for worker, future in enumerate(receiving):
            try:
                future.result()
            except ray.exceptions.RayActorError:
                break  # a lost worker: _gather below names it
            except Exception as err:
                lines = [line for line in str(err).strip().splitlines() if line.strip()]
                self.rollout.shutdown(graceful=False)
                raise WeightSyncError(
                    f"RayWeightPublisher: worker {worker} failed to load version {version}: "
                    f"{lines[-1] if lines else type(err).__name__}; the rollout was stopped",
                    partial=True,
                ) from err
        self.rollout._gather(receiving)

    def close(self) -> None:
        """Drop the group and the store (idempotent)."""
        self._group = None
        self._store = None


#: Batches a RayRollout worker's collector is sized for (never reached; see RayRollout.__init__).
_NEVER_REACHED_BATCHES = 2**40


class RayRollout:
    """``num_workers`` TorchRL ``RayLLMCollector`` actors, collected together (module docstring).

    Args:
        make_env: ``make_env(worker_index) -> EnvBase``, called on the worker (a picklable
            function: a module-level function or a ``functools.partial`` of one).
        make_policy: ``make_policy() -> TorchRL LLM wrapper``, called on the worker.
        num_workers: how many actors.
        dialog_turns_per_batch: each worker's batch size (dialog turns).
        postproc: each worker's ``LLMCollector`` postproc, e.g. ``TokenTrajectory(...)``.
        num_cpus, num_gpus: each actor's Ray resources.
        spread: place the actors with Ray's ``SPREAD`` scheduling strategy (different nodes).
        ray_init_config: ``ray.init`` keywords when Ray is not initialised yet (e.g.
            ``{"address": "auto"}`` on a cluster started with ``ray start``).

    Example:
        >>> import ray, torch
        >>> from ar_torchrl.interop.ray import RayRollout
        >>> from ar_torchrl.models import build_tiny_qwen3
        >>> from ar_torchrl.weight_sync import named_policy_tensors
        >>> def make_env(i): ...      # TorchRL's ChatEnv/DatasetChatEnv with its transforms
        >>> def make_policy(): ...    # TransformersWrapper / SGLangWrapper / vLLMWrapper
        >>> rollout = RayRollout(make_env, make_policy, num_workers=2, dialog_turns_per_batch=8,
        ...                      postproc=TokenTrajectory(pad_token_id=0))  # doctest: +SKIP
        >>> rollout.connect(named_policy_tensors(model))                # doctest: +SKIP
        >>> data = rollout.collect()           # [16, L] token trajectory  # doctest: +SKIP
        >>> rollout.publish(named_policy_tensors(model), version=1)     # doctest: +SKIP

        tests/interop/test_ray_rollout.py runs it on a local two-node Ray cluster.
    """

    def __init__(
        self,
        make_env: Callable[[int], Any],
        make_policy: Callable[[], Any],
        *,
        num_workers: int,
        dialog_turns_per_batch: int,
        postproc: Callable[[TensorDictBase], TensorDictBase] | None = None,
        num_cpus: float = 1,
        num_gpus: float | None = None,
        spread: bool = True,
        ray_init_config: dict[str, Any] | None = None,
        track_policy_version: bool = True,
    ) -> None:
        if int(num_workers) < 1:
            raise ValueError(f"RayRollout: num_workers must be >= 1, got {num_workers}")
        try:
            import ray
        except ImportError as err:
            raise ImportError(
                "RayRollout needs Ray: pip install 'ar_torchrl[ray]' (ray>=2.40)"
            ) from err
        from torchrl.collectors.llm import RayLLMCollector

        if not ray.is_initialized():
            ray.init(**(ray_init_config or {}))
        self.num_workers = int(num_workers)
        remote_config: dict[str, Any] = {"num_cpus": num_cpus, "max_restarts": 0}
        if num_gpus is not None:
            remote_config["num_gpus"] = num_gpus
        if spread:
            remote_config["scheduling_strategy"] = "SPREAD"
        self.collectors = [
            RayLLMCollector(
                functools.partial(make_env, i),
                policy_factory=make_policy,
                dialog_turns_per_batch=dialog_turns_per_batch,
                # TorchRL 0.14.1: a non-terminating collector (total_dialog_turns=-1, total_frames
                # inf) has a __len__ that returns inf, so bool(collector) raises TypeError; Ray
                # evaluates the actor's truth when it stores a task's exception, so any error in
                # a worker killed its actor instead of reaching the learner. A finite total that
                # is never reached keeps __len__ an int (tests/interop/test_ray_rollout.py pins both)
                total_dialog_turns=dialog_turns_per_batch * _NEVER_REACHED_BATCHES,
                postproc=postproc,
                weight_updater=GroupWeightReceiver(),
                remote_config=dict(remote_config),
                track_policy_version=track_policy_version,
            )
            for i in range(self.num_workers)
        ]
        from ar_torchrl.data import pad_trajectories

        self._collate = getattr(postproc, "collate_fn", pad_trajectories)
        self.nodes = ["?"] * self.num_workers
        self.publisher: RayWeightPublisher | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=self.num_workers)
        self._closed = False
        where = self._each(lambda i, c: _actor_call(c, _where))
        #: each worker's Ray node id (12 hex digits) and process id
        self.nodes, self.pids = [n for n, _ in where], [p for _, p in where]

    # ------------------------------------------------------------------ running on every worker
    def _each(self, fn: Callable[[int, Any], Any], *, wait: bool = True):
        """``fn(i, collector)`` for every worker at once (threads: the collector calls block)."""
        if self._closed:
            raise RuntimeError("RayRollout is shut down")
        futures = [self._pool.submit(fn, i, c) for i, c in enumerate(self.collectors)]
        return self._gather(futures) if wait else futures

    def _gather(self, futures: Sequence[concurrent.futures.Future]) -> list[Any]:
        """The results in worker order; a dead worker stops the rollout (:class:`RolloutWorkerLost`)."""
        import ray

        results, lost = [], None
        for i, future in enumerate(futures):
            try:
                results.append(future.result())
            except ray.exceptions.RayActorError as err:
                lost = lost or (i, err)
                results.append(None)
        if lost is not None:
            i, err = lost
            reason = f"{type(err).__name__}: {str(err).strip().splitlines()[0]}"
            logger.error("rollout worker %d on node %s is lost: %s", i, self.nodes[i], reason)
            self.shutdown(graceful=False)
            raise RolloutWorkerLost(i, self.nodes[i], reason) from err
        return results

    # ------------------------------------------------------------------ the public surface
    def connect(
        self, named_tensors: Iterable[tuple[str, Tensor]], *, version: int = 0, **kwargs
    ) -> RayWeightPublisher:
        """Open the weight group and push ``named_tensors`` as ``version`` (the engines then
        sample from the learner's weights). ``kwargs`` go to :class:`RayWeightPublisher`."""
        from ar_torchrl.weight_sync import policy_only

        tensors = list(policy_only(named_tensors))
        self.publisher = RayWeightPublisher(self, tensor_spec(tensors), **kwargs)
        self.publisher.publish(tensors, version)
        return self.publisher

    def publish(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Push new policy weights to every worker (:meth:`RayWeightPublisher.publish`)."""
        if self.publisher is None:
            raise RuntimeError(
                "RayRollout.publish: call connect(named_policy_tensors(model)) first"
            )
        self.publisher.publish(named_tensors, version)

    def collect(self) -> TensorDict:
        """One batch from every worker at once, as one token trajectory ``[sum B_i, L]``
        (the postproc's ``collate_fn``, :attr:`TokenTrajectory.collate_fn`, else
        :func:`~ar_torchrl.data.pad_trajectories`; a postproc that returns something else gets the
        list of per-worker batches)."""

        batches = self.collect_each()
        if all(isinstance(b, TensorDictBase) and "loss_mask" in b.keys() for b in batches):
            return self._collate(batches)
        return batches

    def collect_each(self) -> list[Any]:
        """One batch from every worker at once, in worker order."""
        return self._each(lambda _, c: c.next())

    def run_on_workers(self, fn: Callable[[Any], Any]) -> list[Any]:
        """``fn(remote LLMCollector)`` inside every worker's actor, at once; the results in worker
        order (``fn`` must be picklable; e.g. read ``collector.policy.model``'s weights)."""
        return self._each(lambda _, c: _actor_call(c, fn))

    @property
    def policy_versions(self) -> list[int | None]:
        """Each worker's ``LLMCollector`` policy version."""
        return self._each(lambda _, c: c.policy_version)

    def shutdown(self, *, graceful: bool = True, timeout_s: float = 30.0) -> None:
        """Stop every worker and kill its actor (idempotent; dead workers skipped).

        ``graceful``: first ask each collector to shut down (its env and engine), waiting at most
        ``timeout_s`` (a call queues behind the actor's running one); ``False``: kill at once (what
        the error paths do: a worker may be blocked in a receive that will not complete).
        """
        import ray

        if self._closed:
            return
        self._closed = True
        if self.publisher is not None:
            self.publisher.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if graceful:
            pending = [_actor(c).shutdown.remote() for c in self.collectors]
            with contextlib.suppress(Exception):
                ray.wait(pending, num_returns=len(pending), timeout=timeout_s)
        for c in self.collectors:
            with contextlib.suppress(Exception):
                ray.kill(_actor(c), no_restart=True)
        # Drop them while Ray is up: a RayLLMCollector's __del__ calls its actor again, which after
        # ray.shutdown() would start a new local Ray instance (seen: it hangs the interpreter's exit).
        self.collectors.clear()

    def __enter__(self) -> RayRollout:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _actor(collector: Any) -> Any:
    """The Ray actor handle of a ``RayLLMCollector`` (TorchRL 0.14.1 keeps it as ``_collector``
    and has no public accessor; tests/interop/test_ray_rollout.py pins the attribute)."""
    return collector._collector


def _actor_call(collector: Any, fn: Callable[[Any], Any]) -> Any:
    """``fn(remote LLMCollector)`` run inside the worker's actor."""
    import ray

    return ray.get(_actor(collector).__ray_call__.remote(fn))


def _where(_collector: Any) -> tuple[str, int]:
    """(Ray node id, process id) of the actor this runs in."""
    import os

    import ray

    return ray.get_runtime_context().get_node_id()[:12], os.getpid()


@contextlib.contextmanager
def local_cluster(workers: int, *, cpus_per_worker: int = 1):
    """A Ray cluster on this machine, connected to and stopped on exit: a head node without CPUs
    and ``workers`` nodes of ``cpus_per_worker`` CPUs (each its own raylet, as on separate
    machines), so a :class:`RayRollout` of ``workers`` one-CPU workers puts one on each node.

    Yields ``ray.cluster_utils.Cluster``. Every process it started ends with the block (Ray's own
    shutdown; tests/interop/test_ray_rollout.py checks that none is left).
    """
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False}
    )
    try:
        for _ in range(workers):
            cluster.add_node(num_cpus=cpus_per_worker)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
