"""The one interface every rollout backend implements, and the engine state it owns.

A backend turns prompt token ids into sampled completions with the log-probs of the sampled tokens
(``log softmax(logits / T)`` of the unfiltered distribution, also under top-p/top-k; greedy:
``T = 1``), accepts new policy weights through the :class:`~ar_torchrl.weight_sync.WeightSender` it
holds, and releases its resources on ``close()``.

The backend is the **one owner of the weight version**: ``policy_version`` starts at 0, changes only
after a successful :meth:`GenerationBackend.sync_weights`, and is stamped on every
:class:`Completion`. Generation and sync hold the same lock, so a batch never mixes two versions;
after a sync that failed part-way (``WeightSyncError.partial``) the backend refuses to generate
until a sync succeeds.

**Partial rollouts** (``partial_rollouts = True``, on engines that support them): a sync does not
wait for a generation in flight; it interrupts it (the engine stops at the next token and returns
what each completion has so far), loads the weights, and the generation continues every unfinished
completion from its exact tokens under the new version. Each token keeps the version and the
log-prob of the weights that sampled it (``Completion.token_versions``).

**Episode caches** (``episode_cache = True``): a multi-turn caller keeps an :class:`EpisodeCache`
per batch of episodes and passes it with each turn (``generate(..., episodes=cache,
episode_ids=ids)``); the engine keeps what it computed of each episode's context (the trainside
engine: its key/value states) and the next turn prefills only what the context added since (the
tool's tokens), not the whole prefix. The cache is emptied when the weights change (a sync between
turns) and is not used with partial rollouts (a sync may come between any two tokens).
"""

from __future__ import annotations

import abc
import dataclasses
import threading
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch

from ar_torchrl.utils.checks import check_sampling_args
from ar_torchrl.weight_sync.base import WeightSender
from ar_torchrl.weight_sync.errors import WeightSyncError

__all__ = [
    "BackendCapabilities",
    "Completion",
    "ContextLengthError",
    "EpisodeCache",
    "FinishReason",
    "GenerationBackend",
    "SamplingParams",
    "validate_prompts",
]

FinishReason = Literal["stop", "length", "abort"]


