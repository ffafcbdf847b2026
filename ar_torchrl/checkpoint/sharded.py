"""Distributed checkpoints: ``torch.distributed.checkpoint`` shards, atomic, never unpickling code.
:class:`~ar_torchrl.checkpoint.ShardedStore` is the interface a recipe uses; these are its functions.

Layout of ``<dir>/step_<N>/``: DCP's ``.metadata`` and ``__<rank>_*.distcp`` files (the sharded model
and optimizer tensors, each rank writing its own shards), ``rng/rank_<r>.json`` (each rank's Python,
NumPy, torch and CUDA RNG states) and ``meta.json`` (step, world size, optimizer hyper-parameters,
the caller's ``extra`` such as the collector state, the size and SHA-256 of every file, and a
SHA-256 of its own content).

Atomic: all ranks write into ``.step_<N>.tmp``; rank 0 hashes every file, writes ``meta.json`` last
and renames the directory (one ``os.rename``), so a crash mid-save leaves the previous checkpoint as
the newest one. A save that runs out of disk says so, naming the directory and the bytes (needed and
free), and removes its partial directory. :func:`verify` checks every file against ``meta.json``
(sizes, then content); :func:`latest` skips (and names, in a warning) a damaged, truncated or
incomplete checkpoint, and :func:`load` refuses one, naming the damaged file. A checkpoint saved
before checksums existed (sizes only) is "unverified": it loads after the size check, and this is
logged once.

The checksums detect damage, not tampering: with a :class:`~ar_torchrl.checkpoint.CheckpointSigner`
(``signer=``) rank 0 signs ``meta.json`` (HMAC-SHA256; it lists every file's SHA-256) and verifying
refuses an unsigned or wrongly signed checkpoint before any other file is read (docs/checkpoints.md).
Loading executes no code from the files: tensors are read with ``torch.load(weights_only=True)`` by
DCP, ``.metadata`` is unpickled through an allowlist of the exact classes DCP pickles there
(:mod:`ar_torchrl.checkpoint._safe_io`), everything else is JSON. The names before the store
(``save_distributed_checkpoint``, ``load_distributed_checkpoint``, ``latest_distributed_checkpoint``,
``verify_checkpoint``, ``load_distributed_critic``) still work for one release, with a
``DeprecationWarning`` naming the new one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from ar_torchrl.checkpoint._safe_io import (
    SafeReader,
    TensorsOnlyPlanner,
    decode,
    encode,
    rng_state,
    write_json,
)
from ar_torchrl.checkpoint._safe_io import restore_rng as _restore_rng_state
from ar_torchrl.checkpoint._space import free_bytes, is_disk_full, no_space_error, tensor_bytes
from ar_torchrl.checkpoint.naming import (
    checkpoint_name,
    checkpoint_step,
    is_checkpoint_name,
    list_checkpoints,
    replaced_dir,
    temp_dir,
)
from ar_torchrl.checkpoint.signing import SIGNATURE_KEY
from ar_torchrl.distributed.context import DistContext
from ar_torchrl.distributed.fsdp import reshard
from ar_torchrl.utils.files import file_sha256

if TYPE_CHECKING:
    from ar_torchrl.checkpoint.signing import CheckpointSigner

__all__ = ["latest", "load", "load_critic", "save", "verify"]

logger = logging.getLogger(__name__)
_META = "meta.json"
_FORMAT = 1
#: ``CheckpointSigner.sign(kind=...)`` of these manifests
_KIND = "sharded"
#: checkpoints without checksums already reported as unverified (logged once per directory)
_UNVERIFIED: set[str] = set()


def __getattr__(name: str) -> object:  # the names before the store, kept one release
    from ar_torchrl import _compat

    return _compat.renamed(__name__, name)


# --------------------------------------------------------------------------- save / verify / load
def _tensor_state(model: nn.Module, optimizer: torch.optim.Optimizer | None):
    reshard(model)
    if optimizer is None:
        return {"model": get_state_dict(model, [])[0]}, None
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd["state"]}, optim_sd["param_groups"]


def _file_sizes(root: Path) -> dict[str, int]:
    return {
        str(p.relative_to(root)): p.stat().st_size
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != _META
    }


def _digests(root: Path, names: list[str]) -> dict[str, str]:
    """SHA-256 of each file, several at a time (hashlib releases the GIL while hashing)."""
    if not names:
        return {}
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1, len(names))) as pool:
        return dict(zip(names, pool.map(lambda name: file_sha256(root / name), names)))


def _meta_digest(meta: dict) -> str:
    """SHA-256 of ``meta.json``'s content without its own digest and signature (the manifest
    vouches for itself: its ``extra`` holds the collector state)."""
    body = {k: v for k, v in meta.items() if k not in ("meta_sha256", SIGNATURE_KEY)}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def save(
    directory: str | os.PathLike,
    *,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    ctx: DistContext,
    extra: dict[str, Any] | None = None,
    keep_last: int | None = None,
    signer: CheckpointSigner | None = None,
) -> Path:
    """Every rank: write ``directory/step_<step>`` atomically and return its path.

    Args:
        directory: checkpoint directory, shared by all ranks (created if missing).
        step: completed training iterations.
        model: the (FSDP-sharded) module, e.g. the :class:`LMActorCritic` root.
        optimizer: its optimizer (states sharded like the parameters).
        ctx: this process's :class:`DistContext`.
        extra: what the run needs to continue (collector state, generator states...): dicts with
            str keys, lists, numbers, strings, CPU tensors (stored as JSON, no pickle).
        keep_last: delete older ``step_*`` directories beyond the newest ``keep_last``.
        signer: rank 0 signs ``meta.json`` (HMAC) so that a store with the same key accepts it.

    Raises:
        OSError: ``ENOSPC`` naming the directory and the bytes when the disk is full (rank 0
            removes the partial directory; the previous checkpoints are untouched).
    """
    directory = Path(directory)
    final = directory / checkpoint_name(step, sharded=True)
    tmp = temp_dir(final)
    if ctx.is_main:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier attempt
        tmp.mkdir()
    ctx.barrier()
    state, groups = _tensor_state(model, optimizer)
    free = free_bytes(directory)
    try:
        dcp.save(state, storage_writer=FileSystemWriter(tmp))
        write_json(tmp / "rng" / f"rank_{ctx.rank}.json", rng_state())
        ctx.barrier()
        if ctx.is_main:
            _finish(tmp, final, step, ctx.world_size, groups, extra, signer)
            if keep_last is not None:
                for old in list_checkpoints(directory, sharded=True)[:-keep_last]:
                    shutil.rmtree(old, ignore_errors=True)
            logger.info("saved distributed checkpoint %s", final)
    except BaseException as err:  # DCP's CheckpointException is a BaseException
        full = no_space_error(
            err, directory, needed=tensor_bytes(state), free=free, what=f"saving {final.name}"
        )
        if full is None:
            raise
        if ctx.is_main and is_disk_full(err):  # give the disk back (the next save would too)
            shutil.rmtree(tmp, ignore_errors=True)
        raise full from err
    ctx.barrier()
    return final


def _finish(tmp: Path, final: Path, step: int, world_size: int, groups, extra, signer) -> None:
    """Rank 0: hash every file, write ``meta.json`` last (its presence marks a complete
    checkpoint; signed with ``signer``), rename the directory into place."""
    files = _file_sizes(tmp)
    meta = {
        "format": _FORMAT,
        "step": int(step),
        "world_size": world_size,
        "param_groups": encode(groups),
        "extra": encode(extra or {}),
        "files": files,
        "sha256": _digests(tmp, list(files)),
    }
    meta["meta_sha256"] = _meta_digest(meta)
    if signer is not None:
        meta = signer.signed(meta, kind=_KIND)
    write_json(tmp / _META, meta)
    _replace_dir(tmp, final)


def _replace_dir(tmp: Path, final: Path) -> None:
    old = replaced_dir(final)
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    shutil.rmtree(old, ignore_errors=True)


def verify(path: str | os.PathLike, *, signer: CheckpointSigner | None = None) -> str | None:
    """What is wrong with the checkpoint at ``path`` (``None``: complete, intact and, with a
    ``signer``, authentic), naming the damaged file.

    Reads only ``meta.json`` (JSON) and hashes files: nothing is unpickled. With a ``signer``, first
    ``meta.json``'s HMAC (an unsigned or wrongly signed checkpoint is refused before any other file
    is read). Then that ``meta.json`` matches its own digest, that every file it lists has its size,
    then its SHA-256 (this reads every file: about 1 GB/s per file, several files at a time). A
    checkpoint saved before checksums existed is checked for sizes only ("unverified", logged once).

    Example:
        >>> import tempfile
        >>> verify(tempfile.mkdtemp())
        'meta.json is missing (an interrupted save?)'
    """
    path = Path(path)
    try:
        meta = json.loads((path / _META).read_text())
    except FileNotFoundError:
        return f"{_META} is missing (an interrupted save?)"
    except (OSError, ValueError) as err:
        return f"{_META} is unreadable: {err}"
    if signer is not None:
        problem = signer.problem(meta, kind=_KIND, what=path.name) or _signed_step(meta, path)
        if problem is not None:
            return problem
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else meta
        return f"{_META} has format {found!r}, expected {_FORMAT}"
    checksummed = "sha256" in meta or "meta_sha256" in meta  # else: saved before checksums
    if checksummed and meta.get("meta_sha256") != _meta_digest(meta):
        return f"{_META} does not match its own SHA-256 (damaged content)"
    try:
        files, digests = dict(meta["files"]), meta.get("sha256")
    except (KeyError, TypeError, ValueError) as err:
        return f"{_META} has no valid file list ({type(err).__name__}: {err})"
    problem = _check_file_list(files)
    if problem is not None:
        return problem
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, expected {size} (truncated?)"
    if not checksummed:
        if str(path) not in _UNVERIFIED:
            _UNVERIFIED.add(str(path))
            logger.warning(
                "checkpoint %s has no checksums in its %s (saved before checkpoints had them): it "
                "is unverified, only file sizes were checked",
                path,
                _META,
            )
        return None
    if not isinstance(digests, dict):
        return f"{_META} has no valid SHA-256 list (damaged?)"
    unlisted = sorted(set(files) - set(digests))
    if unlisted:
        return f"{_META} has no SHA-256 for {unlisted[:4]} (damaged?)"
    got = _digests(path, list(files))
    for name in files:
        if got[name] != digests[name]:
            return (
                f"{name} does not match its SHA-256 in {_META} (same size, damaged content: "
                f"{got[name][:16]}... instead of {str(digests[name])[:16]}...)"
            )
    return None


def _signed_step(meta: dict, path: Path) -> str | None:
    """An authentic ``meta.json`` in another step's ``step_<N>`` directory (a renamed checkpoint)."""
    if is_checkpoint_name(path.name, sharded=True) and meta.get("step") != checkpoint_step(path):
        return f"{path.name} carries the signed {_META} of step {meta.get('step')} (renamed?)"
    return None


