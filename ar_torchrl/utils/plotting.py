"""The end-of-run PNG: reward, response length, value loss and KL against the iteration."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["DEFAULT_PANELS", "plot_training_curves"]

#: (metric key, panel title) of the four default panels.
DEFAULT_PANELS: tuple[tuple[str, str], ...] = (
    ("rollout/reward_mean", "mean reward"),
    ("rollout/response_length", "response length (tokens)"),
    ("train/loss_critic", "value loss"),
    ("train/kl_ref", "KL to reference"),
)


def plot_training_curves(
    history: Sequence[dict],
    path: str | os.PathLike,
    *,
    panels: Sequence[tuple[str, str]] = DEFAULT_PANELS,
    step_key: str = "step",
) -> Path:
    """Write a 2x2 (or ``len(panels)``-long) PNG of the given metrics; missing keys leave a blank panel.

    Args:
        history: one dict per iteration (``None`` values, e.g. a skipped NaN step, are left out).
        path: output ``.png`` path.
        panels: ``(key, title)`` per panel.
        step_key: the x axis key.

    Example:
        >>> import tempfile
        >>> hist = [{"step": i, "rollout/reward_mean": i / 10} for i in range(5)]
        >>> plot_training_curves(hist, Path(tempfile.mkdtemp()) / "curves.png").stat().st_size > 1000
        True
    """
    if importlib.util.find_spec("matplotlib") is None:
        raise ModuleNotFoundError("plotting needs matplotlib: `pip install 'ar_torchrl[plot]'`")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 2
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows), squeeze=False)
    for ax, (key, title) in zip(axes.flat, panels):
        points = [(h[step_key], h[key]) for h in history if h.get(key) is not None]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, lw=1.2)
        else:
            ax.text(0.5, 0.5, f"no '{key}'", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(title)
        ax.set_xlabel(step_key)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
