"""The end-of-run PNG: reward, accuracy (sampled and held-out), response length, value loss, KL and
the critic's explained variance against the iteration.

The critic's panel shows ``critic/explained_variance`` (the headline: the critic's values of each
fresh batch before the update against its Monte-Carlo returns; docs/design.md section 9) and, for
comparison, the in-sample ``train/explained_variance_finite``. Explained variance is at most 1 but
unbounded below (an early critic far off the returns gives -50), so that panel's y-axis is clipped
to [-1, 1] and says how many points lie outside."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DEFAULT_PANELS", "Panel", "clipped_limits", "plot_training_curves"]


@dataclass(frozen=True)
class Panel:
    """One panel: a title, the y-axis label, and the ``(metric key, legend label)`` curves."""

    title: str
    ylabel: str
    curves: tuple[tuple[str, str], ...]
    #: ``(low, high)``: the y-axis never extends past these (points outside are counted in a note)
    ylim: tuple[float, float] | None = None


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
    Panel(
        "critic: explained variance",
        "explained variance",
        (
            ("critic/explained_variance", "predicts (old values vs returns)"),
            ("train/explained_variance_finite", "fits (in sample)"),
        ),
        ylim=(-1.0, 1.0),
    ),
)


def _draw(ax, history: Sequence[dict], panel: Panel, step_key: str) -> bool:
    drawn, values = False, []
    for key, label in panel.curves:
        points = [(h[step_key], h[key]) for h in history if h.get(key) is not None]
        if not points:
            continue
        xs, ys = zip(*points)
        values.extend(ys)
        sparse = len(points) <= 20  # e.g. evaluations every N iterations: show each point
        ax.plot(xs, ys, lw=1.2, marker="o" if sparse else None, ms=3, label=label)
        drawn = True
    if drawn and len(panel.curves) > 1:
        ax.legend(fontsize=8)
    if drawn and panel.ylim is not None:
        _clip_y(ax, values, panel.ylim)
    return drawn


def clipped_limits(
    values: Sequence[float], bounds: tuple[float, float], margin: float = 0.05
) -> tuple[tuple[float, float], int]:
    """The y-range of ``values`` kept inside ``bounds`` (with a ``margin`` of the range on each
    side), and how many values lie outside ``bounds``.

    Example:
        >>> (low, high), outside = clipped_limits([-40.0, 0.1, 0.3], (-1.0, 1.0))
        >>> round(low, 3), round(high, 3), outside
        (-1.065, 0.365, 1)
    """
    low, high = bounds
    inside = [v for v in values if low <= v <= high]
    outside = len(values) - len(inside)
    lo = low if outside and min(values) < low else min(inside, default=low)
    hi = high if outside and max(values) > high else max(inside, default=high)
    pad = margin * max(hi - lo, 1e-3)
    return (lo - pad, hi + pad), outside


def _clip_y(ax, values: Sequence[float], bounds: tuple[float, float]) -> None:
    limits, outside = clipped_limits(values, bounds)
    ax.set_ylim(*limits)
    if outside:
        ax.text(
            0.02,
            0.02,
            f"y clipped to [{bounds[0]:g}, {bounds[1]:g}]: {outside} point(s) outside",
            fontsize=7,
            color="gray",
            transform=ax.transAxes,
        )


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
