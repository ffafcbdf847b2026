"""The end-of-run PNG: reward, accuracy (sampled and held-out), response length, value loss, KL and
the critic's explained variance against the iteration."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DEFAULT_PANELS", "Panel", "plot_training_curves"]


@dataclass(frozen=True)
class Panel:
    """One panel: a title, the y-axis label, and the ``(metric key, legend label)`` curves."""

    title: str
    ylabel: str
    curves: tuple[tuple[str, str], ...]


#: The recipe's six panels.
DEFAULT_PANELS: tuple[Panel, ...] = (
    Panel("mean reward (sampled)", "reward", (("rollout/reward_mean", "sampled"),)),
    Panel(
        "accuracy",
        "fraction correct",
        (("rollout/accuracy", "sampled"), ("eval/accuracy", "held-out, greedy")),
    ),
    Panel("response length", "tokens", (("rollout/response_length", "mean"),)),
    Panel("value loss", "loss", (("train/loss_critic", "value loss"),)),
    Panel("KL to the reference policy", "KL (k3)", (("train/kl_ref", "KL"),)),
    Panel("critic fit", "explained variance", (("train/explained_variance_finite", "critic"),)),
)


def _draw(ax, history: Sequence[dict], panel: Panel, step_key: str) -> bool:
    drawn = False
    for key, label in panel.curves:
        points = [(h[step_key], h[key]) for h in history if h.get(key) is not None]
        if not points:
            continue
        xs, ys = zip(*points)
        sparse = len(points) <= 20  # e.g. evaluations every N iterations: show each point
        ax.plot(xs, ys, lw=1.2, marker="o" if sparse else None, ms=3, label=label)
        drawn = True
    if drawn and len(panel.curves) > 1:
        ax.legend(fontsize=8)
    return drawn


def plot_training_curves(
    history: Sequence[dict],
    path: str | os.PathLike,
    *,
    panels: Sequence[Panel] = DEFAULT_PANELS,
    step_key: str = "step",
) -> Path:
    """Write a PNG of the given panels, two per row; a panel whose metrics the run did not log says
    so (e.g. the value loss of a run without a critic).

    Args:
        history: one dict per iteration (``None`` values, e.g. a skipped NaN step, are left out).
        path: output ``.png`` path.
        panels: the :class:`Panel` s to draw.
        step_key: the x axis key (integer iterations: the ticks are integers).

    Example:
        >>> import tempfile
        >>> hist = [{"step": i, "rollout/reward_mean": i / 10} for i in range(5)]
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     plot_training_curves(hist, Path(tmp) / "curves.png").stat().st_size > 1000
        True
    """
    if importlib.util.find_spec("matplotlib") is None:
        raise ModuleNotFoundError("plotting needs matplotlib: `pip install 'ar_torchrl[plot]'`")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    cols = 2
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        if not _draw(ax, history, panel, step_key):
            ax.text(
                0.5,
                0.5,
                "not logged in this run",
                ha="center",
                va="center",
                color="gray",
                transform=ax.transAxes,
            )
            ax.set_xticks([])
            ax.set_yticks([])
        ax.set_title(panel.title)
        ax.set_xlabel("iteration")
        ax.set_ylabel(panel.ylabel)
        if ax.get_xticks().size:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
