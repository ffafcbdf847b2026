"""Run plumbing: stage timer, logger factory (CSV default, clear errors for missing extras), plot."""

from __future__ import annotations

import importlib.util
import time

import pytest

from ar_torchrl.utils import (
    StageTimer,
    append_jsonl,
    log_metrics,
    make_logger,
    plot_training_curves,
    read_jsonl,
)


def test_stage_timer_accumulates_per_stage_and_resets():
    timer = StageTimer()
    for _ in range(2):
        with timer("generate"):
            time.sleep(0.01)
    with pytest.raises(RuntimeError), timer("update"):
        raise RuntimeError("a failing stage is still timed")
    out = timer.pop()
    assert set(out) == {"time/generate", "time/update"}
    assert out["time/generate"] >= 0.02
    assert timer.pop() == {}


def test_csv_logger_writes_torchrl_scalars(tmp_path):
    logger = make_logger("csv", log_dir=tmp_path, exp_name="run")
    log_metrics(logger, {"rollout/reward_mean": 0.25, "time/update": 1.5}, step=3)
    log_metrics(logger, {"rollout/reward_mean": 0.5}, step=4)
    lines = (tmp_path / "run" / "scalars" / "rollout" / "reward_mean.csv").read_text().splitlines()
    assert lines == ["3,0.25", "4,0.5"]
    assert make_logger("none", log_dir=tmp_path, exp_name="x") is None
    log_metrics(None, {"a": 1.0}, step=0)  # no-op


@pytest.mark.parametrize("kind", ["tensorboard", "wandb"])
def test_optional_loggers_need_their_extra(tmp_path, kind):
    if importlib.util.find_spec(kind) is not None:
        logger = make_logger(kind, log_dir=tmp_path, exp_name="x")
        assert type(logger).__name__.lower().startswith(kind[:5])
    else:
        with pytest.raises(ModuleNotFoundError, match=rf"logger.kind='{kind}' needs the `{kind}`"):
            make_logger(kind, log_dir=tmp_path, exp_name="x")


def test_jsonl_round_trip_and_plot(tmp_path):
    path = tmp_path / "metrics.jsonl"
    for step in range(1, 6):
        append_jsonl(path, {"step": step, "rollout/reward_mean": step / 5,
                            "train/loss_critic": float("nan") if step == 3 else 0.1})  # fmt: skip
    history = read_jsonl(path)
    assert [h["step"] for h in history] == [1, 2, 3, 4, 5] and history[2][
        "train/loss_critic"
    ] is None
    png = plot_training_curves(history, tmp_path / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