def _check_file_list(files: dict) -> str | None:
    """Every checkpoint has DCP's ``.metadata``; no listed file lies outside the directory."""
    for name in files:
        if not isinstance(name, str) or Path(name).is_absolute() or ".." in Path(name).parts:
            return f"{_META} lists {name!r}, outside the checkpoint directory (damaged or forged)"
    if ".metadata" not in files:
        return f"{_META} does not list DCP's .metadata (not a complete checkpoint)"
    return None


def latest(
    directory: str | os.PathLike,
    ctx: DistContext | None = None,
    *,
    signer: CheckpointSigner | None = None,
) -> Path | None:
    """The newest intact ``step_*`` checkpoint in ``directory`` (``None``: there is none).

    Damaged ones (and, with a ``signer``, ones that are not authentic) are skipped with a warning
    naming them and the problem; nothing is unpickled. With a distributed ``ctx``, rank 0 decides
    and every rank gets its answer.

    Example:
        >>> import tempfile
        >>> latest(tempfile.mkdtemp()) is None
        True
    """
    choice = None
    if ctx is None or ctx.is_main:
        for path in reversed(list_checkpoints(directory, sharded=True)):
            problem = verify(path, signer=signer)
            if problem is None:
                choice = str(path)
                break
            logger.warning("checkpoint %s is unusable (%s); trying the previous one", path, problem)
    if ctx is not None:
        choice = ctx.broadcast_object(choice)
    return None if choice is None else Path(choice)


