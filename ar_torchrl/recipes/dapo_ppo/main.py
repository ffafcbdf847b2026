"""The DAPO-PPO recipe from a composed configuration to a finished (or stopped) run.

:func:`cli` is the command line (the console script ``ar-torchrl-dapo``, ``python -m
ar_torchrl.recipes.dapo_ppo`` and ``examples/dapo_ppo.py``): ``--help`` and a typo'd key are
answered before Hydra, then Hydra composes the shipped configs (:data:`~ar_torchrl.recipes.config.
CONFIG_DIR`, whatever the working directory) and calls :func:`run`. :func:`run` validates the
configuration (before torch is imported), opens the execution strategy, finds the checkpoint to
continue from, prepares the run directory, handles signals, builds and trains
(:mod:`ar_torchrl.recipes.dapo_ppo.loop`, the slow imports), exports the trained policy as an HF
directory (``train.export``), plots the curves and returns what the entry point prints and its exit
status. Hydra is imported by :func:`cli` only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shlex
import signal
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ar_torchrl.recipes import launch as run_management
from ar_torchrl.recipes.config import (
    CONFIG_DIR,
    check_overrides,
    component_imports,
    import_components,
    render_help,
)
from ar_torchrl.recipes.dapo_ppo.config import (
    GROUPS,
    Config,
    config_schema,
    schemas,
    validate_config,
)
from ar_torchrl.recipes.launch import (
    Launch,
    StopOnSignal,
    make_private,
    named_checkpoint,
    prepare_run_dir,
    remove_empty_run_dir,
    report_lines,
    without_keys,
)

__all__ = [
    "PROG",
    "RESUMABLE_CHANGES",
    "Result",
    "checkpoint_to_resume",
    "cli",
    "help_text",
    "hydra_argv",
    "launch_argv",
    "run",
]

logger = logging.getLogger("dapo_ppo")

PROG = "dapo_ppo"

#: Keys a continued run may change; ``train.resume_from=auto`` ignores them when it matches configs.
RESUMABLE_CHANGES = (
    "train.iterations",
    "train.resume_from",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.plot",
    "train.export",
    "train.critic_warn_iters",
    "train.save_rollouts",
    "dist.timeout_s",
)

#: Keys added since a run's saved config may have been written, with their defaults: a saved config
#: without them matches (``train.resume_from=auto``) as if it had the defaults.
ADDED_KEYS = {
    "imports": [],
    "rollout.env": None,
    "rollout.env_options": {},
    "checkpoint.hmac_key_env": None,
    "algo.gae.critic_lmbda": None,
    "algo.critic_warmup_until_ev": None,
    "critic.pretrain_from": None,
    "critic.pretrain_epochs": 10,
    "train.critic_warn_iters": 20,
    "train.save_rollouts": False,
    "rollout.shared_prefix": False,
}

#: What ``--help`` says above the groups and keys.
HELP_HEADER = """DAPO-math PPO (token-level GAE + value head, or GRPO / RLOO) with TorchRL.
Override any key (algo.lr=1e-4 train.iterations=50), pick a group option (algo=grpo), resume a run
(train.resume_from=auto or train.resume_from=<run dir>). README: what the default reproduces."""


@dataclass
class Result:
    """What the entry point prints (``lines``: stdout, or stderr for a failed start) and returns."""

    status: int = 0
    lines: list[str] = field(default_factory=list)


def hydra_argv(argv: list[str]) -> list[str]:
    """Hydra's arguments for this process: under torchrun, ranks > 0 write no Hydra files and log
    to stdout (rank 0 alone writes the run directory's ``.hydra/`` and log)."""
    if int(os.environ.get("RANK", "0")) > 0:
        return [*argv, "hydra.output_subdir=null", "hydra/job_logging=stdout"]
    return argv


def _flag(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """The values of a command-line flag (``--config-dir DIR`` or ``--config-dir=DIR``)."""
    found = []
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in names:
            found.append(value if eq else (argv[i + 1] if i + 1 < len(argv) else ""))
    return [v for v in found if v]


def launch_argv(config_dir: Path, argv: list[str]) -> list[str]:
    """What the entry point does before Hydra composes: import the modules of the config's
    ``imports:`` list (a user's components register themselves, so their names can be chosen),
    check every ``key=value`` override against the schemas (a typo'd key gets the closest known
    one here: Hydra's own answer is to add it with ``+``), and return Hydra's arguments
    (:func:`hydra_argv`).

    Raises:
        ValueError: a module that does not import, or a key that no schema has.

    Example:
        >>> from pathlib import Path
        >>> launch_argv(CONFIG_DIR, ["dapo_ppo.py", "algo.lr=1e-4"])
        ['dapo_ppo.py', 'algo.lr=1e-4']
        >>> launch_argv(CONFIG_DIR, ["dapo_ppo.py", "algo.lrr=1e-4"])
        Traceback (most recent call last):
        ...
        ValueError: config: no key 'algo.lrr' (did you mean 'algo.lr'?); `--help` lists every key
    """
    args = argv[1:]
    dirs = [
        Path(config_dir),
        *map(Path, _flag(args, ("--config-dir", "-cd", "--config-path", "-cp"))),
    ]
    name = (_flag(args, ("--config-name", "-cn")) or ["dapo_ppo"])[-1]
    import_components(component_imports(dirs, name, args))
    check_overrides(config_schema(), GROUPS, dirs, name, args)
    return hydra_argv(argv)


def help_text(config_dir: Path, argv: list[str], command: str | None = None) -> str:
    """``--help``: config groups, and every key of the chosen configuration with its comment;
    ``command`` (how the recipe was started) ends it."""
    name = (_flag(argv[1:], ("--config-name", "-cn")) or ["dapo_ppo"])[-1]
    overrides = [a for a in argv[1:] if "=" in a and not a.startswith("-")]
    return render_help(
        config_dir, name, app=PROG, header=HELP_HEADER, overrides=overrides, command=command
    )


def _with_added_keys(container: dict) -> dict:
    """``container`` with every key of :data:`ADDED_KEYS` it lacks set to its default."""
    for key, default in ADDED_KEYS.items():
        *parents, leaf = key.split(".")
        node = container
        for part in parents:
            node = node.setdefault(part, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.setdefault(leaf, default)
    return container


def _matches(raw: DictConfig):
    want = without_keys(OmegaConf.to_container(raw, resolve=False), RESUMABLE_CHANGES)

    def matches(saved: Path) -> bool:
        other = _with_added_keys(OmegaConf.to_container(OmegaConf.load(saved), resolve=False))
        return without_keys(other, RESUMABLE_CHANGES) == want

    return matches


def checkpoint_to_resume(cfg: Config, raw: DictConfig, run_dir: Path, store) -> Path | None:
    """The checkpoint to continue from (``train.resume_from``, see
    :func:`ar_torchrl.recipes.launch.find_checkpoint`), or ``None`` for a fresh start; ``store`` is the
    run's :class:`~ar_torchrl.checkpoint.CheckpointStore`."""
    return run_management.find_checkpoint(
        cfg.train.resume_from,
        store=store,
        run_dir=run_dir,
        runs_dir=Path(cfg.runs_dir),
        iterations=cfg.train.iterations,
        matches=_matches(raw),
        resumable=RESUMABLE_CHANGES,
    )


def find_checkpoint(cfg: Config, raw: DictConfig, run_dir: Path, strategy=None) -> Path | None:
    """Deprecated (removed in ar_torchrl 0.2): :func:`checkpoint_to_resume` with the run's
    checkpoint store (the execution strategy no longer knows checkpoints)."""
    from ar_torchrl.checkpoint import checkpoint_store

    warnings.warn(
        "ar_torchrl.recipes.dapo_ppo.find_checkpoint(cfg, raw, run_dir, strategy) is now "
        "ar_torchrl.recipes.dapo_ppo.checkpoint_to_resume(cfg, raw, run_dir, store) (store: "
        "ar_torchrl.checkpoint.checkpoint_store); the old name is removed in ar_torchrl 0.2",
        DeprecationWarning,
        stacklevel=2,
    )
    store = checkpoint_store(
        sharded=cfg.sharded,
        ctx=getattr(strategy, "ctx", None),
        hmac_key_env=cfg.checkpoint.hmac_key_env,
    )
    return checkpoint_to_resume(cfg, raw, run_dir, store)


def find_critic_source(cfg: Config, store) -> Path | None:
    """The checkpoint ``critic.init_from`` names (a checkpoint, or a run directory's newest intact
    one), checked by the run's checkpoint store; ``None`` without a warm start."""
    if cfg.critic.init_from is None:
        return None
    return named_checkpoint(cfg.critic.init_from, store, key="critic.init_from")


def check_pretrain_source(cfg: Config) -> None:
    """``critic.pretrain_from`` names a run directory with saved rollouts (FileNotFoundError
    otherwise, naming the key and how to save them)."""
    if cfg.critic.pretrain_from is not None:
        from ar_torchrl.recipes.dapo_ppo.rollouts import rollout_files

        rollout_files(cfg.critic.pretrain_from)


def run(raw: DictConfig, launch: Launch) -> Result:
    """Validate, resume or start, train, report. A user error (bad value, nothing to resume) is a
    status-1 :class:`Result` naming it; SIGINT/SIGTERM give 130/143 with a checkpoint."""
    try:  # what a user can get wrong is checked here, before the slow imports
        cfg = validate_config(raw)
    except (TypeError, ValueError) as err:
        remove_empty_run_dir(launch.run_dir)
        return Result(1, [f"{PROG}: {err}"])
    plot = cfg.train.plot and _can_plot()
    logger.info("loading torch, transformers and TorchRL, then building the run")
    from ar_torchrl.checkpoint import checkpoint_store
    from ar_torchrl.recipes.strategy import open_strategy  # torch

    with open_strategy(
        sharded=cfg.sharded,
        device=cfg.device,
        compute_dtype=cfg.model.dtype,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        reshard_after_forward=cfg.dist.reshard_after_forward,
        backend=cfg.dist.backend,
        timeout_s=cfg.dist.timeout_s,
    ) as strategy:
        main = strategy.ctx.is_main
        run_dir = strategy.shared_run_dir(launch.run_dir)
        launch = dataclasses.replace(launch, run_dir=run_dir)
        try:
            store = checkpoint_store(
                sharded=cfg.sharded, ctx=strategy.ctx, hmac_key_env=cfg.checkpoint.hmac_key_env
            )
            checkpoint = strategy.on_main(checkpoint_to_resume, cfg, raw, run_dir, store)
            critic_source = strategy.on_main(find_critic_source, cfg, store)
            strategy.on_main(check_pretrain_source, cfg)
        except (TypeError, ValueError, FileNotFoundError) as err:
            return Result(1, [f"{PROG}: {err}"] if main else [])
        if main:
            make_private(run_dir)
            prepare_run_dir(run_dir, checkpoint)
        ended, stop, exported = None, StopOnSignal(), {}
        try:
            # The stack stops a launched SGLang server and closes clients, also on errors.
            with stop, contextlib.ExitStack() as stack:
                from ar_torchrl.recipes.dapo_ppo import loop  # transformers, TorchRL

                state = loop.setup(
                    cfg, run_dir, checkpoint, stack, strategy, critic_source, store=store
                )
                stop.graceful = (
                    True  # from now on the first signal ends the run after its iteration
                )
                step = loop.train(state, stop)
                if not stop.requested and step == cfg.train.iterations:
                    exported = loop.export(state)
            if stop.requested:
                ended = f"stopped by {stop.name} after iteration {step}"
        except KeyboardInterrupt:
            stop.signum = stop.signum or signal.SIGINT
            ended = f"interrupted ({stop.name})"
        last = store.latest(run_dir / "checkpoints") if main else None
    status = 128 + stop.signum if stop.requested else 0
    if not main:
        return Result(status)
    if plot and ended is None:
        _plot(run_dir)
    lines = report_lines(
        launch, iterations=cfg.train.iterations, stopped=ended, checkpoint=last, prog=PROG
    )
    at = 1 + next(i for i, line in enumerate(lines) if line.startswith("run directory:"))
    lines[at:at] = [f"exported {name}: {path}" for name, path in exported.items()]
    return Result(status, lines)


def _command(argv0: str, script: str | Sequence[str] | None) -> str:
    """How the user started the recipe, for ``--help``'s last line."""
    if script is not None and not isinstance(script, str):
        return shlex.join(["python", *script])
    entry = argv0 if script is None else script
    return f"python {entry}" if entry.endswith(".py") else Path(entry).name


def cli(script: str | Sequence[str] | None = None) -> None:
    """The recipe's command line: ``sys.argv`` holds Hydra's overrides (``key=value``,
    ``group=option``, ``--config-name``, ``--config-dir``) or ``--help``; exits with the run's
    status. ``script``: how the resume command names this entry point (default ``sys.argv[0]``;
    ``("-m", "ar_torchrl.recipes.dapo_ppo")`` for ``python -m``)."""
    argv = list(sys.argv)
    if "--help" in argv[1:] or "-h" in argv[1:]:
        sys.exit(print(help_text(CONFIG_DIR, argv, _command(argv[0], script)), end=""))
    try:  # the config's `imports:` (your own components), then a typo'd key, before Hydra
        sys.argv = launch_argv(CONFIG_DIR, argv)
    except ValueError as err:
        sys.exit(print(f"{PROG}: {err}", file=sys.stderr) or 1)
    import hydra
    from hydra.core.config_store import ConfigStore
    from hydra.core.hydra_config import HydraConfig

    for group, name, schema in schemas():  # typed keys of every config group option
        ConfigStore.instance().store(group=group, name=name, node=schema)

    def task(raw: DictConfig) -> None:
        hydra_cfg = HydraConfig.get()
        launch = Launch(
            run_dir=Path(hydra_cfg.runtime.output_dir),
            config_name=hydra_cfg.job.config_name,
            default_config_name="dapo_ppo",
            overrides=list(hydra_cfg.overrides.task),
            script=argv[0] if script is None else script,
        )
        result = run(raw, launch)
        print(*result.lines, sep="\n", file=sys.stderr if result.status == 1 else sys.stdout)
        sys.exit(result.status)

    # Hydra names the job after the task's module: the run's log is <run_dir>/dapo_ppo.log.
    task.__module__ = "ar_torchrl.recipes.dapo_ppo"
    main = hydra.main(config_path=str(CONFIG_DIR), config_name="dapo_ppo", version_base="1.3")
    main(task)()


def _can_plot() -> bool:
    """Whether ``train.plot`` can draw (matplotlib, the ``[plot]`` extra, is installed); warns
    once, at the start, when it cannot (the run goes on without ``curves.png``)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is not None:
        return True
    logger.warning(
        "train.plot=true but matplotlib is not installed: no curves.png at the end "
        "(pip install 'ar_torchrl[plot]', or train.plot=false)"
    )
    return False


def _plot(run_dir: Path) -> None:
    from ar_torchrl.utils import plot_training_curves, read_jsonl

    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        history = read_jsonl(metrics)
        if history:
            plot_training_curves(history, run_dir / "curves.png")
