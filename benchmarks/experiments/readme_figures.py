"""Regenerate the CPU default's learning figures (docs/evidence.md; the README's results table
quotes them) from fresh runs of examples/dapo_ppo.py.

What it runs, one after the other (never in parallel: wall times are part of the figures), each with
``OMP_NUM_THREADS=1`` and a fresh cache directory:

- the warm start alone, twice (a 1-iteration run in the empty cache, then the same run cached): the
  difference is the warm start's cost, paid once per machine;
- the main job, the CPU default (300 iterations), for seeds 0-4: reward rise (mean reward of
  the last 20 % of iterations minus the first 20 %), sampled accuracy over the same windows,
  held-out greedy accuracy at step 0 and at the end, wall time and seconds per iteration;
- ``algo=grpo`` (300 iterations, seed 0): the same figures;
- ``algo=rloo`` (300 iterations) for seeds 0-4: the same figures;
- the CI version (``train.iterations=100``, tests/recipes/test_recipe.py) for seeds 0-4: reward rise (the
  test's threshold is half the smallest of them).

Every run records the 1/5/15-minute load averages (``os.getloadavg``) before and after it, with the
thread count, the CPU count and the Python/torch versions. Output: a table on stdout, JSON in
``benchmarks/results/readme_figures.json`` and the docs block (between the ``readme_figures``
markers), written into docs/evidence.md with ``--write-docs``.

Full run (about 40-60 minutes on 2 quiet cores; run it when the machine is otherwise idle)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/experiments/readme_figures.py --write-docs

Quick check that it works (a few minutes; 6 iterations, seeds 0-1; ``readme_figures_quick.json``)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/experiments/readme_figures.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # benchmarks/_common.py
from _common import read_history

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
SCRIPT = ROOT / "examples" / "dapo_ppo.py"
BEGIN, END = "<!-- readme_figures:begin -->", "<!-- readme_figures:end -->"
#: The page that holds the block.
DOCS_PAGE = ROOT / "docs" / "evidence.md"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="6 iterations, seeds 0-1 (a smoke test)")
    p.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (default 5; quick: 2)")
    p.add_argument("--iterations", type=int, default=None, help="default 300 (quick: 6)")
    p.add_argument("--ci-iterations", type=int, default=None, help="default 100 (quick: 4)")
    p.add_argument(
        "--write-docs",
        "--write-readme",  # its name before the figures moved to docs/
        action="store_true",
        help="replace the block in docs/evidence.md",
    )
    p.add_argument(
        "--out", type=Path, default=None, help="default results/readme_figures[_quick].json"
    )
    args = p.parse_args(argv)
    args.seeds = args.seeds or (2 if args.quick else 5)
    args.iterations = args.iterations or (6 if args.quick else 300)
    args.ci_iterations = args.ci_iterations or (4 if args.quick else 100)
    name = "readme_figures_quick.json" if args.quick else "readme_figures.json"
    args.out = args.out or RESULTS / name
    return args


def recipe_command(run_dir: Path, *overrides: str) -> list[str]:
    """The recipe's command line for ``overrides``; Hydra's flags among them (``--config-name X``,
    ``--config-name=X``) go first, since its argparse refuses a flag after the positionals.

    >>> recipe_command(Path("r"), "seed=1", "--config-name", "smollm2_arithmetic")[2:]
    ['--config-name', 'smollm2_arithmetic', 'hydra.run.dir=r', 'train.plot=false', 'seed=1']
    """
    flags, rest, items = [], [], iter(overrides)
    for item in items:
        if item.startswith("--"):
            flags += [item] if "=" in item else [item, next(items)]
        else:
            rest.append(item)
    return [
        sys.executable,
        str(SCRIPT),
        *flags,
        f"hydra.run.dir={run_dir}",
        "train.plot=false",
        *rest,
    ]


def run_recipe(run_dir: Path, cache: Path, *overrides: str) -> dict:
    """One recipe run through a subprocess; its history, wall time and the load around it."""
    env = {
        **os.environ,
        "AR_TORCHRL_CACHE": str(cache),
        "OMP_NUM_THREADS": "1",
        "TQDM_DISABLE": "1",
    }
    cmd = recipe_command(run_dir, *overrides)
    load_before, start = os.getloadavg(), time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    history = read_history(run_dir)
    return {
        "overrides": list(overrides),
        "wall_s": wall,
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
        **figures(history),
    }


def figures(history: list[dict]) -> dict:
    """Reward rise and accuracies (first vs last 20 % of iterations), held-out accuracy, timing.

    Example:
        >>> h = [{"step": 0, "eval/accuracy": 0.5}] + [
        ...     {"step": i, "rollout/reward_mean": i / 10, "rollout/accuracy": i / 20,
        ...      "time/update": 0.1} for i in range(1, 11)]
        >>> h[-1]["eval/accuracy"] = 0.75
        >>> f = figures(h)
        >>> round(f["reward_rise"], 3), f["eval_accuracy_start"], f["eval_accuracy_end"]
        (0.8, 0.5, 0.75)
    """
    steps = [h for h in history if "rollout/reward_mean" in h]
    k = max(1, len(steps) // 5)

    def mean(key: str, part: list[dict]) -> float:
        return sum(h[key] for h in part) / len(part)

    evals = [h for h in history if h.get("eval/accuracy") is not None]
    first, last = mean("rollout/reward_mean", steps[:k]), mean("rollout/reward_mean", steps[-k:])
    return {
        "iterations": len(steps),
        "reward_first": first,
        "reward_last": last,
        "reward_rise": last - first,
        "accuracy_first": mean("rollout/accuracy", steps[:k]),
        "accuracy_last": mean("rollout/accuracy", steps[-k:]),
        "eval_accuracy_start": evals[0]["eval/accuracy"] if evals else None,
        "eval_accuracy_end": evals[-1]["eval/accuracy"] if evals else None,
        "stage_s_per_iteration": sum(
            v for h in steps for key, v in h.items() if key.startswith("time/")
        )
        / len(steps),
    }


def measure(args: argparse.Namespace) -> dict:
    """Every run of the module docstring, in order."""
    seeds = range(args.seeds)
    with tempfile.TemporaryDirectory(prefix="readme_figures_") as tmp:
        tmp, cache = Path(tmp), Path(tmp) / "cache"
        one = ("train.iterations=1", "train.eval_every=0")
        cold = run_recipe(tmp / "warm_cold", cache, *one)
        warm = run_recipe(tmp / "warm_cached", cache, *one)
        its = f"train.iterations={args.iterations}"
        default = [run_recipe(tmp / f"default_{s}", cache, its, f"seed={s}") for s in seeds]
        grpo = run_recipe(tmp / "grpo", cache, its, "algo=grpo")
        rloo = [run_recipe(tmp / f"rloo_{s}", cache, its, "algo=rloo", f"seed={s}") for s in seeds]
        ci_its = f"train.iterations={args.ci_iterations}"
        ci = [
            run_recipe(
                tmp / f"ci_{s}",
                cache,
                ci_its,
                f"train.eval_every={args.ci_iterations}",
                "train.checkpoint_every=0",
                f"seed={s}",
            )
            for s in seeds
        ]
    return {
        "machine": machine(),
        "warm_start_s": cold["wall_s"] - warm["wall_s"],
        "startup_s": warm["wall_s"],
        "default": default,
        "grpo": grpo,
        "rloo": rloo,
        "ci": ci,
    }


def machine() -> dict:
    import torch

    return {
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "threads": 1,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def docs_block(result: dict) -> str:
    """The figures of docs/evidence.md's block, as markdown."""
    d, ci, g, m = result["default"], result["ci"], result["grpo"], result["machine"]
    seeds = " | ".join(str(i) for i in range(len(d)))
    rows = [
        f"| seed | {seeds} |",
        "|---" * (len(d) + 1) + "|",
        "| reward rise | " + " | ".join(f"{r['reward_rise']:+.2f}" for r in d) + " |",
        "| sampled accuracy, first -> last 20 % | "
        + " | ".join(f"{r['accuracy_first']:.0%} -> {r['accuracy_last']:.0%}" for r in d)
        + " |",
        "| held-out greedy accuracy, step 0 -> end | "
        + " | ".join(f"{r['eval_accuracy_start']:.1%} -> {r['eval_accuracy_end']:.1%}" for r in d)
        + " |",
        "| wall time (min) | " + " | ".join(f"{r['wall_s'] / 60:.1f}" for r in d) + " |",
    ]
    per_it = sum(r["stage_s_per_iteration"] for r in d) / len(d)
    rloo = result.get("rloo", [])
    loads = [r["load_avg_before"][0] for r in (*d, g, *rloo, *ci)] + [d[-1]["load_avg_after"][0]]
    ci_rises = ", ".join(f"{r['reward_rise']:+.2f}" for r in ci)
    rloo_rises = ", ".join(f"{r['reward_rise']:+.2f}" for r in rloo)
    rloo_text = (
        f" `algo=rloo` ({rloo[0]['iterations']} iterations, leave-one-out baselines, no critic) "
        f"rose by {rloo_rises} over seeds 0-{len(rloo) - 1}."
        if rloo
        else ""
    )
    return "\n".join(
        [
            *rows,
            "",
            f"One run of the main job takes {d[0]['wall_s'] / 60:.1f} minutes with the warm start "
            f"cached ({per_it:.2f} s per iteration; the first run on a machine adds the warm start, "
            f"{result['warm_start_s']:.0f} s). `algo=grpo` ({g['iterations']} iterations) rose by "
            f"{g['reward_rise']:+.2f}.{rloo_text} The CI version ({ci[0]['iterations']} iterations, "
            f"`tests/recipes/test_recipe.py`) rose by {ci_rises} over seeds 0-{len(ci) - 1}.",
            "",
            f"Measured by `benchmarks/experiments/readme_figures.py`: {m['threads']} thread, {m['cpu_count']} "
            f"cores, 1-minute load average {min(loads):.1f}-{max(loads):.1f} during the runs, "
            f"torch {m['torch']}.",
        ]
    )


def write_docs(block: str, page: Path = DOCS_PAGE) -> None:
    """Replace the text between the ``readme_figures`` markers of ``page``."""
    text = page.read_text()
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), flags=re.S)
    if not pattern.search(text):
        raise ValueError(f"{page} has no {BEGIN} ... {END} block")
    page.write_text(pattern.sub(lambda _: f"{BEGIN}\n{block}\n{END}", text))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = {"args": {k: str(v) for k, v in vars(args).items()}, **measure(args)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    block = docs_block(result)
    print(block)
    print(f"\nwrote {args.out}")
    if args.write_docs:
        write_docs(block)
        print(f"updated {DOCS_PAGE.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
