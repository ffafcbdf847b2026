"""Run plumbing: stage timer, logger factory (CSV default, clear errors for missing extras), plot,
metric history that survives a crash mid-write, trimming of the history and CSV logs on resume."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time

import pytest

from ar_torchrl.utils import (
    StageTimer,
    append_jsonl,
    log_metrics,
    make_logger,
    plot_training_curves,
    read_jsonl,
    truncate_csv_logs,
    truncate_jsonl,
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
        append_jsonl(
            path,
            {
                "step": step,
                "rollout/reward_mean": step / 5,
                "train/loss_critic": float("nan") if step == 3 else 0.1,
            },
        )
    history = read_jsonl(path)
    assert [h["step"] for h in history] == [1, 2, 3, 4, 5] and history[2][
        "train/loss_critic"
    ] is None
    png = plot_training_curves(history, tmp_path / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_torn_last_line_is_dropped_with_a_warning_naming_the_file(tmp_path, caplog):
    """A process killed while appending left half a record: main raised a JSONDecodeError naming no file."""
    path = tmp_path / "metrics.jsonl"
    append_jsonl(path, {"step": 1, "x": 0.5})
    with open(path, "a") as f:
        f.write('{"step": 2, "x": 0.2')  # no closing brace, no newline
    assert read_jsonl(path) == [{"step": 1, "x": 0.5}]
    assert str(path) in caplog.text and "torn last line" in caplog.text
    path.write_text('{"step": 1}\n{"step": 2\n{"step": 3}\n')  # corrupt *inside* the file: an error
    with pytest.raises(ValueError, match=rf"{path}: line 2 is not JSON"):
        read_jsonl(path)


def test_truncate_jsonl_keeps_steps_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    for step in range(5):
        append_jsonl(path, {"step": step})
    with open(path, "a") as f:
        f.write('{"step": 5, "x"')
    assert truncate_jsonl(path, 2) == 2  # steps 3 and 4 (the torn line is not a record)
    assert path.read_text() == '{"step": 0}\n{"step": 1}\n{"step": 2}\n'
    assert truncate_jsonl(path, -1) == 3 and path.read_text() == ""  # a fresh start: no history
    assert truncate_jsonl(tmp_path / "missing.jsonl", 3) == 0


def test_truncate_csv_logs_drops_rows_after_the_step(tmp_path):
    """TorchRL's CSVLogger appends: a resumed run would otherwise log steps 3, 4 twice."""
    logger = make_logger("csv", log_dir=tmp_path, exp_name="run")
    for step in (1, 2, 3, 4):
        log_metrics(logger, {"rollout/reward_mean": step / 4, "time/update": 0.5}, step=step)
    reward = tmp_path / "run" / "scalars" / "rollout" / "reward_mean.csv"
    with open(reward, "a") as f:
        f.write("5,0.")  # torn row
    assert truncate_csv_logs(tmp_path, 2) == 5  # 2 + 2 rows after step 2, and the torn one
    assert reward.read_text().splitlines() == ["1,0.25", "2,0.5"]
    assert (tmp_path / "run" / "scalars" / "time" / "update.csv").read_text() == "1,0.5\n2,0.5\n"
    assert truncate_csv_logs(tmp_path / "missing", 2) == 0


def test_utils_import_no_torch():
    code = "import sys, ar_torchrl.utils; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_curves_have_an_accuracy_panel_labels_and_say_what_was_not_logged(tmp_path):
    from ar_torchrl.utils.plotting import DEFAULT_PANELS

    keys = [key for panel in DEFAULT_PANELS for key, _ in panel.curves]
    assert {"rollout/accuracy", "eval/accuracy", "train/explained_variance_finite"} <= set(keys)
    assert all(panel.ylabel for panel in DEFAULT_PANELS)
    grpo = [{"step": 0, "eval/accuracy": 0.5}] + [
        {"step": i, "rollout/reward_mean": -0.5, "rollout/accuracy": 0.2} for i in (1, 2)
    ]  # no critic: the value-loss panel says it was not logged
    assert plot_training_curves(grpo, tmp_path / "grpo.png").stat().st_size > 10_000
