"""The algorithm options of the recipe on the CPU default, side by side: do they still learn, and do
their logged diagnostics show them acting?

Each *variant* is a set of recipe overrides (below, :data:`VARIANTS`); each runs for
``--iterations`` (default 100, the CI version of the CPU default) over its seeds, with
``OMP_NUM_THREADS=1``. Per run: reward rise (mean reward of the last 20 % of iterations minus the
first 20 %), held-out greedy accuracy at step 0 and at the end, whether every logged number is
finite, and the run-mean of the variant's diagnostics (e.g. ``train/tis_weight_mean``). Runs live in
``--runs`` (default ``outputs/algo_options``) and a finished run is not repeated, so the table can
be built over several sittings; ``--jobs 2`` runs two at once (wall times are then not comparable:
this is not a speed benchmark). Output: a table on stdout, JSON in
``benchmarks/results/algo_options.json`` and, with ``--write-docs``, the block of docs/evidence.md.

Commands::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/experiments/algo_options.py --jobs 2            # every variant
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/experiments/algo_options.py --only async_decoupled async_none
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/experiments/algo_options.py --quick             # smoke test
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # benchmarks/_common.py
from _common import code_version, machine_info, read_history, replace_marked_block, write_json
from readme_figures import figures, run_recipe

ROOT = Path(__file__).resolve().parents[2]

#: ``name -> (overrides, seeds, diagnostics)``: the diagnostics are the logged keys whose run-mean
#: the table shows (they say whether the option acted).
VARIANTS: dict[str, tuple[tuple[str, ...], int, tuple[str, ...]]] = {
    "sync": ((), 5, ("train/kl_ref", "train/explained_variance")),
    "async_decoupled": (
        ("train.mode=async",),
        5,
        ("rollout/policy_lag", "train/tis_weight_mean", "train/tis_weight_capped"),
    ),
    "async_none": (
        ("train.mode=async", "train.async_correction=none"),
        5,
        ("rollout/policy_lag", "train/rollout_log_prob_abs_diff"),
    ),
    "kl_k1": (("algo.kl_estimator=k1",), 1, ("train/kl_ref", "train/loss_kl")),
    "kl_k2": (("algo.kl_estimator=k2",), 1, ("train/kl_ref", "train/loss_kl")),
    "kl_k3_unbiased": (("algo.kl_estimator=k3_unbiased",), 1, ("train/kl_ref", "train/loss_kl")),
    "kl_in_reward": (
        ("algo.kl_in_reward=0.1", "algo.kl_coeff=0"),
        1,
        ("train/kl_in_reward", "train/explained_variance"),
    ),
    "async_icepop": (
        ("train.mode=async", "algo.rollout_correction.preset=icepop"),
        1,
        ("train/tis_weight_mean", "train/rollout_masked_tokens", "train/rollout_abs_log_ratio"),
    ),
    "async_seq_is_mis": (
        ("train.mode=async", "algo.rollout_correction.preset=seq_is_mis"),
        1,
        ("train/tis_weight_mean", "train/tis_weight_capped", "train/rollout_masked_seqs"),
    ),
    "cispo": (("algo.policy_loss=cispo",), 1, ("train/pg_clipfrac", "train/clip_fraction")),
    "gspo_token": (("algo.policy_loss=gspo_token",), 1, ("train/pg_clipfrac",)),
    "grpo": (("algo=grpo",), 1, ("train/pg_clipfrac",)),
    "grpo_gspo": (
        ("algo=grpo", "algo.policy_loss=gspo", "algo.loss_agg_mode=seq_mean_token_mean"),
        1,
        ("train/pg_clipfrac",),
    ),
    "dynamic": (
        ("rollout.dynamic_sampling=true",),
        5,
        ("train/explained_variance", "rollout/groups_zero_spread"),
    ),
    "dynamic_critic_flat": (
        ("rollout.dynamic_sampling=true", "rollout.critic_flat_groups=true"),
        5,
        (
            "train/explained_variance",
            "train/explained_variance_policy_rows",
            "rollout/groups_critic_only",
        ),
    ),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", choices=sorted(VARIANTS), help="these variants only")
    p.add_argument("--iterations", type=int, default=100)
    p.add_argument("--seeds", type=int, default=None, help="cap every variant's seed count")
    p.add_argument("--jobs", type=int, default=1, help="runs at once")
    p.add_argument("--runs", type=Path, default=ROOT / "outputs" / "algo_options")
    p.add_argument("--quick", action="store_true", help="4 iterations, 1 seed, a temporary dir")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--write-docs",
        "--write-readme",  # its name before the table moved to docs/
        action="store_true",
        help="replace the table block in docs/evidence.md",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.iterations, args.seeds = 4, 1
    name = "algo_options_quick.json" if args.quick else "algo_options.json"
    args.out = args.out or ROOT / "benchmarks" / "results" / name
    return args


def _all_finite(history: list[dict]) -> bool:
    return all(
        math.isfinite(v)
        for h in history
        for v in h.values()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    )


def one_run(
    run_dir: Path,
    cache: Path,
    overrides: tuple[str, ...],
    seed: int,
    iterations: int,
    diagnostics: tuple[str, ...],
) -> dict:
    """Run (unless ``run_dir`` already holds ``iterations`` iterations) and summarise one seed."""
    history = read_history(run_dir)
    done = sum("rollout/reward_mean" in h for h in history) >= iterations
    wall = None
    if not done:
        shutil.rmtree(run_dir, ignore_errors=True)  # a partial run (killed) starts again
        run = run_recipe(
            run_dir,
            cache,
            f"train.iterations={iterations}",
            f"train.eval_every={iterations}",
            "train.checkpoint_every=0",
            "logger=none",
            f"seed={seed}",
            *overrides,
        )
        history, wall = read_history(run_dir), run["wall_s"]
    steps = [h for h in history if "rollout/reward_mean" in h]
    return {
        "seed": seed,
        "wall_s": wall,
        "all_finite": _all_finite(history),
        **figures(history),
        "diagnostics": {
            key: sum(h[key] for h in steps if key in h) / max(1, sum(key in h for h in steps))
            for key in diagnostics
        },
        "diagnostics_logged": {key: sum(key in h for h in steps) for key in diagnostics},
    }


def measure(args: argparse.Namespace) -> dict:
    names = args.only or list(VARIANTS)
    cache = Path(os.environ.get("AR_TORCHRL_CACHE", ROOT / ".cache" / "ar_torchrl"))
    tmp = tempfile.TemporaryDirectory(prefix="algo_options_") if args.quick else None
    runs = Path(tmp.name) if tmp else args.runs
    jobs = []
    for name in names:
        overrides, seeds, diagnostics = VARIANTS[name]
        for seed in range(min(seeds, args.seeds or seeds)):
            run_dir = runs / f"{name}_it{args.iterations}_s{seed}"
            jobs.append((name, (run_dir, cache, overrides, seed, args.iterations, diagnostics)))
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [(name, pool.submit(one_run, *job)) for name, job in jobs]
        results: dict[str, list[dict]] = {}
        for name, future in futures:
            results.setdefault(name, []).append(future.result())
    if tmp:
        tmp.cleanup()
    return {
        "machine": machine_info(),
        "code": code_version(),
        "iterations": args.iterations,
        "variants": {
            name: {"overrides": list(VARIANTS[name][0]), "runs": results[name]} for name in names
        },
    }


def table(result: dict) -> str:
    """A markdown table: one row per variant (mean and [min, max] over its seeds)."""

    def span(xs: list[float], fmt: str) -> str:
        if len(xs) == 1:
            return format(xs[0], fmt)
        return f"{format(sum(xs) / len(xs), fmt)} [{format(min(xs), fmt)}, {format(max(xs), fmt)}]"

    lines = [
        "| variant | overrides | seeds | reward rise | held-out acc. start -> end | finite | "
        "diagnostics (run mean) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, v in result["variants"].items():
        runs = v["runs"]
        diag = ", ".join(
            f"`{k}` {span([r['diagnostics'][k] for r in runs], '.3f')}"
            for k in runs[0]["diagnostics"]
        )
        acc0 = span([r["eval_accuracy_start"] or 0.0 for r in runs], ".2f")
        acc1 = span([r["eval_accuracy_end"] or 0.0 for r in runs], ".2f")
        lines.append(
            f"| {name} | {' '.join(f'`{o}`' for o in v['overrides']) or '(default)'} | "
            f"{len(runs)} | {span([r['reward_rise'] for r in runs], '+.2f')} | {acc0} -> {acc1} | "
            f"{'yes' if all(r['all_finite'] for r in runs) else 'NO'} | {diag} |"
        )
    return "\n".join(lines)


BEGIN, END = "<!-- algo_options:begin -->", "<!-- algo_options:end -->"
#: The page that holds the block.
DOCS_PAGE = ROOT / "docs" / "evidence.md"


def docs_block(result: dict) -> str:
    """The block of docs/evidence.md: the table and where it comes from."""
    m = result["machine"]
    return (
        f"{BEGIN}\n{table(result)}\n\n{result['iterations']} iterations per run (the CI version of "
        "the CPU default), mean [min, max] over the seeds; written by `OMP_NUM_THREADS=1 "
        ".venv/bin/python benchmarks/experiments/algo_options.py --jobs 2 --write-docs` "
        f"(`benchmarks/results/algo_options.json`; torch {m['torch']}, {m['cpu_count']} cores)."
        f"\n{END}"
    )


def write_docs(block: str, page: Path = DOCS_PAGE) -> None:
    """Replace the ``algo_options`` block of ``page`` with ``block``."""
    replace_marked_block(page, BEGIN, END, block)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = measure(args)
    write_json(result, args.out)
    print(table(result))
    if args.write_docs:
        write_docs(docs_block(result))
    print(f"\nwrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
