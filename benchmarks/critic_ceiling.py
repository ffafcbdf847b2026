"""Benchmark: the critic's ceiling, what a perfect critic of a frozen policy could explain (issue 27).

For a fixed policy (the starting policy of a configuration, i.e. its warm start, or a run's
checkpoint), sample ``--samples`` (K) responses for each of ``--prompts`` (P) prompts with the
recipe's own sampling settings and reward, group the trained tokens by state (prompt + response
prefix) and report the explained-variance ceilings ``1 - E[Var(R | state)] / Var(R)``:

* token level: every trained token's Monte-Carlo return (gamma = 1: the outcome plus any later
  per-token shaping), grouped by prompt + response prefix: the bound of ``critic/explained_variance``;
* prompt level: every sample's return grouped by prompt: what the prompt alone tells;
* by position: the token level over the first / middle / last third of each response;
* within prompt: the token level after removing each prompt's mean return, the bound of
  ``critic/explained_variance_within_prompt`` (what a critic can know beyond the prompt).

Within-state variances are unbiased (``n - 1``); a state seen once (a singleton) has none and is left
out of the within-state estimate and counted (its bias: ar_torchrl/functional/ceiling.py). The
standard errors are bootstraps over prompts. Library part: ``ar_torchrl.recipes.ceiling``.

Run:
    .venv/bin/python benchmarks/critic_ceiling.py --config-name critic_arithmetic   # its warm start
    .venv/bin/python benchmarks/critic_ceiling.py --run outputs/<date>/<time>       # newest checkpoint
    .venv/bin/python benchmarks/critic_ceiling.py --checkpoint <run>/checkpoints/step_150.pt --run <run>
    .venv/bin/python benchmarks/critic_ceiling.py --samples 32 --prompts 96 --set seed=1

Prints a table and writes ``benchmarks/results/critic_ceiling_<config>.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from _common import ROOT, code_version, machine_info, write_json

RESULTS = ROOT / "benchmarks" / "results"


def compose(config_name: str, overrides: list[str]):
    """The recipe's typed configuration ``config_name`` with Hydra ``overrides``."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.config_store import ConfigStore

    from ar_torchrl.recipes.config import CONFIG_DIR
    from ar_torchrl.recipes.dapo_ppo import schemas, validate_config

    for group, name, schema in schemas():  # as examples/dapo_ppo.py stores them
        ConfigStore.instance().store(group=group, name=name, node=schema)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return validate_config(hydra_compose(config_name=config_name, overrides=overrides))


def run_config(run_dir: Path) -> tuple[str, list[str]]:
    """The config name and overrides a recipe run was launched with (its ``.hydra/``)."""
    from omegaconf import OmegaConf

    hydra_dir = run_dir / ".hydra"
    if not (hydra_dir / "hydra.yaml").is_file():
        raise SystemExit(f"--run {run_dir}: no .hydra/hydra.yaml (not a recipe run directory)")
    name = OmegaConf.load(hydra_dir / "hydra.yaml").hydra.job.config_name
    overrides = [str(o) for o in OmegaConf.load(hydra_dir / "overrides.yaml")]
    return name, [o for o in overrides if not o.startswith("hydra.")]


def group_by(report, rows, key: str) -> dict[str, dict]:
    """Mean return and prompts per value of ``extra_info[key]`` (e.g. a task's difficulty)."""
    out: dict[str, dict] = {}
    for p in report.per_prompt:
        value = str((rows[p["prompt_id"]].get("extra_info") or {}).get(key))
        g = out.setdefault(value, {"prompts": 0, "samples": 0, "return_sum": 0.0})
        g["prompts"] += 1
        g["samples"] += p["samples"]
        g["return_sum"] += p["return_mean"] * p["samples"]
    return {
        k: {
            "prompts": g["prompts"],
            "samples": g["samples"],
            "return_mean": g["return_sum"] / g["samples"],
        }
        for k, g in sorted(out.items())
    }


