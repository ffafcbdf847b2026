"""Single-process checkpoints: one atomic, checksummed ``torch.save`` file per step holding the model
(with value head), optimizer, RNG states, step and data position. :class:`~ar_torchrl.checkpoint.LocalStore`
is the interface a recipe uses; these are its functions.

A checkpoint is one ``torch.save`` file written to a temporary name in the same directory and renamed
into place (``os.replace`` is atomic on POSIX), so a crash never leaves a half-written checkpoint
under the final name; a temporary file left by a killed process is removed by the next save (and by
:func:`~ar_torchrl.checkpoint.naming.remove_partial_checkpoints`). Resuming restores every RNG stream
(Python, NumPy, torch CPU and CUDA), so the resumed run draws the same samples an uninterrupted run
would. A save that runs out of disk says so, naming the directory and the bytes (needed and free).

Integrity: after the data, each save writes a small manifest ``.step_<N>.pt.manifest.json`` (also
atomically) with the file's size and SHA-256, computed while the file is written; a save whose
manifest cannot be written removes its file. Choosing the checkpoint to resume (:func:`latest`) and
loading one (:func:`load`) check it against the manifest (:func:`verify`): a truncated, empty or
bit-flipped newest checkpoint is skipped, with a warning naming it, for the previous intact one;
loading a damaged one is an error naming it. A checkpoint without a manifest (written before
manifests existed) is "unverified": it loads after a check of its zip structure and of the CRC-32 of
each record (what ``torch.save`` writes), which catches truncation and most damage; this is logged
once.

Authenticity: the manifest's SHA-256 detects damage, not tampering (whoever can write the directory
can recompute it, or delete the manifest). With a :class:`~ar_torchrl.checkpoint.CheckpointSigner`
(``signer=``) a save also signs the manifest (HMAC-SHA256), and verifying or loading refuses an
unsigned or wrongly signed checkpoint before the file is read (docs/checkpoints.md).

Loading never executes code from the file: it uses ``torch.load(weights_only=True)``, which accepts
only tensors and plain containers (dicts, lists, tuples, numbers, strings), so everything saved is
kept in that form (the NumPy RNG state is stored as a tensor).

torch is imported by the functions that need it: finding checkpoints (:func:`latest`) is cheap, so a
recipe can locate the one to resume before it imports the training stack. The names before the
store (``save_checkpoint``, ``load_checkpoint``, ``latest_checkpoint``, ``verify_checkpoint_file``,
``load_critic_weights``) still work for one release, with a ``DeprecationWarning`` naming the new one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import random
import tempfile
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ar_torchrl import _compat
from ar_torchrl.checkpoint import naming
from ar_torchrl.checkpoint._space import free_bytes, no_space_error, tensor_bytes
from ar_torchrl.checkpoint.naming import checkpoint_name, list_checkpoints, manifest_path
from ar_torchrl.utils.checks import check_number
from ar_torchrl.utils.files import file_sha256

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ar_torchrl.checkpoint.signing import CheckpointSigner

__all__ = [
    "capture_rng_state",
    "latest",
    "load",
    "load_critic",
    "restore_rng_state",
    "save",
    "verify",
]

logger = logging.getLogger(__name__)
_MANIFEST_FORMAT = 1
#: ``CheckpointSigner.sign(kind=...)`` of these manifests
_KIND = "local"
#: checkpoints without a manifest already reported as unverified (logged once per file)
_UNVERIFIED: set[str] = set()
#: what a checkpoint (a dict) must hold to be loaded, by who loads it
_RESUME_KEYS = ("step", "model", "optimizer", "rng", "extra")
_CRITIC_KEYS = ("model",)


def __getattr__(name: str) -> object:  # the names before the store, kept one release
    return _compat.renamed(__name__, name)


def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy, torch CPU (and CUDA when available) RNG states, as tensors and plain data.

    Example:
        >>> import torch
        >>> state = capture_rng_state(); a = torch.rand(1)
        >>> restore_rng_state(state); bool(torch.rand(1) == a)
        True
    """
    import numpy as np
    import torch

    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(keys.astype(np.int64)),  # uint32 as int64: exact
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`capture_rng_state` captured (see its example)."""
    import numpy as np
    import torch

    random.setstate(state["python"])
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(
    directory: str | os.PathLike,
    *,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
    keep_last: int | None = None,
    critic: nn.Module | None = None,
    signer: CheckpointSigner | None = None,
) -> Path:
    """Write ``directory/step_<step>.pt`` atomically and return its path.

    Args:
        directory: checkpoint directory (created if missing).
        step: the number of completed training iterations.
        model: the policy; its ``state_dict`` includes ``value_head.*`` when a head is attached.
        optimizer: saved when given.
        extra: what the run needs to continue (data position, collector state, policy version,
            ...), as tensors and plain containers (what ``weights_only=True`` loading accepts).
        keep_last: delete older ``step_*.pt`` files beyond the newest ``keep_last`` (``>= 1``;
            ``None`` keeps all).
        critic: a separate critic model (with its value head), saved under ``"critic"``.
        signer: signs the manifest (HMAC) so that a store with the same key accepts it.

    Raises:
        OSError: ``ENOSPC`` naming the directory and the bytes when the disk is full (nothing of
            this save is left behind; the previous checkpoints are untouched).

    Example:
        >>> import tempfile
        >>> from torch import nn
        >>> d = tempfile.mkdtemp(); net = nn.Linear(2, 1)
        >>> p = save(d, step=3, model=net, extra={"data_position": 48})
        >>> p.name, load(p, model=net)["extra"]["data_position"]
        ('step_3.pt', 48)
    """
    import torch

    check_number("save_checkpoint", "keep_last", keep_last, ge=1, integer=True, allow_none=True)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    naming.remove_partial_checkpoints(directory)
    payload = {
        "step": int(step),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "rng": capture_rng_state(),
        "extra": extra or {},
    }
    if critic is not None:
        payload["critic"] = critic.state_dict()
    target = directory / checkpoint_name(step, sharded=False)
    free = free_bytes(directory)
    try:
        record = _write_file(target, lambda f: torch.save(payload, f))
        if signer is not None:
            record = signer.signed(record, kind=_KIND)
        _write_manifest(target, record)  # after the data: it vouches for it
    except BaseException as err:
        full = no_space_error(
            err, directory, needed=tensor_bytes(payload), free=free, what=f"saving {target.name}"
        )
        if full is not None:
            raise full from err
        raise
    logger.info("saved checkpoint %s", target)
    if keep_last is not None:
        for old in list_checkpoints(directory, sharded=False)[:-keep_last]:
            old.unlink(missing_ok=True)
            manifest_path(old).unlink(missing_ok=True)
    return target


def _write_file(target: Path, write) -> dict[str, Any]:
    """``write(file)`` into a temporary file renamed to ``target``; returns its manifest record (the
    size and SHA-256, computed while it is written). Nothing is left behind on failure."""
    fd, tmp = tempfile.mkstemp(
        dir=target.parent, prefix=naming.temp_file_prefix(target), suffix=".tmp"
    )
    try:
        with os.fdopen(fd, "wb") as f:
            hashing = _HashingWriter(f)
            write(hashing)
            f.flush()
            os.fsync(f.fileno())
        # A manifest of an earlier save of this step would not match the new file.
        manifest_path(target).unlink(missing_ok=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return {
        "format": _MANIFEST_FORMAT,
        "file": target.name,
        "size": hashing.size,
        "sha256": hashing.sha256.hexdigest(),
    }


def _write_manifest(target: Path, record: dict[str, Any]) -> None:
    """The manifest of ``target``; a file whose manifest could not be written is removed (it would
    load as an unverified checkpoint of another era)."""
    try:
        _write_atomically(manifest_path(target), json.dumps(record).encode())
    except BaseException:
        target.unlink(missing_ok=True)
        raise


class _HashingWriter:
    """A binary file that computes the SHA-256 and size of what is written through it
    (``torch.save`` writes its archive sequentially: no second read of the file is needed)."""

    def __init__(self, file) -> None:
        self.file, self.sha256, self.size = file, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha256.update(data)
        self.size += memoryview(data).nbytes
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def _write_atomically(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{path.name}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # both renames (the checkpoint's and its manifest's) are durable
    finally:
        os.close(dir_fd)


def verify(path: str | os.PathLike, *, signer: CheckpointSigner | None = None) -> str | None:
    """What is wrong with the checkpoint file at ``path`` (``None``: intact), naming the file.

    With a ``signer``, first the manifest's HMAC (an unsigned or wrongly signed checkpoint is
    refused before its file is read). Then the size and SHA-256 in its manifest
    (``.step_<N>.pt.manifest.json``, written by :func:`save`); it reads the whole file (SHA-256 runs
    at about 1 GB/s). A file without a manifest (saved before manifests existed) is unverified: only
    its zip structure and the CRC-32 of each record are checked, and this is logged once per file
    (with a ``signer`` it is refused: it is not signed).

    Example:
        >>> import tempfile
        >>> from torch import nn
        >>> p = save(tempfile.mkdtemp(), step=1, model=nn.Linear(2, 1))
        >>> verify(p) is None
        True
        >>> _ = p.write_bytes(p.read_bytes()[:100])
        >>> verify(p)
        'step_1.pt has 100 bytes, its manifest .step_1.pt.manifest.json says ... (truncated?)'
    """
    path = Path(path)
    if not path.is_file():
        return f"{path.name} is missing"
    manifest = manifest_path(path)
    try:
        record = json.loads(manifest.read_text())
    except FileNotFoundError:
        if signer is not None:
            return signer.problem({}, kind=_KIND, what=path.name)
        return _check_unverified(path)
    except (OSError, ValueError) as err:
        return f"its manifest {manifest.name} is unreadable ({type(err).__name__}: {err})"
    if signer is not None:
        problem = signer.problem(record, kind=_KIND, what=path.name)
        renamed = naming.is_checkpoint_name(path.name) and record.get("file") != path.name
        if problem is None and renamed:
            problem = (
                f"{path.name} carries the signed manifest of {record.get('file')!r} (renamed?)"
            )
        if problem is not None:
            return problem
    try:
        want_size, want_sha256 = int(record["size"]), str(record["sha256"])
    except (ValueError, TypeError, KeyError) as err:
        return f"its manifest {manifest.name} is unreadable ({type(err).__name__}: {err})"
    size = path.stat().st_size
    if size == 0:
        return f"{path.name} is empty (0 bytes)"
    if size != want_size:
        return (
            f"{path.name} has {size} bytes, its manifest {manifest.name} says {want_size} "
            "(truncated?)"
        )
    got = file_sha256(path)
    if got != want_sha256:
        return (
            f"{path.name} does not match the SHA-256 in its manifest {manifest.name} (same size, "
            f"damaged content: {got[:16]}... instead of {want_sha256[:16]}...)"
        )
    return None


def _check_unverified(path: Path) -> str | None:
    """The checks possible without a manifest: ``torch.save``'s zip archive is complete and each
    record has its CRC-32 (unless the file was written without CRC-32s, all zero)."""
    if path.stat().st_size == 0:
        return f"{path.name} is empty (0 bytes)"
    try:
        with zipfile.ZipFile(path) as archive:
            has_crcs = any(info.CRC for info in archive.infolist() if info.file_size)
            bad = archive.testzip() if has_crcs else None
    except Exception as err:  # whatever a damaged archive raises: it is damaged
        return (
            f"{path.name} is not a complete torch.save archive, truncated or damaged "
            f"({type(err).__name__}: {err})"
        )
    if bad is not None:
        return f"{path.name}: its record {bad!r} fails its CRC-32 (damaged content)"
    if str(path) not in _UNVERIFIED:
        _UNVERIFIED.add(str(path))
        logger.warning(
            "checkpoint %s has no manifest (%s; saved before checkpoints had checksums): it is "
            "unverified, only its zip structure and CRC-32s were checked",
            path,
            manifest_path(path).name,
        )
    return None


def latest(directory: str | os.PathLike, *, signer: CheckpointSigner | None = None) -> Path | None:
    """The intact ``step_*.pt`` with the highest step in ``directory`` (``None``: there is none).

    Each candidate, newest first, is checked with :func:`verify`; a damaged one (truncated, empty,
    other content than its manifest says) or, with a ``signer``, one that is not authentic is
    skipped with a warning naming the file and the problem. Nothing is unpickled.

    Example:
        >>> import tempfile
        >>> from torch import nn
        >>> d = tempfile.mkdtemp(); net = nn.Linear(2, 1)
        >>> _ = save(d, step=2, model=net); _ = save(d, step=10, model=net)
        >>> latest(d).name
        'step_10.pt'
    """
    for path in reversed(list_checkpoints(directory, sharded=False)):
        problem = verify(path, signer=signer)
        if problem is None:
            return path
        logger.warning("checkpoint %s is unusable (%s); trying the previous one", path, problem)
    return None


def load(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    restore_rng: bool = True,
    critic: nn.Module | None = None,
    signer: CheckpointSigner | None = None,
) -> dict[str, Any]:
    """Load a checkpoint into ``model`` (strict), ``critic`` (a separate critic's model, strict)
    and ``optimizer``; restore RNG states.

    The file is first checked (:func:`verify`: with a ``signer`` its HMAC, then its size and
    SHA-256), then read with ``torch.load(weights_only=True)``: nothing in it is executed.

    Returns:
        ``{"step": int, "extra": dict}``.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file is damaged or not authentic (naming it and the problem), holds more
            than tensors and plain containers, is not a checkpoint, or does not match ``model`` /
            ``optimizer``.

    Example:
        >>> import tempfile
        >>> from torch import nn
        >>> net = nn.Linear(2, 1); p = save(tempfile.mkdtemp(), step=1, model=net)
        >>> load(p, model=nn.Linear(3, 1))
        Traceback (most recent call last):
        ...
        ValueError: checkpoint ... does not match the model ...
    """
    payload = _read_checkpoint(path, "load_checkpoint", _RESUME_KEYS, signer)
    if ("critic" in payload) != (critic is not None):
        has = "a separate critic" if "critic" in payload else "no separate critic"
        raise ValueError(
            f"checkpoint {str(path)!r} holds {has} but this run has "
            f"{'one' if critic is not None else 'none'}: resume with the critic=... it was "
            "written with (a critic of another run is loaded with critic.init_from)"
        )
    try:
        model.load_state_dict(payload["model"])
        if critic is not None:
            critic.load_state_dict(payload["critic"])
    except RuntimeError as err:
        raise ValueError(
            f"checkpoint {str(path)!r} does not match the model (was it written by a run with a "
            f"different model config?): {str(err).splitlines()[0]} ..."
        ) from err
    if optimizer is not None:
        if payload["optimizer"] is None:
            raise ValueError(f"checkpoint {str(path)!r} has no optimizer state to restore")
        optimizer.load_state_dict(payload["optimizer"])
    if restore_rng:
        restore_rng_state(payload["rng"])
    return {"step": payload["step"], "extra": payload["extra"]}


def _read_checkpoint(
    path: str | os.PathLike,
    owner: str,
    required: tuple[str, ...],
    signer: CheckpointSigner | None,
) -> dict[str, Any]:
    """The verified payload of a ``.pt`` checkpoint (never unpickling code), checked to be a dict
    holding ``required`` (and dicts of tensors under ``"model"`` / ``"critic"``)."""
    import torch

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{owner}: no checkpoint file at {str(path)!r}")
    problem = verify(path, signer=signer)
    if problem is not None:
        raise ValueError(
            f"{owner}: {path} is unusable: {problem}; load an earlier checkpoint instead "
            "(latest(<its directory>) names the newest intact one)"
        )
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"checkpoint {str(path)!r} holds objects other than tensors and plain containers, so "
            "it was not written by ar_torchrl.checkpoint (or it was tampered with); it is not "
            f"loaded, as unpickling it could run code. {str(err).splitlines()[0]}"
        ) from None
    except (RuntimeError, EOFError) as err:  # damage the checks above could not see
        raise ValueError(
            f"{owner}: {path} could not be read (damaged?): "
            f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
        ) from err
    _check_payload(payload, path, owner, required)
    return payload


def _check_payload(payload: Any, path: Path, owner: str, required: tuple[str, ...]) -> None:
    """A ``torch.save`` of something else (a list, a bare state dict) is named, not an
    ``AttributeError``/``KeyError`` further down."""
    expected = (
        f"expected a dict with {list(required)} (and 'critic' for a separate critic), as "
        "ar_torchrl.checkpoint saves them"
    )
    if not isinstance(payload, dict):
        raise ValueError(
            f"{owner}: {path} holds a {type(payload).__name__}, not a checkpoint: {expected}"
        )
    missing = [k for k in required if k not in payload]
    if missing:
        keys = sorted(map(str, payload))
        shown = f"{keys[:6]}{' ...' if len(keys) > 6 else ''}"
        raise ValueError(
            f"{owner}: {path} holds a dict without {missing} (its keys: {shown}; a bare "
            f"state_dict?), not a checkpoint: {expected}"
        )
    for key in ("model", "critic"):
        if key in payload and not isinstance(payload[key], dict):
            raise ValueError(
                f"{owner}: {path} holds a {type(payload[key]).__name__} under {key!r}, not a "
                f"state dict: {expected}"
            )


def load_critic(
    path: str | os.PathLike,
    *,
    critic: nn.Module | None,
    model: nn.Module,
    signer: CheckpointSigner | None = None,
) -> str:
    """Warm-start a critic from an earlier run's checkpoint (weights only: no optimizer state);
    returns what was loaded.

    ``critic`` (a separate critic's model) gets the checkpoint's separate critic, or, from a run
    whose critic was the value head, that run's policy with its head (the same architecture).
    Without ``critic`` the value head of ``model`` gets the checkpoint's head (PopArt statistics
    included); a separate critic's head sat on another trunk and is refused.

    Raises:
        ValueError: the file is not a checkpoint, or nothing in it fits (naming what it holds and
            what was asked).

    Example:
        >>> import tempfile
        >>> from ar_torchrl.models.tiny import build_tiny_qwen3
        >>> from ar_torchrl.modules import attach_value_head
        >>> old = attach_value_head(build_tiny_qwen3(99))
        >>> _ = old.value_head.bias.data.fill_(0.5)
        >>> p = save(tempfile.mkdtemp(), step=3, model=old)
        >>> new = attach_value_head(build_tiny_qwen3(99, seed=1))
        >>> load_critic(p, critic=None, model=new), new.value_head.bias.item()
        ('the value head of step_3.pt', 0.5)
    """
    payload = _read_checkpoint(path, "critic.init_from", _CRITIC_KEYS, signer)
    name = Path(path).name
    if critic is not None:
        saved, what = payload.get("critic"), f"the separate critic of {name}"
        if saved is None:
            saved, what = payload["model"], f"the policy and value head of {name} (a shared critic)"
        _load_strict(critic, saved, path, what)
        return what
    if "critic" in payload:
        raise ValueError(
            f"critic.init_from: {path} holds a separate critic, whose value head was trained on "
            "its own trunk; load it with critic=separate (the shared head cannot take it)"
        )
    saved = payload["model"]
    head = {
        k.removeprefix("value_head."): v for k, v in saved.items() if k.startswith("value_head.")
    }
    _load_strict(model.value_head, head, path, f"the value head of {name}")
    return f"the value head of {name}"


def _load_strict(module: nn.Module, state: dict, path, what: str) -> None:
    try:
        module.load_state_dict(state)
    except RuntimeError as err:
        raise ValueError(
            f"critic.init_from: {what} does not fit this run's critic ({str(path)!r}; another "
            f"model, or value_norm?): {str(err).splitlines()[0]} ..."
        ) from err
