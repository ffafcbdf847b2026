"""Run management shared by recipes: run directories, resuming, signals, the end-of-run report.

Nothing here imports torch or Hydra, and nothing depends on the checkpoint format: a recipe's entry
point gives it what Hydra knows (the run directory, the overrides, the config name) as a
:class:`Launch`, and its :class:`~ar_torchrl.checkpoint.CheckpointStore` (which finds, names and
verifies its checkpoints; :func:`~ar_torchrl.checkpoint.checkpoint_store` chooses it).

- **Resuming** (:func:`find_checkpoint`, the one place that decides): ``train.resume_from`` names a
  checkpoint, a run directory, or ``auto`` (the newest run under ``runs_dir`` whose saved
  configuration equals this one up to the keys a continued run may change); a run directory that
  already holds checkpoints is continued. :func:`named_checkpoint` resolves a checkpoint or a run
  directory (also for ``critic.init_from``).
- **History** (:func:`prepare_run_dir`): the run directory's metrics and logs are made to end at the
  checkpoint's step (copied from the checkpoint's own run when it is another one), so that a resumed
  run never repeats a step.
- **Signals** (:class:`StopOnSignal`): the first SIGINT/SIGTERM ends the run after its iteration
  with a checkpoint; a second one stops at once.
- **Report** (:func:`report_lines`): the reward summary, the last evaluation and the command that
  continues the run, as printed by the entry point.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import signal
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ar_torchrl.checkpoint.naming import (
    checkpoint_step,
    is_checkpoint_name,
    remove_partial_checkpoints,
)
from ar_torchrl.utils.history import read_jsonl, truncate_jsonl
from ar_torchrl.utils.loggers import truncate_csv_logs

if TYPE_CHECKING:
    from ar_torchrl.checkpoint import CheckpointStore

__all__ = [
    "Launch",
    "StopOnSignal",
    "find_checkpoint",
    "launcher_command",
    "make_private",
    "named_checkpoint",
    "newest_matching_checkpoint",
    "prepare_run_dir",
    "remove_empty_run_dir",
    "report_lines",
    "resume_command",
    "summary_line",
    "world_size",
]

logger = logging.getLogger(__name__)

Latest = Callable[[Path], "Path | None"]


@dataclass(frozen=True)
class Launch:
    """How this run was started (what Hydra knows; the entry point fills it in).

    Attributes:
        run_dir: the run directory (Hydra's ``runtime.output_dir``).
        config_name: the primary config's name (``--config-name``).
        default_config_name: the entry point's default config name (not repeated in commands).
        overrides: the command-line overrides, as typed.
        script: the entry point's path (``sys.argv[0]``), or the arguments that name it
            (``("-m", "ar_torchrl.recipes.dapo_ppo")``).
    """

    run_dir: Path
    config_name: str
    default_config_name: str
    overrides: Sequence[str] = field(default_factory=tuple)
    script: str | Sequence[str] = ""


# --------------------------------------------------------------------------- the launch
def world_size() -> int:
    """Processes of this launch: ``WORLD_SIZE`` (set by torchrun), else 1."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launcher_command() -> list[str]:
    """The interpreter and launcher that run this process, as a command prefix a user can paste:
    ``[sys.executable]``, or torchrun (``python -m torch.distributed.run``) with its process
    counts (``--standalone`` on one node; several nodes need their own rendezvous flags).

    Example:
        >>> launcher_command() == [sys.executable]  # a plain `python` launch
        True
    """
    if world_size() == 1:
        return [sys.executable]
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size()))
    nodes = world_size() // per_node
    node_flags = [f"--nnodes={nodes}"] if nodes > 1 else ["--standalone"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *node_flags,
        f"--nproc-per-node={per_node}",
    ]


def resume_command(launch: Launch, *extra: str) -> str:
    """The command line that continues this run: the same interpreter, launcher, config and
    overrides, ``train.resume_from=<run dir>`` and ``extra`` (replacing keys they set)."""
    replaced = {a.split("=", 1)[0] for a in ("train.resume_from=", *extra)}
    args = [a for a in launch.overrides if a.split("=", 1)[0] not in replaced]
    config = []
    if launch.config_name != launch.default_config_name:
        config = ["--config-name", launch.config_name]
    resume = f"train.resume_from={launch.run_dir}"
    entry = [launch.script] if isinstance(launch.script, str) else list(launch.script)
    return shlex.join([*launcher_command(), *entry, *config, *args, resume, *extra])