def table(report) -> str:
    def row(name, est):
        return (
            f"| {name} | {est.ceiling:.3f} | {est.stderr:.3f} | {est.total_var:.3f} | "
            f"{est.within_var:.3f} | {est.items} | {est.states} | {est.singletons} |"
        )

    lines = [
        "| level | EV ceiling | stderr | Var(R) | E[Var(R given state)] | items | states | singletons |",
        "|---|---|---|---|---|---|---|---|",
        row("prompt (samples)", report.prompt),
        row("token", report.token),
    ]
    lines += [row(f"token, {k} third", v) for k, v in report.by_position.items()]
    if report.within_prompt is not None:
        lines.append(row("token, within prompt", report.within_prompt))
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config-name", default=None, help="recipe config (default dapo_ppo)")
    p.add_argument(
        "--run", type=Path, default=None, help="a recipe run: its config (and newest checkpoint)"
    )
    p.add_argument(
        "--checkpoint", type=Path, default=None, help="a .pt checkpoint (default: --run's newest)"
    )
    p.add_argument(
        "--warm-start",
        action="store_true",
        help="with --run: its starting policy, not a checkpoint",
    )
    p.add_argument("--samples", type=int, default=16, help="K responses per prompt (>= 2)")
    p.add_argument("--prompts", type=int, default=64, help="P prompts")
    p.add_argument("--split", choices=("train", "holdout"), default="train")
    p.add_argument("--bootstrap", type=int, default=200, help="bootstrap replicates of the stderr")
    p.add_argument("--seed", type=int, default=0, help="prompt order, sampling and bootstrap seed")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--group-by", default="digits", help="extra_info field to split returns by")
    p.add_argument("--set", action="append", default=[], help="extra Hydra override (repeatable)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.samples < 2 or args.prompts < 2:
        p.error("--samples and --prompts must be >= 2")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    from ar_torchrl.checkpoint import LocalStore
    from ar_torchrl.recipes.ceiling import ceiling_of_config

    torch.set_num_threads(args.threads)
    name, overrides = args.config_name or "dapo_ppo", []
    if args.run is not None:
        name, overrides = run_config(args.run)
        if args.config_name and args.config_name != name:
            raise SystemExit(f"--run {args.run} ran --config-name {name}, not {args.config_name}")
    cfg = compose(name, [*overrides, *args.set])
    checkpoint = args.checkpoint
    if checkpoint is None and args.run is not None and not args.warm_start:
        checkpoint = LocalStore().latest(args.run / "checkpoints")
        if checkpoint is None:
            raise SystemExit(f"--run {args.run}: no intact checkpoint under checkpoints/")
    start = time.perf_counter()
    report = ceiling_of_config(
        cfg,
        checkpoint=checkpoint,
        prompts=args.prompts,
        samples_per_prompt=args.samples,
        split=args.split,
        bootstrap=args.bootstrap,
        seed=args.seed,
    )
    seconds = time.perf_counter() - start
    train_rows, held_rows = cfg.data.build()
    rows = train_rows if args.split == "train" else held_rows
    policy = str(checkpoint) if checkpoint else f"the starting policy of {name}"
    print(
        f"critic ceiling of {policy}: {len(report.per_prompt)} {args.split} rows "
        f"({report.prompts} distinct prompts) x {args.samples} samples"
    )
    print(table(report))
    groups = group_by(report, rows, args.group_by)
    print(
        f"mean return {report.return_mean:+.3f}, response length {report.response_length:.1f}; by {args.group_by}:"
    )
    for value, g in groups.items():
        print(
            f"  {args.group_by}={value}: {g['prompts']} prompts, mean return {g['return_mean']:+.3f}"
        )
    result = {
        "config": {
            "config_name": name,
            "overrides": [*overrides, *args.set],
            "checkpoint": None if checkpoint is None else str(checkpoint),
            "samples_per_prompt": args.samples,
            "prompts": args.prompts,
            "split": args.split,
            "bootstrap": args.bootstrap,
            "seed": args.seed,
            "threads": args.threads,
            **code_version(),
        },
        "machine": machine_info(),
        "seconds": seconds,
        "results": {**report.as_dict(), "by_group": {args.group_by: groups}},
    }
    out = args.out or RESULTS / f"critic_ceiling_{name}.json"
    write_json(result, out)
    print(f"wrote {out} ({seconds:.0f} s)")
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
