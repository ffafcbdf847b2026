"""The tool task's runs (``--config-name tool_arithmetic``): PPO with the critic vs GRPO, one figure.

Reads the ``metrics.jsonl`` of finished runs (one run directory per seed and algorithm, the same
prompts, samples, iterations and seeds for both), and writes a JSON summary, a Markdown table and a
PNG: per run, the sampled reward, accuracy and tool-call rate of iteration 1 (the warm-started
policy's samples) and of the last 20 % of the iterations, the greedy held-out accuracy and tool-call rate at the first and last evaluation, and
seconds per iteration; per algorithm, the mean and range over the seeds.

Run (the runs of docs/evidence.md, "The tool task"; 5 seeds each, ~2 s per iteration on an idle
2-core CPU):
    for s in 0 1 2 3 4; do
      .venv/bin/python examples/dapo_ppo.py --config-name tool_arithmetic seed=$s \
          hydra.run.dir=outputs/tool/ppo_s$s
      .venv/bin/python examples/dapo_ppo.py --config-name tool_arithmetic seed=$s algo=grpo \
          hydra.run.dir=outputs/tool/grpo_s$s
    done
    .venv/bin/python benchmarks/experiments/tool_arithmetic_curves.py \
        $(for s in 0 1 2 3 4; do echo --run ppo:outputs/tool/ppo_s$s --run grpo:outputs/tool/grpo_s$s; done)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from smollm2_curves import COLORS, load_run, seed_mean

RESULTS = Path(__file__).resolve().parent / "results" / "tool_arithmetic_curves.json"
STAGES = ("time/generate", "time/old_log_probs", "time/advantage", "time/update", "time/sync")
SAMPLED = ("rollout/reward_mean", "rollout/accuracy", "rollout/tool_call_rate", "rollout/turns")


def summarize(history: list[dict]) -> dict:
    """One run: iteration 1 (sampled by the warm-started policy, before any update) and the first /
    last 20 % of the iterations of each sampled metric, the first and last
    greedy evaluation, the curves, and seconds per iteration (the stages' sum).

    Example:
        >>> h = [{"step": 0, "eval/accuracy": 0.0, "eval/tool_call_rate": 0.0}]
        >>> h += [{"step": i, "rollout/reward_mean": i / 5, "rollout/accuracy": 0.5,
        ...        "rollout/tool_call_rate": 0.5, "rollout/turns": 1.5, "time/update": 1.0}
        ...       for i in range(1, 6)]
        >>> s = summarize(h)
        >>> s["start"]["rollout/reward_mean"], s["last"]["rollout/reward_mean"], s["seconds_per_iteration"]
        (0.2, 1.0, 1.0)
    """
    train = [h for h in history if "rollout/reward_mean" in h]
    evals = [h for h in history if "eval/accuracy" in h]
    k = max(1, len(train) // 5)
    return {
        "iterations": len(train),
        "window": k,
        "start": {m: float(train[0][m]) for m in SAMPLED},  # iteration 1: the warm start's samples
        "first": {m: float(np.mean([h[m] for h in train[:k]])) for m in SAMPLED},
        "last": {m: float(np.mean([h[m] for h in train[-k:]])) for m in SAMPLED},
        "eval_first": {m: evals[0].get(m) for m in ("eval/accuracy", "eval/tool_call_rate")},
        "eval_last": {m: evals[-1].get(m) for m in ("eval/accuracy", "eval/tool_call_rate")},
        "eval_steps": [evals[0]["step"], evals[-1]["step"]],
        "curves": {m: [(h["step"], h[m]) for h in train] for m in SAMPLED[:3]}
        | {"eval/accuracy": [(h["step"], h["eval/accuracy"]) for h in evals]},
        "seconds_per_iteration": float(
            np.mean([sum(h.get(s, 0.0) for s in STAGES) for h in train])
        ),
    }


def plot(runs: list[tuple[str, dict]], png: Path) -> None:
    """Sampled reward, sampled tool-call rate, greedy held-out accuracy: one thin line per seed,
    a thick one for the mean over the seeds of each algorithm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("rollout/reward_mean", "sampled reward (T=1, 16 prompts x 4)", (-1.05, 1.05)),
        ("rollout/tool_call_rate", "sampled tool-call rate", (0, 1.02)),
        ("eval/accuracy", "greedy accuracy, 64 held-out problems", (0, 1.02)),
    )
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (metric, title, ylim) in zip(axes, panels):
        groups: dict[str, list] = {}
        for algo, s in runs:
            ax.plot(*zip(*s["curves"][metric]), color=COLORS.get(algo), alpha=0.3, lw=0.8)
            groups.setdefault(algo, []).append(s["curves"][metric])
        for algo, curves in groups.items():
            label = f"{algo} (mean of {len(curves)} seeds)"
            marker = "o" if metric.startswith("eval/") else None
            ax.plot(*seed_mean(curves), color=COLORS.get(algo), lw=2, marker=marker, label=label)
        ax.set(title=title, xlabel="iteration", ylim=ylim)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=80)
    plt.close(fig)


def table(runs: list[tuple[str, dict]]) -> str:
    """Per algorithm: mean [min, max] over seeds; sampled metrics from iteration 1 (the warm start's
    samples) to the mean of the last 20 % of the iterations, held-out ones from the first to the last
    evaluation."""

    def cell(values: list[float]) -> str:
        return f"{np.mean(values):.2f} [{min(values):.2f}, {max(values):.2f}]"

    lines = [
        "| algo | seeds | sampled reward (iteration 1 -> last 20 %) | rise | sampled accuracy "
        "| sampled tool-call rate | held-out greedy accuracy (first -> last evaluation) "
        "| held-out tool-call rate | s / iteration |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for algo in dict.fromkeys(a for a, _ in runs):
        ss = [s for a, s in runs if a == algo]

        def span(key: str, ss=ss) -> str:
            return f"{cell([s['start'][key] for s in ss])} -> {cell([s['last'][key] for s in ss])}"

        def ev(key: str, ss=ss) -> str:
            return (
                f"{cell([s['eval_first'][key] for s in ss])} -> "
                f"{cell([s['eval_last'][key] for s in ss])}"
            )

        rise = [s["last"]["rollout/reward_mean"] - s["start"]["rollout/reward_mean"] for s in ss]
        lines.append(
            f"| {algo} | {len(ss)} | {span('rollout/reward_mean')} | {cell(rise)} "
            f"| {span('rollout/accuracy')} | {span('rollout/tool_call_rate')} "
            f"| {ev('eval/accuracy')} | {ev('eval/tool_call_rate')} "
            f"| {np.mean([s['seconds_per_iteration'] for s in ss]):.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="append", required=True, help="ALGO:RUN_DIR")
    parser.add_argument("--png", type=Path, default=RESULTS.with_suffix(".png"))
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes")
    args = parser.parse_args()
    runs, summary = [], {}
    for spec in args.run:
        algo, _, path = spec.partition(":")
        s = summarize(load_run(Path(path)))
        runs.append((algo, s))
        summary[f"{algo} {Path(path).name}"] = s
    plot(runs, args.png)
    print(table(runs))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"runs": summary, "table": table(runs)}, indent=2))
    print(f"wrote {args.png} and {args.out}")


if __name__ == "__main__":
    main()