# --------------------------------------------------------------------------- resuming
def find_checkpoint(
    source: str | None,
    *,
    store: CheckpointStore | None = None,
    run_dir: Path,
    runs_dir: Path,
    iterations: int,
    matches: Callable[[Path], bool],
    resumable: Sequence[str],
    latest: Latest | None = None,
    check: Callable[[Path], None] | None = None,
    kind: str | None = None,
) -> Path | None:
    """The checkpoint to continue from, or ``None`` for a fresh start.

    Args:
        source: ``train.resume_from``: ``None``, ``"auto"``, a checkpoint or a run directory.
        store: the run's checkpoint store (finds, names and verifies its checkpoints).
        run_dir: this run's directory (continued when it already holds checkpoints).
        runs_dir: where ``auto`` searches.
        iterations: the run's ``train.iterations`` (a checkpoint at or past it leaves nothing to do).
        matches: whether a run directory's saved configuration equals this run's (for ``auto``).
        resumable: the keys a continued run may change (named in the ``auto`` message).
        latest, check, kind: what ``store`` gives (``latest``, ``check``, ``pattern``), as the
            callables of before the store: deprecated, removed in ar_torchrl 0.2.

    Raises:
        FileNotFoundError: nothing to resume where it was asked for.
        ValueError: the checkpoint is of the wrong kind, damaged, not authentic, or already at
            ``iterations``.
    """
    if store is None:
        store = _CallableStore(latest, check, kind)
    if source is None:
        found = store.latest(run_dir / "checkpoints")
    elif source == "auto":
        found = newest_matching_checkpoint(runs_dir, store.latest, matches)
        if found is None:
            raise FileNotFoundError(
                f"train.resume_from=auto: no run directory under runs_dir={runs_dir} has this "
                f"configuration (up to {list(resumable)}) and a checkpoint; pass "
                "train.resume_from=<run dir>, or drop train.resume_from to start afresh"
            )
    else:
        found = named_checkpoint(
            source,
            store,
            key="train.resume_from",
            note=" (a run stopped before its first checkpoint starts afresh)",
        )
    if found is not None and checkpoint_step(found) >= iterations:
        raise ValueError(
            f"{found} is at step {checkpoint_step(found)}, train.iterations={iterations}: "
            "nothing left to do (raise train.iterations to train further)"
        )
    return found


def named_checkpoint(
    source: str | os.PathLike, store: CheckpointStore, *, key: str, note: str = ""
) -> Path:
    """The checkpoint ``source`` names (a checkpoint, or a run directory's newest intact one),
    checked by ``store`` (its kind, integrity and, with a key, authenticity).

    Raises:
        FileNotFoundError: ``source`` is neither (``note`` is appended to the message).
        ValueError: the checkpoint is of the other kind, damaged or not authentic (naming ``key``).
    """
    path = Path(source)
    named = path.is_file() or (path.is_dir() and is_checkpoint_name(path.name))
    found = path if named else store.latest(path / "checkpoints")
    if found is None:
        raise FileNotFoundError(
            f"{key}={source}: neither a checkpoint nor a run directory with "
            f"checkpoints/{store.pattern}{note}"
        )
    store.check(found, key=key)
    return found


class _CallableStore:
    """The store :func:`find_checkpoint` builds from the callables of before the store."""

    def __init__(self, latest: Latest | None, check, kind: str | None) -> None:
        if latest is None or check is None or kind is None:
            raise TypeError("find_checkpoint: pass store= (a CheckpointStore)")
        warnings.warn(
            "find_checkpoint(latest=, check=, kind=) is now find_checkpoint(store=) with an "
            "ar_torchrl.checkpoint.CheckpointStore; the old keywords are removed in ar_torchrl 0.2",
            DeprecationWarning,
            stacklevel=3,
        )
        self.latest, self._check, self.pattern = latest, check, kind

    def check(self, checkpoint: Path, *, key: str) -> None:
        self._check(checkpoint)


def newest_matching_checkpoint(
    runs_dir: Path, latest: Latest, matches: Callable[[Path], bool]
) -> Path | None:
    """The newest checkpoint of a run under ``runs_dir`` whose saved config ``matches``.

    ``matches`` gets the path of a run's saved configuration (Hydra's ``.hydra/config.yaml``); the
    checkpoints of runs that do not match are not even verified.
    """
    best = None
    for saved in sorted(runs_dir.glob("**/.hydra/config.yaml")):
        if not matches(saved):
            continue
        found = latest(saved.parent.parent / "checkpoints")
        if found is not None and (best is None or found.stat().st_mtime > best.stat().st_mtime):
            best = found
    return best


def without_keys(container: dict, keys: Iterable[str]) -> dict:
    """``container`` (a nested dict) without the dotted ``keys``.

    Example:
        >>> without_keys({"train": {"iterations": 3, "mode": "sync"}}, ["train.iterations"])
        {'train': {'mode': 'sync'}}
    """
    for key in keys:
        *parents, leaf = key.split(".")
        node = container
        for part in parents:
            node = node.get(part, {})
        node.pop(leaf, None)
    return container


