"""Distributed checkpoints: ``torch.distributed.checkpoint`` shards, atomic, never unpickling code.

Layout of ``<dir>/step_<N>/``: DCP's ``.metadata`` and ``__<rank>_*.distcp`` files (the sharded model
and optimizer tensors, each rank writing its own shards), ``rng/rank_<r>.json`` (each rank's Python,
NumPy, torch and CUDA RNG states) and ``meta.json`` (step, world size, optimizer hyper-parameters,
the caller's ``extra`` such as the collector state, the size and SHA-256 of every file, and a
SHA-256 of its own content).

Atomic: all ranks write into ``.step_<N>.tmp``; rank 0 hashes every file, writes ``meta.json`` last
and renames the directory (one ``os.rename``), so a crash mid-save leaves the previous checkpoint as
the newest one. :func:`verify_checkpoint` checks every file against ``meta.json`` (sizes, then
content); :func:`latest_distributed_checkpoint` skips (and names, in a warning) a damaged,
truncated or incomplete checkpoint, and :func:`load_distributed_checkpoint` refuses one, naming the
damaged file. A checkpoint saved before checksums existed (sizes only) is "unverified": it loads
after the size check, and this is logged once. Loading executes no code from the files: tensors
are read with ``torch.load(weights_only=True)`` by DCP, ``.metadata`` is unpickled through an
allowlist of DCP's own metadata classes, everything else is JSON.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

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
from ar_torchrl.distributed.context import DistContext
from ar_torchrl.distributed.fsdp import reshard
from ar_torchrl.utils.files import file_sha256

__all__ = [
    "latest_distributed_checkpoint",
    "load_distributed_checkpoint",
    "load_distributed_critic",
    "save_distributed_checkpoint",
    "verify_checkpoint",
]

logger = logging.getLogger(__name__)
_NAME = re.compile(r"^step_(\d+)$")
_META = "meta.json"
_FORMAT = 1
#: checkpoints without checksums already reported as unverified (logged once per directory)
_UNVERIFIED: set[str] = set()


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
    """SHA-256 of ``meta.json``'s content without its own digest (the manifest vouches for itself:
    its ``extra`` holds the collector state)."""
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def save_distributed_checkpoint(
    directory: str | os.PathLike,
    *,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    ctx: DistContext,
    extra: dict[str, Any] | None = None,
    keep_last: int | None = None,
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
    """
    directory = Path(directory)
    final, tmp = directory / f"step_{int(step)}", directory / f".step_{int(step)}.tmp"
    if ctx.is_main:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier attempt
        tmp.mkdir()
    ctx.barrier()
    state, groups = _tensor_state(model, optimizer)
    dcp.save(state, storage_writer=FileSystemWriter(tmp))
    write_json(tmp / "rng" / f"rank_{ctx.rank}.json", rng_state())
    ctx.barrier()
    if ctx.is_main:
        files = _file_sizes(tmp)
        meta = {
            "format": _FORMAT,
            "step": int(step),
            "world_size": ctx.world_size,
            "param_groups": encode(groups),
            "extra": encode(extra or {}),
            "files": files,
            "sha256": _digests(tmp, list(files)),
        }
        meta["meta_sha256"] = _meta_digest(meta)
        write_json(tmp / _META, meta)  # last: its presence marks a complete checkpoint
        _replace_dir(tmp, final)
        if keep_last is not None:
            for old in _checkpoints(directory)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        logger.info("saved distributed checkpoint %s", final)
    ctx.barrier()
    return final


def _replace_dir(tmp: Path, final: Path) -> None:
    old = final.with_name(f".{final.name}.old")
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


def _checkpoints(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def verify_checkpoint(path: str | os.PathLike) -> str | None:
    """What is wrong with the checkpoint at ``path`` (``None``: complete and intact), naming the
    damaged file.

    Checks that ``meta.json`` exists, parses and matches its own digest, that every file it lists
    has its size, then its SHA-256 (this reads every file: about 1 GB/s per file, several files at
    a time). A checkpoint saved before checksums existed is checked for sizes only ("unverified",
    logged once).

    Example:
        >>> import tempfile
        >>> verify_checkpoint(tempfile.mkdtemp())
        'meta.json is missing (an interrupted save?)'
    """
    path = Path(path)
    try:
        meta = json.loads((path / _META).read_text())
    except FileNotFoundError:
        return f"{_META} is missing (an interrupted save?)"
    except (OSError, ValueError) as err:
        return f"{_META} is unreadable: {err}"
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


def latest_distributed_checkpoint(
    directory: str | os.PathLike, ctx: DistContext | None = None
) -> Path | None:
    """The newest intact ``step_*`` checkpoint in ``directory`` (``None``: there is none).

    Damaged ones are skipped with a warning naming them and the problem. With a distributed
    ``ctx``, rank 0 decides and every rank gets its answer.
    """
    choice = None
    if ctx is None or ctx.is_main:
        for path in reversed(_checkpoints(Path(directory))):
            problem = verify_checkpoint(path)
            if problem is None:
                choice = str(path)
                break
            logger.warning("checkpoint %s is unusable (%s); trying the previous one", path, problem)
    if ctx is not None:
        choice = ctx.broadcast_object(choice)
    return None if choice is None else Path(choice)


def load_distributed_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    ctx: DistContext,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Every rank: load model and optimizer shards, this rank's RNG states; return step and extra.

    The world size may differ from the saving run's (DCP reshards); RNG states are then not
    restored (a warning says so) and runs are not bit-identical to an uninterrupted one.

    Returns:
        ``{"step": int, "extra": dict, "path": Path}``.

    Raises:
        ValueError: the checkpoint is incomplete or damaged (naming the damaged file). Rank 0
            checks it (every file's SHA-256) and every rank gets its answer.
    """
    path = Path(path)
    problem = ctx.broadcast_object(verify_checkpoint(path) if ctx.is_main else None)
    if problem is not None:
        raise ValueError(f"load_distributed_checkpoint: {path} is unusable: {problem}")
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


def load_distributed_critic(
    path: str | os.PathLike, *, critic: nn.Module | None, policy: nn.Module, ctx: DistContext
) -> str:
    """Every rank: warm-start a critic from an earlier run's distributed checkpoint (weights only,
    no optimizer state); returns what was loaded.

    ``critic`` (a separate critic, an FSDP root) gets the checkpoint's separate critic
    (``critic.*`` tensors), or from a run whose critic was the value head that run's policy with
    its head. Without ``critic`` the value head of ``policy`` (the policy's ``LMActorCritic`` root)
    gets the checkpoint's head; a separate critic's head is refused (it sat on its own trunk).
    """
    path = Path(path)
    problem = ctx.broadcast_object(verify_checkpoint(path) if ctx.is_main else None)
    if problem is not None:
        raise ValueError(f"critic.init_from: {path} is unusable: {problem}")
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
