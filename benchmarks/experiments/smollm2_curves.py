"""Learning curves of SmolLM2-135M-Instruct runs of the recipe: PPO and GRPO over seeds, one figure.

Reads the ``metrics.jsonl`` of finished runs of ``ar_torchrl/configs/smollm2_arithmetic.yaml`` (one run
directory per seed and algorithm), plots the sampled training reward (mean over the 32 samples of
each iteration) and the greedy held-out accuracy, per seed and averaged over seeds, and writes a
JSON summary: per run, its curves (reward per iteration, held-out accuracy per evaluation), the mean
reward of the first and last 20 % of iterations and seconds per iteration by stage.

Run (after the runs listed in docs/evidence.md, "SmolLM2 learning curves"):
    .venv/bin/python benchmarks/experiments/smollm2_curves.py --run ppo:outputs/ev/ppo_s0 \
        --run ppo:outputs/ev/ppo_s1 --run grpo:outputs/ev/grpo_s0 \
        --run grpo:outputs/ev/grpo_s1 --png benchmarks/results/smollm2_curves.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # benchmarks/_common.py
from _common import read_history

RESULTS = Path(__file__).resolve().parent / "results" / "smollm2_curves.json"
STAGES = ("time/generate", "time/old_log_probs", "time/update", "time/sync")
COLORS = {"ppo": "tab:blue", "grpo": "tab:orange"}


def load_run(path: Path) -> list[dict]:
    return read_history(path)


def summarize(history: list[dict]) -> dict:
    """Per run: the curves (sampled reward and accuracy per iteration, greedy held-out accuracy per
    evaluation), mean reward of the first / last 20 % of iterations, seconds per iteration by stage."""
    train = [h for h in history if "rollout/reward_mean" in h]
    evals = [(h["step"], h["eval/accuracy"]) for h in history if "eval/accuracy" in h]
    k = max(1, len(train) // 5)
    rewards = [h["rollout/reward_mean"] for h in train]
    return {
        "iterations": len(train),
        "reward_first20": float(np.mean(rewards[:k])),
        "reward_last20": float(np.mean(rewards[-k:])),
        "reward_rise": float(np.mean(rewards[-k:]) - np.mean(rewards[:k])),
        "sampled_accuracy_first20": float(np.mean([h["rollout/accuracy"] for h in train[:k]])),
        "sampled_accuracy_last20": float(np.mean([h["rollout/accuracy"] for h in train[-k:]])),
        "eval_accuracy": evals,
        "reward_curve": [(h["step"], h["rollout/reward_mean"]) for h in train],
        "seconds_per_iteration": {
            s: float(np.mean([h[s] for h in train if s in h])) for s in STAGES
        },
    }


def seed_mean(curves: list[list[tuple[int, float]]]) -> tuple[list[int], list[float]]:
    """Mean over runs at the steps every run reached (a stopped run shortens the mean).

    Example:
        >>> seed_mean([[(0, 0.5), (5, 1.0)], [(0, 0.0)]])
        ([0], [0.25])
    """
    common = sorted(set.intersection(*(set(dict(c)) for c in curves)))
    return common, [float(np.mean([dict(c)[step] for c in curves])) for step in common]


def plot(runs: list[tuple[str, str, list[dict]]], png: Path) -> None:
    """Left: sampled reward per iteration; right: greedy held-out accuracy. Thin lines: one per
    seed; thick: the mean over the seeds of each algorithm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    groups: dict[str, dict[str, list]] = {}
    for algo, _name, history in runs:
        s = summarize(history)
        color = COLORS.get(algo)
        left.plot(*zip(*s["reward_curve"]), color=color, alpha=0.35, lw=0.8)
        right.plot(*zip(*s["eval_accuracy"]), color=color, alpha=0.35, lw=0.8, marker="o", ms=2)
        group = groups.setdefault(algo, {"reward": [], "eval": []})
        group["reward"].append(s["reward_curve"])
        group["eval"].append(s["eval_accuracy"])
    for algo, group in groups.items():
        label = f"{algo} (mean of {len(group['reward'])} seeds)"
        left.plot(*seed_mean(group["reward"]), color=COLORS.get(algo), lw=2, label=label)
        right.plot(
            *seed_mean(group["eval"]), color=COLORS.get(algo), lw=2, marker="o", ms=4, label=label
        )
    left.set(
        title="sampled reward (T=1, 8 prompts x 4)",
        xlabel="iteration",
        ylabel="DAPO reward (+1/-1)",
        ylim=(-1.05, 1.05),
    )
    right.set(title="greedy accuracy, 64 held-out problems", xlabel="iteration", ylim=(0, 1.02))
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=80)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--run",
        action="append",
        required=True,
        help="ALGO:RUN_DIR (ALGO is the legend group, e.g. ppo or grpo)",
    )
    parser.add_argument("--png", type=Path, default=RESULTS.with_suffix(".png"))
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes")
    args = parser.parse_args()
    runs, summary = [], {}
    for spec in args.run:
        algo, _, path = spec.partition(":")
        name = f"{algo} {Path(path).name}"
        history = load_run(Path(path))
        runs.append((algo, name, history))
        summary[name] = summarize(history)
    plot(runs, args.png)
    print("| run | iterations | reward first 20 % | last 20 % | rise | held-out greedy accuracy |")
    print("|---|---|---|---|---|---|")
    for name, s in summary.items():
        acc = " -> ".join(f"{a:.0%} ({step})" for step, a in s["eval_accuracy"])
        print(
            f"| {name} | {s['iterations']} | {s['reward_first20']:+.3f} | "
            f"{s['reward_last20']:+.3f} | {s['reward_rise']:+.3f} | {acc} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2))
    print(f"wrote {args.png} and {args.out}")


if __name__ == "__main__":
    main()