# --------------------------------------------------------------------------- the run directory
def prepare_run_dir(run_dir: Path, checkpoint: Path | None) -> None:
    """Make the run directory's history end at the checkpoint (no checkpoint: no history).

    A checkpoint of another run directory brings its history along (``metrics.jsonl``, ``logs/``).
    Records after the checkpoint's step are dropped (they are recomputed), in ``metrics.jsonl``
    (a torn last line included) and TorchRL's CSV logs, so a re-run never repeats a step; files of
    a checkpoint save that was killed mid-write are removed.
    """
    step = -1 if checkpoint is None else checkpoint_step(checkpoint)
    source = checkpoint.parent.parent if checkpoint is not None else run_dir
    other_run = checkpoint is not None and checkpoint.parent.name == "checkpoints"
    if other_run and source.resolve() != run_dir.resolve():
        logger.info("continuing %s at step %d: copying its history", source, step)
        for name in ("metrics.jsonl", "logs"):
            if (source / name).is_file():
                shutil.copy2(source / name, run_dir / name)
            elif (source / name).is_dir():
                shutil.copytree(source / name, run_dir / name, dirs_exist_ok=True)
    remove_partial_checkpoints(run_dir / "checkpoints")
    truncate_jsonl(run_dir / "metrics.jsonl", step)
    truncate_csv_logs(run_dir / "logs", step)


def make_private(run_dir: Path) -> None:
    """Make the run directory readable by its owner only (mode 0700, its ``*.log`` files 0600): the
    logs and the saved configuration may name servers, paths and options that are nobody else's
    business, and SGLang's own log holds its server arguments."""
    run_dir.chmod(0o700)
    for log in run_dir.glob("*.log"):
        log.chmod(0o600)


def remove_empty_run_dir(run_dir: Path, *, keep: Iterable[str] = ()) -> bool:
    """Remove a run directory that holds nothing but Hydra's own files (``.hydra/`` and the job
    log): what a rejected configuration leaves. Returns whether it was removed."""
    if not run_dir.is_dir():
        return False
    hydra_files = {".hydra", *keep}
    if any(p.name not in hydra_files and p.suffix != ".log" for p in run_dir.iterdir()):
        return False
    if any(p.suffix == ".log" and p.stat().st_size for p in run_dir.iterdir()):
        return False
    shutil.rmtree(run_dir, ignore_errors=True)
    return True


# --------------------------------------------------------------------------- signals
class StopOnSignal:
    """SIGINT (Ctrl-C) and SIGTERM handling for a training loop.

    Once ``graceful`` is set (the loop is running), the first signal sets ``requested``: the loop
    finishes its iteration, saves a checkpoint and returns. Before that, and for a second signal,
    ``KeyboardInterrupt`` is raised at once (a checkpoint save in progress leaves no file behind).

    Example:
        >>> with StopOnSignal() as stop:
        ...     stop.graceful = True
        ...     os.kill(os.getpid(), signal.SIGTERM)
        >>> stop.requested, stop.name
        (True, 'SIGTERM')
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self.graceful = False
        self._previous: dict = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    def __enter__(self) -> StopOnSignal:
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame) -> None:
        if not self.graceful or self.requested:
            self.signum = self.signum or signum
            raise KeyboardInterrupt
        self.signum = signum
        name = signal.Signals(signum).name
        logger.warning("%s: stopping after this iteration (%s again: now)", name, name)


# --------------------------------------------------------------------------- the report
def summary_line(history: list[dict], key: str = "rollout/reward_mean") -> str | None:
    """``SUMMARY reward_first=... reward_last=... rise=...``: the mean of ``key`` over the first and
    the last 20 % of the iterations (``None`` without any).

    Example:
        >>> summary_line([{"rollout/reward_mean": r} for r in (-1.0, 0.0, 0.0, 0.0, 1.0)])
        'SUMMARY reward_first=-1.0000 reward_last=1.0000 rise=+2.0000'
    """
    rewards = [h[key] for h in history if h.get(key) is not None]
    if not rewards:
        return None
    k = max(1, len(rewards) // 5)
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    return f"SUMMARY reward_first={first:.4f} reward_last={last:.4f} rise={last - first:+.4f}"


def report_lines(
    launch: Launch,
    *,
    iterations: int,
    stopped: str | None,
    checkpoint: Path | None,
    prog: str,
) -> list[str]:
    """What a finished or stopped run says: the reward summary, the run directory, the last
    evaluation (``final`` only when the run reached ``iterations``), and the command that trains
    further or resumes it (``prog`` names the recipe in messages)."""
    metrics = launch.run_dir / "metrics.jsonl"
    history = read_jsonl(metrics) if metrics.exists() else []
    lines = [line for line in [summary_line(history)] if line]
    lines.append(f"run directory: {launch.run_dir}")
    evals = [h for h in history if h.get("eval/reward_mean") is not None]
    if evals:
        e = evals[-1]
        which = "final evaluation" if e["step"] == iterations else "last evaluation"
        lines.append(
            f"{which} (step {e['step']}): eval/reward_mean={e['eval/reward_mean']:+.4f} "
            f"eval/accuracy={e['eval/accuracy']:.4f}"
        )
    if stopped is None:
        lines.append(
            f"train further: {resume_command(launch, f'train.iterations={2 * iterations}')}"
        )
    elif checkpoint is None:
        lines.append(f"{prog}: {stopped} before the first checkpoint: run it again to start afresh")
    else:
        lines.append(f"{prog}: {stopped}; last checkpoint: {checkpoint}")
        lines.append(f"resume: {resume_command(launch)}")
    return lines