def _verified(path: Path, ctx: DistContext, signer, owner: str) -> None:
    """Rank 0 verifies (every file's SHA-256; with ``signer`` the HMAC first) and every rank gets
    its answer, before any rank reads DCP's pickled ``.metadata``."""
    problem = ctx.broadcast_object(verify(path, signer=signer) if ctx.is_main else None)
    if problem is not None:
        raise ValueError(f"{owner}: {path} is unusable: {problem}")


def load(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    ctx: DistContext,
    restore_rng: bool = True,
    signer: CheckpointSigner | None = None,
) -> dict[str, Any]:
    """Every rank: load model and optimizer shards, this rank's RNG states; return step and extra.

    The world size may differ from the saving run's (DCP reshards); RNG states are then not
    restored (a warning says so) and runs are not bit-identical to an uninterrupted one.

    Returns:
        ``{"step": int, "extra": dict, "path": Path}``.

    Raises:
        ValueError: the checkpoint is incomplete, damaged or (with a ``signer``) not authentic,
            naming the file. Rank 0 checks it (every file's SHA-256) and every rank gets its answer.
        pickle.UnpicklingError: ``.metadata`` refers to anything but DCP's metadata classes
            (naming it; nothing of it is executed).
    """
    path = Path(path)
    _verified(path, ctx, signer, "load_distributed_checkpoint")
    meta = json.loads((path / _META).read_text())
    state, groups = _tensor_state(model, optimizer)
    reader = SafeReader(path)
    stored = reader.read_metadata().state_dict_metadata
    missing = sorted(k for k in state["model"] if f"model.{k}" not in stored)
    if missing:
        raise ValueError(
            f"load_distributed_checkpoint: {path} has no {missing[:6]} "
            f"({len(missing)} model tensors missing; another model config?)"
        )
    # Optimizer states may be partial: parameters that never had a gradient (critic warm-up,
    # critic_coeff=0) have none saved; their state is dropped again after loading (see below).
    dcp.load(state, storage_reader=reader, planner=TensorsOnlyPlanner(allow_partial_load=True))
    optim_sd = None
    if optimizer is not None:
        optim_sd = {"state": state["optim"], "param_groups": _param_groups(meta, groups)}
    set_state_dict(
        model,
        optimizer if optimizer is not None else [],
        model_state_dict=state["model"],
        optim_state_dict=optim_sd or {},
    )
    if optimizer is not None:
        _drop_unsaved_states(model, optimizer, state["optim"], stored)
    rng_file = path / "rng" / f"rank_{ctx.rank}.json"
    if restore_rng and meta["world_size"] == ctx.world_size:
        _restore_rng_state(json.loads(rng_file.read_text()))
    elif restore_rng:
        logger.warning(
            "checkpoint %s was saved by %d ranks, this run has %d: RNG states are not restored",
            path,
            meta["world_size"],
            ctx.world_size,
        )
    logger.info("loaded distributed checkpoint %s (step %d)", path, meta["step"])
    return {"step": meta["step"], "extra": decode(meta["extra"]), "path": path}


