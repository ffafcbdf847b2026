"""One checkpoint store over both formats: what a recipe asks of its checkpoints.

A :class:`CheckpointStore` saves, loads, loads the critic alone, finds the newest intact checkpoint
of a directory and verifies one; :func:`checkpoint_store` chooses the implementation from whether
the run is sharded:

- :class:`LocalStore`: one process, one ``torch.save`` file per step (:mod:`.local`);
- :class:`ShardedStore`: FSDP2 ranks, one ``torch.distributed.checkpoint`` directory per step
  (:mod:`.sharded`), every rank writing its shards.

Names come from :mod:`.naming` (``step_<N>.pt`` / ``step_<N>/``). Both formats are atomic (written
under a temporary name, renamed into place), checksummed (damage is detected and a damaged newest
checkpoint skipped), never unpickle code (``torch.load(weights_only=True)``, an exact allowlist for
DCP's ``.metadata``, JSON for the rest) and restore every RNG stream. A disk-full save names the
disk and the bytes.

**Trust boundary.** The SHA-256s in a checkpoint's manifest detect damage, not tampering: whoever
can write the checkpoint directory can recompute them, or delete them and land on the path for
checkpoints saved before checksums. What loading guarantees without a key is that no code from the
checkpoint runs; what it cannot guarantee is that the weights, optimizer state or collector state
are the ones the run saved. With a key (``checkpoint_store(..., hmac_key_env="NAME")``, the
recipe's ``checkpoint.hmac_key_env``) saves sign the manifest (HMAC-SHA256 over it, and it holds
every file's SHA-256) and loads, ``latest`` and ``verify`` refuse an unsigned or wrongly signed
checkpoint before anything else of it is read (:mod:`.signing`; docs/checkpoints.md).

**TorchRL's checkpointing** (``torchrl.checkpoint`` in 0.14.1: ``Checkpoint``,
``CheckpointRotation``, ``GlobalRNGState``) is not used, for these reasons:

- *Atomic saves*: ``Checkpoint.save`` stages a directory (or a zip archive) of per-component files
  plus a ``manifest.json`` and publishes it with ``os.replace``, but fsyncs neither the files nor
  the directory, records no sizes or digests (so a damaged checkpoint loads or fails inside torch),
  and cannot hold DCP shards written by every rank. Adopting its layout would also change the file
  format every existing run resumes from.
- *Rotation*: ``CheckpointRotation`` names entries ``<prefix>-<step:012d>`` and its ``latest()``
  returns the newest entry whose manifest parses, not the newest intact one; ours keeps
  ``step_<N>.pt`` / ``step_<N>/`` and skips damaged checkpoints (``keep_last`` prunes the same way).
- *RNG state*: ``GlobalRNGState`` captures the same streams (Python, NumPy, torch CPU and CUDA) but
  stores them under other keys (``torch_cpu``, a NumPy tuple); our ``.pt`` layout
  (:func:`.local.capture_rng_state`) and the per-rank JSON of DCP checkpoints are kept so that
  existing checkpoints resume bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ar_torchrl.checkpoint.naming import checkpoint_pattern
from ar_torchrl.checkpoint.signing import CheckpointSigner

if TYPE_CHECKING:
    from ar_torchrl.distributed.context import DistContext

__all__ = ["CheckpointStore", "LocalStore", "ShardedStore", "checkpoint_store"]


@runtime_checkable
class CheckpointStore(Protocol):
    """What a recipe asks of its checkpoints (see the module docstring).

    ``actor_critic`` is the policy's :class:`~ar_torchrl.modules.LMActorCritic` (its ``.model``
    carries the value head in a shared-critic run), ``critic`` the separate
    :class:`~ar_torchrl.modules.LMCritic` or ``None``.

    Example:
        >>> isinstance(checkpoint_store(sharded=False), CheckpointStore)
        True
    """

    #: how its checkpoints look, for messages: "a single-process" / "a distributed (FSDP2)"
    kind: str
    #: how a checkpoint is named in its run's ``checkpoints/``: "step_<N>.pt" / "step_<N>"
    pattern: str
    #: signs saves and authenticates loads (``None``: checksums only)
    signer: CheckpointSigner | None

    def save(
        self,
        directory: Path,
        step: int,
        *,
        actor_critic: Any,
        optimizer: Any,
        extra: dict,
        keep_last: int | None = None,
        critic: Any = None,
    ) -> Path: ...
    def load(
        self, checkpoint: Path, *, actor_critic: Any, optimizer: Any, critic: Any = None
    ) -> dict: ...
    def load_critic(self, source: Path, *, critic: Any, actor_critic: Any) -> str: ...
    def latest(self, directory: Path) -> Path | None: ...
    def verify(self, checkpoint: Path) -> str | None: ...
    def check(self, checkpoint: Path, *, key: str = "train.resume_from") -> None: ...


class _Store:
    """What both stores share: :meth:`check` (over each store's own ``verify``) and the repr."""

    kind: str
    pattern: str
    sharded: bool
    signer: CheckpointSigner | None

    def check(self, checkpoint: Path, *, key: str = "train.resume_from") -> None:
        """Refuse (``ValueError`` naming ``key``) a checkpoint of the other kind, a damaged one and,
        with a signer, one that is not authentic."""
        checkpoint = Path(checkpoint)
        if checkpoint.is_dir() != self.sharded:
            kind = "a distributed (FSDP2)" if checkpoint.is_dir() else "a single-process"
            run = "trains with FSDP2" if self.sharded else "is one float32 process"
            raise ValueError(
                f"{key}: {checkpoint} is {kind} checkpoint but this run {run}; use the launch "
                "(torchrun or python), model.dtype and dist.fsdp that wrote it"
            )
        problem = self.verify(checkpoint)
        if problem is not None:
            raise ValueError(f"{key}: {checkpoint} is unusable: {problem}")

    def __repr__(self) -> str:
        signed = "" if self.signer is None else f", signed with the key from {self.signer.source}"
        return f"{type(self).__name__}({self.pattern}{signed})"


class LocalStore(_Store):
    """One process: ``checkpoints/step_<N>.pt`` files (:mod:`ar_torchrl.checkpoint.local`).

    Args:
        signer: signs saves and refuses unsigned or wrongly signed checkpoints (``None``: off).

    Example:
        >>> import tempfile
        >>> from ar_torchrl.models.tiny import build_tiny_qwen3
        >>> from ar_torchrl.modules import LMActorCritic, attach_value_head
        >>> ac = LMActorCritic(attach_value_head(build_tiny_qwen3(99)))
        >>> store, d = LocalStore(), Path(tempfile.mkdtemp())
        >>> path = store.save(d, 3, actor_critic=ac, optimizer=None, extra={"cursor": 48})
        >>> store.latest(d) == path, store.load(path, actor_critic=ac, optimizer=None)["extra"]
        (True, {'cursor': 48})
    """

    kind = "a single-process"
    pattern = checkpoint_pattern(sharded=False)
    sharded = False

    def __init__(self, signer: CheckpointSigner | None = None) -> None:
        self.signer = signer

    def save(
        self, directory, step, *, actor_critic, optimizer, extra, keep_last=None, critic=None
    ) -> Path:
        """``directory/step_<step>.pt``: the policy (and value head), a separate critic,
        the optimizer, every RNG state and ``extra``."""
        from ar_torchrl.checkpoint import local

        return local.save(
            directory,
            step=step,
            model=actor_critic.model,
            optimizer=optimizer,
            extra=extra,
            keep_last=keep_last,
            critic=None if critic is None else critic.model,
            signer=self.signer,
        )

    def load(self, checkpoint, *, actor_critic, optimizer, critic=None) -> dict:
        """Everything :meth:`save` wrote, back into the run; returns ``{"step", "extra"}``."""
        from ar_torchrl.checkpoint import local

        return local.load(
            checkpoint,
            model=actor_critic.model,
            optimizer=optimizer,
            critic=None if critic is None else critic.model,
            signer=self.signer,
        )

    def load_critic(self, source, *, critic, actor_critic) -> str:
        """The critic of an earlier run's ``.pt`` checkpoint into ``critic`` (separate) or the
        policy's value head (shared); returns what was loaded, for the log."""
        from ar_torchrl.checkpoint import local

        separate = None if critic is None else critic.model
        return local.load_critic(
            source, critic=separate, model=actor_critic.model, signer=self.signer
        )

    def latest(self, directory) -> Path | None:
        """The newest intact (and, with a signer, authentic) ``step_<N>.pt`` of ``directory``."""
        from ar_torchrl.checkpoint import local

        return local.latest(directory, signer=self.signer)

    def verify(self, checkpoint) -> str | None:
        """What is wrong with ``checkpoint`` (``None``: intact and, with a signer, authentic)."""
        from ar_torchrl.checkpoint import local

        return local.verify(checkpoint, signer=self.signer)


class ShardedStore(_Store):
    """FSDP2 ranks: ``checkpoints/step_<N>/`` DCP directories (:mod:`ar_torchrl.checkpoint.sharded`).

    :meth:`save`, :meth:`load` and :meth:`load_critic` are collective (every rank calls them);
    :meth:`latest`, :meth:`verify` and :meth:`check` read files only (rank 0 calls them and shares
    the answer). The saved module is the policy's ``LMActorCritic`` root (its keys as before), or
    with a separate critic both FSDP roots (``policy.*`` and ``critic.*``).

    Args:
        ctx: this rank's process group context.
        signer: signs saves (rank 0) and refuses unsigned or wrongly signed checkpoints.

    Example:
        >>> import tempfile
        >>> from ar_torchrl.distributed import DistContext
        >>> from ar_torchrl.models.tiny import build_tiny_qwen3
        >>> from ar_torchrl.modules import LMActorCritic, attach_value_head
        >>> ac = LMActorCritic(attach_value_head(build_tiny_qwen3(99)))
        >>> store, d = ShardedStore(DistContext()), Path(tempfile.mkdtemp())
        >>> path = store.save(d, 2, actor_critic=ac, optimizer=None, extra={"cursor": 32})
        >>> path.name, store.verify(path), store.load(path, actor_critic=ac, optimizer=None)["step"]
        ('step_2', None, 2)
    """

    kind = "a distributed (FSDP2)"
    pattern = checkpoint_pattern(sharded=True)
    sharded = True

    def __init__(self, ctx: DistContext, signer: CheckpointSigner | None = None) -> None:
        self.ctx, self.signer = ctx, signer

    def save(
        self, directory, step, *, actor_critic, optimizer, extra, keep_last=None, critic=None
    ) -> Path:
        """Every rank: ``directory/step_<step>/`` (its shards, its RNG states; rank 0 the
        metadata with ``extra``)."""
        from ar_torchrl.checkpoint import sharded

        return sharded.save(
            directory,
            step=step,
            model=_checkpointed(actor_critic, critic),
            optimizer=optimizer,
            ctx=self.ctx,
            extra=extra,
            keep_last=keep_last,
            signer=self.signer,
        )

    def load(self, checkpoint, *, actor_critic, optimizer, critic=None) -> dict:
        """Every rank: what :meth:`save` wrote, resharded to this run's ranks."""
        from ar_torchrl.checkpoint import sharded

        return sharded.load(
            checkpoint,
            model=_checkpointed(actor_critic, critic),
            optimizer=optimizer,
            ctx=self.ctx,
            signer=self.signer,
        )

    def load_critic(self, source, *, critic, actor_critic) -> str:
        """Every rank: the critic of an earlier run's distributed checkpoint into ``critic``
        (separate) or the policy's value head (shared; the FSDP root is the policy's
        ``LMActorCritic``)."""
        from ar_torchrl.checkpoint import sharded

        return sharded.load_critic(
            source, critic=critic, policy=actor_critic, ctx=self.ctx, signer=self.signer
        )

    def latest(self, directory) -> Path | None:
        """The newest intact (and, with a signer, authentic) ``step_<N>/`` of ``directory``."""
        from ar_torchrl.checkpoint import sharded

        return sharded.latest(directory, signer=self.signer)

    def verify(self, checkpoint) -> str | None:
        """What is wrong with ``checkpoint`` (``None``: intact and, with a signer, authentic)."""
        from ar_torchrl.checkpoint import sharded

        return sharded.verify(checkpoint, signer=self.signer)


def _checkpointed(actor_critic: Any, critic: Any) -> Any:
    """The module a distributed checkpoint holds: the policy's ``LMActorCritic`` (its keys as
    before), or with a separate critic both FSDP roots (``policy.*`` and ``critic.*``)."""
    if critic is None:
        return actor_critic
    from torch import nn

    return nn.ModuleDict({"policy": actor_critic, "critic": critic})


def checkpoint_store(
    *, sharded: bool, ctx: DistContext | None = None, hmac_key_env: str | None = None
) -> CheckpointStore:
    """The store of a run: :class:`ShardedStore` on ``ctx`` when ``sharded`` (FSDP2), else
    :class:`LocalStore`; with ``hmac_key_env`` (the name of an environment variable holding the
    key) both sign their saves and authenticate what they load.

    Raises:
        ValueError: ``hmac_key_env`` is not a variable name, or the variable is unset, empty or
            shorter than 16 bytes (naming the variable, never its value).

    Example:
        >>> checkpoint_store(sharded=False)
        LocalStore(step_<N>.pt)
        >>> import os
        >>> os.environ["DOC_CKPT_KEY"] = "0123456789abcdef0123"
        >>> checkpoint_store(sharded=False, hmac_key_env="DOC_CKPT_KEY")
        LocalStore(step_<N>.pt, signed with the key from $DOC_CKPT_KEY)
        >>> del os.environ["DOC_CKPT_KEY"]
    """
    signer = None if hmac_key_env is None else CheckpointSigner.from_env(hmac_key_env)
    if not sharded:
        return LocalStore(signer)
    if ctx is None:
        from ar_torchrl.distributed.context import DistContext

        ctx = DistContext()
    return ShardedStore(ctx, signer)
