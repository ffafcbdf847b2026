"""Atomic, checksummed training checkpoints: model (with value head), optimizer, RNG states, step,
data position.

A checkpoint is one ``torch.save`` file written to a temporary name in the same directory and renamed
into place (``os.replace`` is atomic on POSIX), so a crash never leaves a half-written checkpoint
under the final name; a temporary file left by a killed process is removed by the next save (and by
:func:`remove_partial_checkpoints`). Resuming restores every RNG stream (Python, NumPy, torch CPU and
CUDA), so the resumed run draws the same samples an uninterrupted run would.

Integrity: after the data, each save writes a small manifest ``.step_<N>.pt.manifest.json`` (also
atomically) with the file's size and SHA-256, computed while the file is written. Choosing the
checkpoint to resume (:func:`latest_checkpoint`) and loading one (:func:`load_checkpoint`) check it
against the manifest (:func:`verify_checkpoint_file`): a truncated, empty or bit-flipped newest
checkpoint is skipped, with a warning naming it, for the previous intact one; loading a damaged one
is an error naming it. A checkpoint without a manifest (written before manifests existed) is
"unverified": it loads after a check of its zip structure and of the CRC-32 of each record (what
``torch.save`` writes), which catches truncation and most damage; this is logged once.

Loading never executes code from the file: it uses ``torch.load(weights_only=True)``, which accepts
only tensors and plain containers (dicts, lists, tuples, numbers, strings), so everything saved is
kept in that form (the NumPy RNG state is stored as a tensor).

torch is imported by the functions that need it: finding checkpoints (:func:`latest_checkpoint`) is
cheap, so a recipe can locate the one to resume before it imports the training stack.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ar_torchrl.utils.checks import check_number
from ar_torchrl.utils.files import file_sha256

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "capture_rng_state",
    "checkpoint_step",
    "latest_checkpoint",
    "load_checkpoint",
    "load_critic_weights",
    "remove_partial_checkpoints",
    "restore_rng_state",
    "save_checkpoint",
    "verify_checkpoint_file",
]

logger = logging.getLogger(__name__)
_NAME = re.compile(r"^step_(\d+)\.pt$")
_PARTIAL = re.compile(r"^\.step_\d+\.pt(\.manifest\.json)?-.*\.tmp$")
_MANIFEST_FORMAT = 1
#: checkpoints without a manifest already reported as unverified (logged once per file)
_UNVERIFIED: set[str] = set()
# torch.distributed.checkpoint directories (ar_torchrl.checkpoint.sharded): step_<N>/, written
# as .step_<N>.tmp/ and renamed; .step_<N>.old/ is a replaced one being deleted.
_DCP_NAME = re.compile(r"^step_(\d+)$")
_DCP_PARTIAL = re.compile(r"^\.step_\d+\.(tmp|old)$")


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


def save_checkpoint(
    directory: str | os.PathLike,
    *,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
    keep_last: int | None = None,
    critic: nn.Module | None = None,
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

    Example:
        >>> import tempfile
        >>> from torch import nn
        >>> d = tempfile.mkdtemp(); net = nn.Linear(2, 1)
        >>> p = save_checkpoint(d, step=3, model=net, extra={"data_position": 48})
        >>> p.name, load_checkpoint(p, model=net)["extra"]["data_position"]
        ('step_3.pt', 48)
    """
    import torch

    check_number("save_checkpoint", "keep_last", keep_last, ge=1, integer=True, allow_none=True)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    remove_partial_checkpoints(directory)
    payload = {
        "step": int(step),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "rng": capture_rng_state(),
        "extra": extra or {},
    }
    if critic is not None:
        payload["critic"] = critic.state_dict()
    target = directory / f"step_{int(step)}.pt"
    manifest = _manifest_path(target)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{target.name}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            hashing = _HashingWriter(f)
            torch.save(payload, hashing)
            f.flush()
            os.fsync(f.fileno())
        # A manifest of an earlier save of this step would not match the new file.
        manifest.unlink(missing_ok=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    record = {
        "format": _MANIFEST_FORMAT,
        "file": target.name,
        "size": hashing.size,
        "sha256": hashing.sha256.hexdigest(),
    }
    _write_atomically(manifest, json.dumps(record).encode())  # after the data: it vouches for it
    logger.info("saved checkpoint %s", target)
    if keep_last is not None:
        for old in _checkpoints(directory)[:-keep_last]:
            old.unlink(missing_ok=True)
            _manifest_path(old).unlink(missing_ok=True)
    return target


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


def _manifest_path(checkpoint: Path) -> Path:
    return checkpoint.with_name(f".{checkpoint.name}.manifest.json")


def verify_checkpoint_file(path: str | os.PathLike) -> str | None:
    """What is wrong with the checkpoint file at ``path`` (``None``: intact), naming the file.

    Checks the size and SHA-256 in its manifest (``.step_<N>.pt.manifest.json``, written by
    :func:`save_checkpoint`); it reads the whole file (SHA-256 runs at about 1 GB/s). A file
    without a manifest (saved before manifests existed) is unverified: only its zip structure and
    the CRC-32 of each record are checked, and this is logged once per file.

    Example:
        >>> import tempfile
        >>> from torch import nn
        >>> p = save_checkpoint(tempfile.mkdtemp(), step=1, model=nn.Linear(2, 1))
        >>> verify_checkpoint_file(p) is None
        True
        >>> _ = p.write_bytes(p.read_bytes()[:100])
        >>> verify_checkpoint_file(p)
        'step_1.pt has 100 bytes, its manifest .step_1.pt.manifest.json says ... (truncated?)'
    """
    path = Path(path)
    if not path.is_file():
        return f"{path.name} is missing"
    size = path.stat().st_size
    if size == 0:
        return f"{path.name} is empty (0 bytes)"
    manifest = _manifest_path(path)
    try:
        record = json.loads(manifest.read_text())
        want_size, want_sha256 = int(record["size"]), str(record["sha256"])
    except FileNotFoundError:
        return _check_unverified(path)
    except (OSError, ValueError, TypeError, KeyError) as err:
        return f"its manifest {manifest.name} is unreadable ({type(err).__name__}: {err})"
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
            _manifest_path(path).name,
        )
    return None


