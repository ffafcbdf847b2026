"""The DAPO-PPO recipe from a composed configuration to a finished (or stopped) run.

:func:`run` is what ``examples/dapo_ppo.py`` calls inside ``@hydra.main``: it validates the
configuration (before torch is imported), opens the execution strategy, finds the checkpoint to
continue from, prepares the run directory, handles signals, builds and trains
(:mod:`ar_torchrl.recipes.dapo_ppo.loop`, the slow imports), plots the curves and returns what the
entry point prints and its exit status.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ar_torchrl.recipes import run as runs
from ar_torchrl.recipes.config import (
    check_overrides,
    component_imports,
    import_components,
    render_help,
)
from ar_torchrl.recipes.dapo_ppo.config import GROUPS, Config, config_schema, validate_config

__all__ = [
    "PROG",
    "RESUMABLE_CHANGES",
    "Result",
    "checkpoint_to_resume",
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
        >>> configs = Path(__file__).resolve().parents[3] / "configs"
        >>> launch_argv(configs, ["dapo_ppo.py", "algo.lr=1e-4"])
        ['dapo_ppo.py', 'algo.lr=1e-4']
        >>> launch_argv(configs, ["dapo_ppo.py", "algo.lrr=1e-4"])
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


def help_text(config_dir: Path, argv: list[str]) -> str:
    """``--help``: config groups, and every key of the chosen configuration with its comment."""
    name = "dapo_ppo"
    if "--config-name" in argv and argv.index("--config-name") + 1 < len(argv):
        name = argv[argv.index("--config-name") + 1]
    overrides = [a for a in argv[1:] if "=" in a and not a.startswith("-")]
    return render_help(config_dir, name, app=PROG, header=HELP_HEADER, overrides=overrides)


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
    want = runs.without_keys(OmegaConf.to_container(raw, resolve=False), RESUMABLE_CHANGES)

    def matches(saved: Path) -> bool:
        other = _with_added_keys(OmegaConf.to_container(OmegaConf.load(saved), resolve=False))
        return runs.without_keys(other, RESUMABLE_CHANGES) == want

    return matches


def checkpoint_to_resume(cfg: Config, raw: DictConfig, run_dir: Path, store) -> Path | None:
    """The checkpoint to continue from (``train.resume_from``, see
    :func:`ar_torchrl.recipes.run.find_checkpoint`), or ``None`` for a fresh start; ``store`` is the
    run's :class:`~ar_torchrl.checkpoint.CheckpointStore`."""
    return runs.find_checkpoint(
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
    return runs.named_checkpoint(cfg.critic.init_from, store, key="critic.init_from")


def check_pretrain_source(cfg: Config) -> None:
    """``critic.pretrain_from`` names a run directory with saved rollouts (FileNotFoundError
    otherwise, naming the key and how to save them)."""
    if cfg.critic.pretrain_from is not None:
        from ar_torchrl.recipes.dapo_ppo.rollouts import rollout_files

        rollout_files(cfg.critic.pretrain_from)


def run(raw: DictConfig, launch: runs.Launch) -> Result:
    """Validate, resume or start, train, report. A user error (bad value, nothing to resume) is a
    status-1 :class:`Result` naming it; SIGINT/SIGTERM give 130/143 with a checkpoint."""
    try:  # what a user can get wrong is checked here, before the slow imports
        cfg = validate_config(raw)
    except (TypeError, ValueError) as err:
        runs.remove_empty_run_dir(launch.run_dir)
        return Result(1, [f"{PROG}: {err}"])
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
            runs.make_private(run_dir)
            runs.prepare_run_dir(run_dir, checkpoint)
        ended, stop = None, runs.StopOnSignal()
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
            if stop.requested:
                ended = f"stopped by {stop.name} after iteration {step}"
        except KeyboardInterrupt:
            stop.signum = stop.signum or signal.SIGINT
            ended = f"interrupted ({stop.name})"
        last = store.latest(run_dir / "checkpoints") if main else None
    status = 128 + stop.signum if stop.requested else 0
    if not main:
        return Result(status)
    if cfg.train.plot and ended is None:
        _plot(run_dir)
    lines = runs.report_lines(
        launch, iterations=cfg.train.iterations, stopped=ended, checkpoint=last, prog=PROG
    )
    return Result(status, lines)


def _plot(run_dir: Path) -> None:
    from ar_torchrl.utils import plot_training_curves, read_jsonl

    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        history = read_jsonl(metrics)
        if history:
            plot_training_curves(history, run_dir / "curves.png")