def load_critic(
    path: str | os.PathLike,
    *,
    critic: nn.Module | None,
    policy: nn.Module,
    ctx: DistContext,
    signer: CheckpointSigner | None = None,
) -> str:
    """Every rank: warm-start a critic from an earlier run's distributed checkpoint (weights only,
    no optimizer state); returns what was loaded.

    ``critic`` (a separate critic, an FSDP root) gets the checkpoint's separate critic
    (``critic.*`` tensors), or from a run whose critic was the value head that run's policy with
    its head. Without ``critic`` the value head of ``policy`` (the policy's ``LMActorCritic`` root)
    gets the checkpoint's head; a separate critic's head is refused (it sat on its own trunk). The
    checkpoint is verified (and, with a ``signer``, authenticated) first, as :func:`load` does.
    """
    path = Path(path)
    _verified(path, ctx, signer, "critic.init_from")
    reader = SafeReader(path)
    stored = reader.read_metadata().state_dict_metadata
    separate = any(key.startswith("model.critic.") for key in stored)
    name = path.name
    if critic is not None:
        target, keep, prefix = critic, None, "critic." if separate else ""
        what = (
            f"the separate critic of {name}"
            if separate
            else (f"the policy and value head of {name} (a shared critic)")
        )
    elif separate:
        raise ValueError(
            f"critic.init_from: {path} holds a separate critic, whose value head was trained on "
            "its own trunk; load it with critic=separate (the shared head cannot take it)"
        )
    else:
        target, keep, prefix = policy, "model.value_head.", ""
        what = f"the value head of {name}"
    reshard(target)
    state = get_model_state_dict(target)
    if keep is not None:
        state = {k: v for k, v in state.items() if k.startswith(keep)}
    missing = sorted(k for k in state if f"model.{prefix}{k}" not in stored)
    if missing:
        raise ValueError(
            f"critic.init_from: {what} does not fit this run's critic: {path} has no "
            f"{[prefix + k for k in missing[:4]]} ({len(missing)} tensors; another model?)"
        )
    request = {"model": {prefix + k: v for k, v in state.items()}}
    dcp.load(request, storage_reader=reader, planner=TensorsOnlyPlanner(allow_partial_load=True))
    loaded = {k: request["model"][prefix + k] for k in state}
    set_model_state_dict(target, loaded, options=StateDictOptions(strict=keep is None))
    logger.info("critic.init_from: loaded %s", what)
    return what


def _drop_unsaved_states(model: nn.Module, optimizer, optim_state: dict, stored) -> None:
    """Forget the optimizer state of parameters the checkpoint has none for (DCP's state-dict
    helpers initialise every state with a zero-learning-rate step, which counts as one AdamW step)."""
    params = dict(model.named_parameters())
    for fqn, entry in optim_state.items():
        if not any(f"optim.{fqn}.{key}" in stored for key in entry):
            optimizer.state.pop(params[fqn], None)


def _param_groups(meta: dict, current: list[dict]) -> list[dict]:
    """Saved hyper-parameters (tuples restored where the current group has tuples)."""
    saved = decode(meta["param_groups"])
    if len(saved) != len(current):
        raise ValueError(
            f"load_distributed_checkpoint: the checkpoint has {len(saved)} optimizer param groups, "
            f"the optimizer has {len(current)} (another optimizer config?)"
        )
    return [
        {k: tuple(v) if isinstance(cur.get(k), tuple) else v for k, v in s.items()}
        for s, cur in zip(saved, current)
    ]