class ContextLengthError(ValueError):
    """A prompt plus ``max_new_tokens`` does not fit the model's context (never truncated).

    Example:
        >>> issubclass(ContextLengthError, ValueError)
        True
    """


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. Field names follow SGLang's ``sampling_params``.

    Attributes:
        max_new_tokens: hard cap on generated tokens per completion.
        temperature: softmax temperature; ``0`` means greedy. Log-probs are those of the
            temperature-scaled, unfiltered distribution (greedy: ``T = 1``).
        top_p: nucleus sampling threshold in ``(0, 1]``.
        top_k: keep the ``k`` most likely tokens; ``-1`` disables (SGLang's convention).
        stop_token_ids: extra token ids that end a completion (the EOS id always does);
            the stop token is kept in the completion.
        seed: per-call seed for reproducible sampling (``None``: backend's own RNG stream).

    Example:
        >>> SamplingParams(max_new_tokens=8, temperature=0.0).greedy
        True
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        check_sampling_args(  # the checks of the recipe's rollout.* keys
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
        )
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Completion:
    """One sampled completion of one prompt: a trained segment of a sample
    (:mod:`ar_torchrl.data.samples`), as the trajectory builder takes it.

    Attributes:
        prompt_index: index of the prompt in the ``generate`` call.
        token_ids: generated ids, stop/EOS token included when it ended the completion.
        log_probs: ``log softmax(logits / T)[token_ids[i]]`` given the prompt and
            ``token_ids[:i]``, one per token (the first generated token included).
        finish_reason: ``"stop"`` (EOS/stop token), ``"length"`` (hit ``max_new_tokens``), ``"abort"``.
        policy_version: the backend's ``policy_version`` that produced it (stamped by the backend;
            a partial rollout: the version of its first token).
        meta: engine-specific details (e.g. SGLang's own ``finish_reason`` and request id).
        token_versions: per-token versions of a partial rollout that a weight update split
            (``None``: every token has ``policy_version``).

    Example:
        >>> c = Completion(0, [5, 2], [-0.1, -0.2], "stop")
        >>> len(c)
        2
    """

    prompt_index: int
    token_ids: list[int]
    log_probs: list[float]
    finish_reason: FinishReason
    policy_version: int = 0
    meta: dict = field(default_factory=dict)
    token_versions: list[int] | None = None

    #: a completion is a trained segment of a sample (:class:`~ar_torchrl.data.samples.Segment`)
    trained: ClassVar[bool] = True
    turn: ClassVar[int | None] = None

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.log_probs):
            raise ValueError(
                f"Completion: {len(self.token_ids)} token ids but {len(self.log_probs)} log-probs"
            )

    def __len__(self) -> int:
        return len(self.token_ids)


def validate_prompts(
    prompt_token_ids: Sequence[Sequence[int]], n: int, owner: str
) -> list[list[int]]:
    """Check ``generate`` arguments and return the prompts as lists of ints.

    Raises:
        ValueError: ``n < 1``, no prompts, or empty prompts (named by index).

    Example:
        >>> validate_prompts([[1, 2], (3,)], 2, "MyBackend")
        [[1, 2], [3]]
    """
    if n < 1:
        raise ValueError(f"{owner}.generate: n must be >= 1, got {n}")
    prompts = [list(map(int, p)) for p in prompt_token_ids]
    if not prompts:
        raise ValueError(f"{owner}.generate: got no prompts")
    empty = [i for i, p in enumerate(prompts) if not p]
    if empty:
        raise ValueError(
            f"{owner}.generate: prompts {empty[:8]} are empty; every prompt needs >= 1 token"
        )
    return prompts


@dataclass(frozen=True)
class BackendCapabilities:
    """What a rollout engine can do, declared once by its class (:attr:`GenerationBackend.capabilities`)
    and read by the recipe, the collector and the environments (never probed with ``getattr``).

    Attributes:
        partial_rollouts: ``_generate`` stops at the next token when :attr:`~GenerationBackend.interrupted`
            (a sync may interrupt a generation in flight; see the module docstring).
        memory_release: :meth:`~GenerationBackend.release_memory` / ``resume_memory`` free and restore
            the engine's (GPU) memory around an update (colocated engines).
        sampler_state: :meth:`~GenerationBackend.state_dict` holds the engine's sampling RNG, saved
            in checkpoints so that a resumed run samples what the uninterrupted one would.
        episode_cache: ``generate(..., episodes=, episode_ids=)`` keeps what the engine computed of
            each episode's context in an :class:`EpisodeCache` and the next turn continues from it
            (see the module docstring).

    Example:
        >>> BackendCapabilities(partial_rollouts=True).memory_release
        False
    """

    partial_rollouts: bool = False
    memory_release: bool = False
    sampler_state: bool = False
    episode_cache: bool = False


class EpisodeCache:
    """What an engine keeps of a batch of multi-turn episodes between their turns.

    One per batch of episodes, owned by the caller (e.g. :class:`~ar_torchrl.envs.ToolEnv`, from
    its reset to its last turn) and filled by an engine that declares
    ``capabilities.episode_cache``: ``generate(contexts, 1, sampling, episodes=cache,
    episode_ids=ids)`` continues episode ``ids[i]`` from what the cache holds of it when
    ``contexts[i]`` extends the tokens it was computed for (else, a miss, the whole context is
    prefilled), and stores the episode's new state. The states hold memory until :meth:`drop` /
    :meth:`clear` (the trainside engine: the key/value states of every kept token); the engine
    clears them when its weights changed since they were computed.

    Attributes:
        states: engine state per episode id (opaque to the caller).
        policy_version: the weights the states were computed with (set by the engine).
        reused_tokens: context tokens taken from the cache instead of prefilled, over all turns.
        prefilled_tokens: context tokens prefilled, over all turns.

    Example:
        >>> cache = EpisodeCache()
        >>> cache.states.update({0: "state of episode 0", 1: "state of episode 1"})
        >>> cache.drop([0]); len(cache), 1 in cache
        (1, True)
    """

    def __init__(self) -> None:
        self.states: dict[int, object] = {}
        self.policy_version: int | None = None
        self.reused_tokens = 0
        self.prefilled_tokens = 0

    def drop(self, episode_ids: Iterable[int]) -> None:
        """Forget the episodes ``episode_ids`` (ended: their state is not needed again)."""
        for i in episode_ids:
            self.states.pop(int(i), None)

    def clear(self) -> None:
        """Forget every episode (the counters are kept)."""
        self.states.clear()

    def __len__(self) -> int:
        return len(self.states)

    def __contains__(self, episode_id: object) -> bool:
        return episode_id in self.states


class GenerationBackend(abc.ABC):
    """Interface of a rollout engine (trainside transformers, SGLang, ...).

    Subclasses implement :meth:`_generate`; :meth:`generate` checks the prompts (and the context
    length, :attr:`context_length`), runs it under the engine lock and stamps ``policy_version``.
    ``generate`` returns a flat, prompt-major list: for ``P`` prompts and ``n`` samples, item
    ``i * n + j`` is sample ``j`` of prompt ``i``. :meth:`sync_weights` is implemented here, once:
    the sender ships the tensors, then (and only then) the version changes.

    Args:
        sender: how :meth:`sync_weights` ships tensors (``None``: the backend cannot be synced).

    Example:
        >>> class Echo(GenerationBackend):
        ...     def _generate(self, prompts, n, sampling):
        ...         return [Completion(i, p[-1:], [0.0], "length") for i, p in enumerate(prompts) for _ in range(n)]
        >>> class Accept:
        ...     def send(self, named_tensors, version): list(named_tensors)
        ...     def close(self): pass
        >>> engine = Echo(Accept())
        >>> engine.sync_weights([("w", torch.ones(1))], version=3)
        >>> [(c.token_ids, c.policy_version) for c in engine.generate([[1, 2]], 2, SamplingParams())]
        [([2], 3), ([2], 3)]
    """

    #: what the engine can do (see :class:`BackendCapabilities`); a subclass declares its own
    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        old = cls.__dict__.get("supports_partial_rollouts")
        if isinstance(old, bool):  # the 0.1 declaration, kept for one release
            warnings.warn(
                f"{cls.__name__}.supports_partial_rollouts is deprecated (removed in ar_torchrl "
                "0.2): declare capabilities = BackendCapabilities(partial_rollouts=True)",
                DeprecationWarning,
                stacklevel=2,
            )
            cls.capabilities = dataclasses.replace(cls.capabilities, partial_rollouts=old)
            del cls.supports_partial_rollouts

    @property
    def supports_partial_rollouts(self) -> bool:
        """``capabilities.partial_rollouts`` (the 0.1 name)."""
        return self.capabilities.partial_rollouts

    def __init__(self, sender: WeightSender | None = None) -> None:
        self._sender = sender
        self._policy_version = 0
        self._broken_sync: str | None = None  # why the engine may hold a partial update
        self._engine_lock = threading.Lock()
        self._partial_rollouts = False
        self._interrupt = threading.Event()  # a sync waits: stop generating at the next token
        self._no_sync = threading.Event()  # cleared while a partial-rollout sync runs
        self._no_sync.set()
        self.interruptions = 0  # generations a sync interrupted (partial rollouts)

    @property
    def partial_rollouts(self) -> bool:
        """Whether a sync interrupts generation in flight (see the module docstring)."""
        return self._partial_rollouts

    @partial_rollouts.setter
    def partial_rollouts(self, value: bool) -> None:
        if value and not self.capabilities.partial_rollouts:
            raise ValueError(
                f"{type(self).__name__} cannot interrupt its generation: partial rollouts need an "
                "engine that declares capabilities.partial_rollouts (TransformersBackend, "
                "SGLangBackend)"
            )
        self._partial_rollouts = bool(value)

    @property
    def interrupted(self) -> bool:
        """A weight sync is waiting: ``_generate`` should return at the next token."""
        return self._interrupt.is_set()

    @property
    def policy_version(self) -> int:
        """Version of the weights the engine serves (0: the weights it started with); the
        ``"policy_version"`` of the trajectories it generates (TorchRL's name for it)."""
        return self._policy_version

    @property
    def weight_version(self) -> int:
        """The old name of :attr:`policy_version` (kept for one release)."""
        warnings.warn(
            "GenerationBackend.weight_version is now policy_version (one name per id); the old "
            "name goes in ar_torchrl 0.2",
            DeprecationWarning,
            stacklevel=2,
        )
        return self._policy_version

    @property
    def sender(self) -> WeightSender | None:
        """The sender :meth:`sync_weights` goes through."""
        return self._sender

    @property
    def context_length(self) -> int | None:
        """Most tokens (prompt + completion) the engine accepts; ``None``: unknown (not checked)."""
        return None

    @property
    def weight_dtype(self) -> torch.dtype | None:
        """The dtype the engine keeps its weights in (``None``: send them as they are)."""
        return None

    @property
    def shares_trainer_weights(self) -> bool:
        """The engine samples from the trainer's own module (no copy: an update changes it while a
        generation may run, so it cannot generate in the background)."""
        return False

    def state_dict(self) -> dict:
        """The engine's sampling state (``capabilities.sampler_state``), saved in checkpoints."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (an engine without sampling state accepts only ``{}``)."""
        if state:
            raise ValueError(
                f"{type(self).__name__} keeps no sampling state (capabilities.sampler_state is "
                f"False), got one with {sorted(state)}"
            )

    def release_memory(self) -> dict[str, float]:
        """Free the engine's memory before an update (``capabilities.memory_release``); returns
        timings. Generation is refused until :meth:`resume_memory` and the next sync."""
        raise ValueError(
            f"{type(self).__name__} does not release its memory (capabilities.memory_release is "
            "False): set backend.release_memory_during_update=false"
        )

    def resume_memory(self) -> dict[str, float]:
        """Restore what :meth:`release_memory` freed; returns timings."""
        raise ValueError(f"{type(self).__name__} does not release its memory, so none to resume")

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        *,
        episodes: EpisodeCache | None = None,
        episode_ids: Sequence[int] | None = None,
    ) -> list[Completion]:
        """Sample ``n`` completions per prompt; prompt-major flat list, each stamped with the version.

        Args:
            prompt_token_ids: the prompts (a multi-turn episode: its whole context so far).
            n: completions per prompt.
            sampling: how to sample.
            episodes: with ``episode_ids``, prompt ``i`` continues episode ``episode_ids[i]`` of
                this cache (``capabilities.episode_cache``; ``n = 1``; see :class:`EpisodeCache`).
            episode_ids: one distinct id per prompt.

        Raises:
            ValueError: no prompts, an empty prompt, ``n < 1``, or ``episodes`` on an engine that
                keeps none / with ids that do not match the prompts.
            ContextLengthError: a prompt plus ``max_new_tokens`` exceeds :attr:`context_length`.
            WeightSyncError: the last sync failed part-way; sync again first.
        """
        name = type(self).__name__
        prompts = validate_prompts(prompt_token_ids, n, name)
        # before asking the engine anything (its context length: a server that died mid-sync
        # cannot answer it); checked again under the lock below
        self._check_not_broken(name)
        self._check_context(prompts, sampling, name)
        if episodes is not None or episode_ids is not None:
            episode_ids = self._check_episodes(episodes, episode_ids, len(prompts), n, name)
        if self._partial_rollouts:
            if episodes is not None:  # a sync may come between any two tokens: nothing is kept
                episodes.clear()
            return self._generate_partial(prompts, n, sampling)
        with self._engine_lock:
            self._check_not_broken(name)
            version = self._policy_version
            if episodes is None:
                out = self._generate(prompts, n, sampling)
            else:
                if episodes.policy_version != version:  # computed by other weights
                    episodes.clear()
                    episodes.policy_version = version
                out = self._generate_episodes(prompts, sampling, episodes, episode_ids)
        self._check_count(out, len(prompts) * n, name)
        for c in out:
            c.policy_version = version
        return out

    def _check_episodes(self, episodes, episode_ids, count: int, n: int, name: str) -> list[int]:
        if not self.capabilities.episode_cache:
            raise ValueError(
                f"{name} keeps no episode cache (capabilities.episode_cache is False): call "
                "generate without episodes= / episode_ids= (every turn sends the whole context)"
            )
        if episodes is None or episode_ids is None:
            raise ValueError(
                f"{name}.generate: episodes= and episode_ids= go together, got "
                f"episodes={type(episodes).__name__} and episode_ids={episode_ids!r}"
            )
        ids = [int(i) for i in episode_ids]
        if n != 1 or len(ids) != count or len(set(ids)) != count:
            raise ValueError(
                f"{name}.generate: with episodes=, n must be 1 and episode_ids one distinct id per "
                f"prompt; got n={n}, {count} prompts and episode_ids {ids[:8]}"
            )
        return ids

    def _generate_episodes(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        episodes: EpisodeCache,
        episode_ids: list[int],
    ) -> list[Completion]:
        """One completion per episode's context, continuing from ``episodes``. An engine that
        declares ``capabilities.episode_cache`` overrides it; this one keeps nothing and prefills
        every context whole (what an engine without a cache does on every turn)."""
        return self._generate(prompts, 1, sampling)

    def _check_not_broken(self, name: str) -> None:
        if self._broken_sync is not None:
            raise WeightSyncError(
                f"{name}: the last weight sync failed part-way ({self._broken_sync}); the engine "
                "may hold mixed weights: sync again before generating",
                partial=True,
            )

    @staticmethod
    def _check_count(out: list, want: int, name: str) -> None:
        if len(out) != want:
            raise RuntimeError(f"{name}: returned {len(out)} completions for {want} requests")

    def _generate_partial(
        self, prompts: list[list[int]], n: int, sampling: SamplingParams
    ) -> list[Completion]:
        """Generation a sync may interrupt: rounds of ``_generate`` under the engine lock; after
        an interrupted round the lock goes to the waiting sync, then every unfinished completion
        continues from ``prompt + its tokens so far`` with the tokens it has left."""
        name = type(self).__name__
        parts = [_Partial(i, p) for i, p in enumerate(prompts) for _ in range(n)]
        while todo := [r for r in parts if r.open(sampling.max_new_tokens)]:
            self._no_sync.wait()  # a sync that interrupted the last round goes first
            with self._engine_lock:
                self._check_not_broken(name)
                version = self._policy_version
                for left in sorted({sampling.max_new_tokens - len(r) for r in todo}, reverse=True):
                    if self.interrupted:  # the rest of this round waits for the sync
                        break
                    group = [r for r in todo if sampling.max_new_tokens - len(r) == left]
                    rest = dataclasses.replace(sampling, max_new_tokens=left)
                    out = self._generate([r.prompt + r.tokens for r in group], 1, rest)
                    self._check_count(out, len(group), name)
                    for r, c in zip(group, out):
                        r.extend(c, version)
                if self.interrupted:
                    self.interruptions += 1
        return [r.completion() for r in parts]

    @abc.abstractmethod
    def _generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingParams
    ) -> list[Completion]:
        """Sample ``n`` completions for each (checked) prompt, prompt-major."""

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load new policy weights (HF names; ``value_head.*`` is dropped) as ``version``.

        The tensors are consumed lazily by the sender. ``policy_version`` becomes ``version`` only
        after the sender succeeded.

        Raises:
            WeightSyncError: the sender failed; ``policy_version`` is unchanged (and, when the
                failure was ``partial``, generation is refused until a sync succeeds).
        """
        name, version = type(self).__name__, int(version)
        if self._sender is None:
            raise WeightSyncError(f"{name} has no weight sender: it cannot load new weights")
        if self._partial_rollouts:  # stop a generation in flight at its next token
            self._no_sync.clear()
            self._interrupt.set()
        try:
            with self._engine_lock:
                try:
                    self._sender.send(named_tensors, version)
                except Exception as err:
                    self._sync_failed(err, version, name)
                self._policy_version, self._broken_sync = version, None
        finally:
            self._interrupt.clear()
            self._no_sync.set()

    def _sync_failed(self, err: Exception, version: int, name: str) -> None:
        """Raise the one error of a failed sync (a sender's own error is not chained again)."""
        ours = isinstance(err, WeightSyncError)
        partial = err.partial if ours else True  # an unknown failure may have applied anything
        reason = str(err) if ours else f"{type(err).__name__}: {err}"
        if partial:
            self._broken_sync = reason
        tail = "; it may hold a partial update: sync again before generating" if partial else ""
        raise WeightSyncError(
            f"{name}: weight sync to version {version} failed ({reason}); the engine keeps "
            f"policy_version {self._policy_version}{tail}",
            partial=partial,
        ) from (None if ours else err)

    def _check_context(self, prompts: list[list[int]], sampling: SamplingParams, name: str) -> None:
        limit = self.context_length
        if limit is None:
            return
        long = [
            (i, len(p)) for i, p in enumerate(prompts) if len(p) + sampling.max_new_tokens > limit
        ]
        if long:
            raise ContextLengthError(
                f"{name}: prompts (index, tokens) {long[:5]} plus max_new_tokens="
                f"{sampling.max_new_tokens} exceed the model's context of {limit} tokens; shorten "
                "the prompts or lower max_new_tokens (prompts are never truncated)"
            )

    def close(self) -> None:
        """Release resources (the sender's process groups, sockets, ...). Idempotent."""
        if self._sender is not None:
            self._sender.close()

    def __enter__(self) -> GenerationBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Partial:
    """One completion of a partial rollout being assembled across weight versions."""

    def __init__(self, prompt_index: int, prompt: list[int]) -> None:
        self.prompt_index, self.prompt = prompt_index, prompt
        self.tokens: list[int] = []
        self.log_probs: list[float] = []
        self.versions: list[int] = []
        self.finish: FinishReason | None = None
        self.meta: dict = {}
        self.version = 0  # of the last round (a completion without tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def open(self, max_new_tokens: int) -> bool:
        """Still to generate: not finished by itself, and tokens left."""
        return self.finish is None and len(self.tokens) < max_new_tokens

    def extend(self, c: Completion, version: int) -> None:
        self.tokens += list(c.token_ids)
        self.log_probs += list(c.log_probs)
        self.versions += [version] * len(c.token_ids)
        self.meta, self.version = c.meta, version
        if c.finish_reason != "abort":
            self.finish = c.finish_reason

    def completion(self) -> Completion:
        split = len(set(self.versions)) > 1
        return Completion(
            self.prompt_index,
            self.tokens,
            self.log_probs,
            self.finish or "length",
            policy_version=self.versions[0] if self.versions else self.version,
            meta=self.meta,
            token_versions=list(self.versions) if split else None,
        )