def _checkpoints(directory: Path) -> list[Path]:
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def checkpoint_step(path: str | os.PathLike) -> int:
    """The step of a checkpoint: a file ``step_<step>.pt`` or a distributed checkpoint directory
    ``step_<step>`` (:mod:`ar_torchrl.checkpoint.sharded`).

    Example:
        >>> checkpoint_step("runs/a/checkpoints/step_40.pt"), checkpoint_step("runs/b/checkpoints/step_8")
        (40, 8)
    """
    match = _NAME.match(Path(path).name) or _DCP_NAME.match(Path(path).name)
    if match is None:
        raise ValueError(
            f"{str(path)!r} is not a checkpoint name (step_<N>.pt, or step_<N> for a distributed one)"
        )
    return int(match.group(1))


def remove_partial_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Delete the temporary files of saves that were killed mid-write; return what was deleted.

    Also the temporary (``.step_<N>.tmp``) and replaced (``.step_<N>.old``) directories of
    distributed checkpoints. Only one process may write checkpoints into ``directory`` (a
    temporary file of a save still in progress elsewhere would be deleted too).

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp()); _ = (d / ".step_3.pt-x1y2.tmp").write_bytes(b"half")
        >>> [p.name for p in remove_partial_checkpoints(d)], list(d.iterdir())
        (['.step_3.pt-x1y2.tmp'], [])
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = sorted(
        p
        for p in directory.iterdir()
        if _PARTIAL.match(p.name) or (p.is_dir() and _DCP_PARTIAL.match(p.name))
    )
    for path in removed:
        logger.warning("removing %s: a checkpoint save that did not finish", path)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return removed


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The intact ``step_*.pt`` with the highest step in ``directory`` (``None``: there is none).

    Each candidate, newest first, is checked with :func:`verify_checkpoint_file`; a damaged one
    (truncated, empty, other content than its manifest says) is skipped with a warning naming the
    file and the problem.

    Example:
        >>> import tempfile
        >>> from torch import nn
        >>> d = tempfile.mkdtemp(); net = nn.Linear(2, 1)
        >>> _ = save_checkpoint(d, step=2, model=net); _ = save_checkpoint(d, step=10, model=net)
        >>> latest_checkpoint(d).name
        'step_10.pt'
    """
    directory = Path(directory)
    if not directory.is_dir():
        return None
    for path in reversed(_checkpoints(directory)):
        problem = verify_checkpoint_file(path)
        if problem is None:
            return path
        logger.warning("checkpoint %s is unusable (%s); trying the previous one", path, problem)
    return None


def load_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    restore_rng: bool = True,
    critic: nn.Module | None = None,
) -> dict[str, Any]:
    """Load a checkpoint into ``model`` (strict), ``critic`` (a separate critic's model, strict)
    and ``optimizer``; restore RNG states.

    The file is first checked against its manifest (:func:`verify_checkpoint_file`), then read
    with ``torch.load(weights_only=True)``: nothing in it is executed.

    Returns:
        ``{"step": int, "extra": dict}``.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file is damaged (naming it and the problem), holds more than tensors and
            plain containers, or does not match ``model`` / ``optimizer``.

    Example:
        >>> import tempfile
        >>> from torch import nn
        >>> net = nn.Linear(2, 1); p = save_checkpoint(tempfile.mkdtemp(), step=1, model=net)
        >>> load_checkpoint(p, model=nn.Linear(3, 1))
        Traceback (most recent call last):
        ...
        ValueError: checkpoint ... does not match the model ...
    """
    payload = _read_checkpoint(path, "load_checkpoint")
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


def _read_checkpoint(path: str | os.PathLike, owner: str) -> dict[str, Any]:
    """The verified payload of a ``.pt`` checkpoint (never unpickling code)."""
    import torch

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{owner}: no checkpoint file at {str(path)!r}")
    problem = verify_checkpoint_file(path)
    if problem is not None:
        raise ValueError(
            f"{owner}: {path} is unusable: {problem}; load an earlier checkpoint instead "
            "(latest_checkpoint(<its directory>) names the newest intact one)"
        )
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"checkpoint {str(path)!r} holds objects other than tensors and plain containers, so "
            "it was not written by ar_torchrl.checkpoint.local.save_checkpoint (or it was tampered "
            "with); it is not loaded, as unpickling it could run code. "
            f"{str(err).splitlines()[0]}"
        ) from None
    except (RuntimeError, EOFError) as err:  # damage the checks above could not see
        raise ValueError(
            f"{owner}: {path} could not be read (damaged?): "
            f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
        ) from err
    return payload


def load_critic_weights(
    path: str | os.PathLike, *, critic: nn.Module | None, model: nn.Module
) -> str:
    """Warm-start a critic from an earlier run's checkpoint (weights only: no optimizer state);
    returns what was loaded.

    ``critic`` (a separate critic's model) gets the checkpoint's separate critic, or, from a run
    whose critic was the value head, that run's policy with its head (the same architecture).
    Without ``critic`` the value head of ``model`` gets the checkpoint's head (PopArt statistics
    included); a separate critic's head sat on another trunk and is refused.

    Raises:
        ValueError: nothing in the checkpoint fits (naming what it holds and what was asked).

    Example:
        >>> import tempfile
        >>> from ar_torchrl.models.tiny import build_tiny_qwen3
        >>> from ar_torchrl.modules import attach_value_head
        >>> old = attach_value_head(build_tiny_qwen3(99))
        >>> _ = old.value_head.bias.data.fill_(0.5)
        >>> p = save_checkpoint(tempfile.mkdtemp(), step=3, model=old)
        >>> new = attach_value_head(build_tiny_qwen3(99, seed=1))
        >>> load_critic_weights(p, critic=None, model=new), new.value_head.bias.item()
        ('the value head of step_3.pt', 0.5)
    """
    payload = _read_checkpoint(path, "critic.init_from")
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
