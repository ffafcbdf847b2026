"""Supervised warm start: targets, batch layout, learning, caching by settings, clear errors."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import pytest
import torch

import ar_torchrl.models.warmstart as ws
from ar_torchrl.data.datasets import arithmetic_dataset
from ar_torchrl.models import build_tiny_model
from ar_torchrl.models.warmstart import (
    build_sft_batch,
    cached_warm_start,
    sft_response,
    supervised_warm_start,
)

torch.set_num_threads(1)


def test_sft_response_correct_fraction_and_near_misses():
    rng = random.Random(0)
    wrong = [sft_response("12", False, rng) for _ in range(200)]
    values = {int(w.split(": ")[1]) for w in wrong}
    assert 12 not in values and values <= {9, 10, 11, 13, 14, 15}
    assert sft_response("7", True, rng) == "Answer: 7"


def test_build_sft_batch_trains_only_on_response_and_eos():
    _, tok = build_tiny_model()
    rows = list(arithmetic_dataset(2, seed=0))
    ids, mask, labels = build_sft_batch(tok, rows, ["Answer: 12", "Answer: 3"])
    assert ids.shape == mask.shape == labels.shape
    for b, text in enumerate(["Answer: 12", "Answer: 3"]):
        trained = ids[b][labels[b] != -100]
        assert tok.decode(trained) == text + "<|im_end|>"
        prompt = tok.apply_chat_template(
            rows[b]["prompt"], add_generation_prompt=True, tokenize=False
        )
        assert tok.decode(ids[b][mask[b].bool()]) == prompt + text + "<|im_end|>"
    assert int(mask[1].sum()) == int(mask[0].sum()) - 1  # right padding, one shorter answer


def test_warm_start_learns_the_answer_format():
    model, tok = build_tiny_model(hidden_size=32, num_heads=2)
    rows = list(arithmetic_dataset(50, seed=0))
    losses = supervised_warm_start(
        model, tok, rows, steps=60, batch_size=8, lr=1e-2, correct_fraction=1.0, seed=0
    )
    assert len(losses) == 60
    assert losses[0] > 4.0 and sum(losses[-5:]) / 5 < 1.5
    # greedy continuation of a prompt starts with the format it was taught
    prompt = tok.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
    out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert tok.decode(out[0, ids.shape[1] :]).startswith("Answer: ")


def test_cache_hit_miss_and_atomic_layout(tmp_path, monkeypatch):
    model, tok = build_tiny_model(hidden_size=32, num_heads=2)
    rows = list(arithmetic_dataset(10, seed=0))
    settings = dict(steps=3, batch_size=2, seed=0)
    trained, path = cached_warm_start(model, tok, rows, cache_dir=tmp_path, **settings)
    info = json.loads((path / "warmstart.json").read_text())
    assert info["settings"] == settings and len(info["losses"]) == 3
    assert not [
        p for p in tmp_path.iterdir() if p.is_dir() and p.name.startswith(".")
    ]  # no temp dirs
    # the input model is not modified
    assert not torch.equal(trained.model.embed_tokens.weight, model.model.embed_tokens.weight)

    def boom(*a, **k):
        raise AssertionError("a cache hit must not train")

    monkeypatch.setattr(ws, "supervised_warm_start", boom)
    again, path2 = cached_warm_start(model, tok, rows, cache_dir=tmp_path, **settings)
    assert path2 == path
    torch.testing.assert_close(again.state_dict(), trained.state_dict(), rtol=0, atol=0)
    # any change of settings, rows or initial weights is a different cache entry
    with pytest.raises(AssertionError, match="must not train"):
        cached_warm_start(model, tok, rows, cache_dir=tmp_path, steps=4, batch_size=2, seed=0)
    with pytest.raises(AssertionError, match="must not train"):
        cached_warm_start(model, tok, rows[:5], cache_dir=tmp_path, **settings)
    other, _ = build_tiny_model(hidden_size=32, num_heads=2, seed=1)
    with pytest.raises(AssertionError, match="must not train"):
        cached_warm_start(other, tok, rows, cache_dir=tmp_path, **settings)


#: A process that warm-starts the tiny model on 10 rows into the cache ``sys.argv[1]``, logging at INFO.
WARM_START_CHILD = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from ar_torchrl.data.datasets import arithmetic_dataset
from ar_torchrl.models import build_tiny_model
from ar_torchrl.models.warmstart import cached_warm_start
model, tok = build_tiny_model(hidden_size=32, num_heads=2)
cached_warm_start(model, tok, list(arithmetic_dataset(10, seed=0)), cache_dir=sys.argv[1],
                  steps=3, batch_size=2, seed=0)
"""


def test_processes_sharing_the_cache_train_a_warm_start_once(tmp_path):
    """Two processes ask for one entry while it is locked (as by a third that trains it): both wait,
    then exactly one trains and the other loads its result (parallel runs, pytest workers)."""
    model, tok = build_tiny_model(hidden_size=32, num_heads=2)
    rows = list(arithmetic_dataset(10, seed=0))
    target = (
        tmp_path
        / f"warmstart-{ws._fingerprint(model, tok, rows, dict(steps=3, batch_size=2, seed=0))}"
    )
    with ws.exclusive(ws._lock_path(target)) as waited:
        assert waited == 0.0
        children = [
            subprocess.Popen(
                [sys.executable, "-c", WARM_START_CHILD, str(tmp_path)],
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            for _ in range(2)
        ]
        logs = [child.stderr for child in children]
        for log in logs:  # each child reaches the lock and says it waits
            line = ""
            while "waiting for another process to finish the warm start" not in line:
                line = log.readline()
                assert line, "a child ended before it reached the lock"
        time.sleep(0.2)
        assert not target.exists()
    errs = [log.read() for log in logs]
    assert [child.wait(timeout=300) for child in children] == [0, 0], errs
    assert sorted("supervised training, once" in e for e in errs) == [False, True], errs
    assert sum("loading cached" in e for e in errs) == 1
    assert (target / "warmstart.json").is_file()


def test_errors_are_clear():
    model, tok = build_tiny_model(hidden_size=32, num_heads=2)
    rows = list(arithmetic_dataset(2, seed=0))
    with pytest.raises(ValueError, match="needs integer ground truths, got 'x/2'"):
        sft_response("x/2", True, random.Random(0))
    with pytest.raises(ValueError, match="row 0 is not in the DAPO-Math schema"):
        build_sft_batch(tok, [{"question": "1+1"}], ["Answer: 2"])
    with pytest.raises(ValueError, match="`rows` is empty"):
        supervised_warm_start(model, tok, [], steps=1)
    with pytest.raises(ValueError, match=r"correct_fraction must be >= 0 and <= 1, got 1.5"):
        supervised_warm_start(model, tok, rows, steps=1, correct_fraction=1.5)
    with pytest.raises(ValueError, match=r"supervised_warm_start: lr must be > 0, got -0.001"):
        supervised_warm_start(model, tok, rows, steps=1, lr=-1e-3)  # would train the wrong way
    tok.chat_template = None
    with pytest.raises(ValueError, match="warm start tokenizer has no chat template"):
        supervised_warm_start(model, tok, rows, steps=1)


# --------------------------------------------------------------------------- column traces
def test_column_response_accuracy_depends_on_the_digit_count():
    from ar_torchrl.data.tasks import critic_arithmetic_rows
    from ar_torchrl.models.warmstart import column_response
    from ar_torchrl.rewards.math import dapo_math_reward

    rows = critic_arithmetic_rows([(7, 5), (57, 38), (587, 938)])
    rng = random.Random(0)
    accuracy = [1.0, 0.5, 0.9]
    right = {1: 0, 2: 0, 3: 0}
    for _ in range(1000):
        for row in rows:
            text = column_response(row, accuracy, rng)
            right[row["extra_info"]["digits"]] += (
                dapo_math_reward(text, row["reward_model"]["ground_truth"]) > 0
            )
    # a trace is right when every column is: accuracy ** digits
    assert right[1] == 1000
    assert right[2] / 1000 == pytest.approx(0.5**2, abs=0.04)
    assert right[3] / 1000 == pytest.approx(0.9**3, abs=0.04)
    with pytest.raises(ValueError, match="has 3 digits"):
        column_response(rows[2], [1.0, 1.0], rng)
    with pytest.raises(ValueError, match="column traces need data=critic_arithmetic rows"):
        column_response(list(arithmetic_dataset(1))[0], accuracy, rng)


def test_warm_start_on_column_traces_trains_on_the_trace(monkeypatch):
    import re

    from ar_torchrl.data.tasks import column_problems, critic_arithmetic_rows

    seen = []

    def spy(tokenizer, rows, responses):
        seen.extend(zip(rows, responses))
        return build_sft_batch(tokenizer, rows, responses)

    monkeypatch.setattr(ws, "build_sft_batch", spy)
    model, tok = build_tiny_model(hidden_size=32, num_heads=2)
    rows = list(critic_arithmetic_rows(column_problems(40, seed=0)))
    losses = supervised_warm_start(
        model, tok, rows, steps=30, batch_size=8, lr=1e-2, column_accuracy=[1.0, 1.0, 1.0]
    )
    assert len(seen) == 30 * 8 and losses[0] > 4.0 and sum(losses[-5:]) / 5 < 2.0
    for row, response in seen:  # every target is the row's column trace, right at accuracy 1
        assert re.fullmatch(r"(\d\+\d(\+1)?=\d+\n)+Answer: \d+", response), response
        assert response.endswith(f"Answer: {row['reward_model']['ground_truth']}")


def test_warm_start_config_column_accuracy():
    from ar_torchrl.models.config import WarmStartConfig

    WarmStartConfig(task="critic_arithmetic").check("config: model.warm_start.")
    for bad in ([], [1.0, 1.2]):
        with pytest.raises(ValueError, match="column_accuracy must be a non-empty list of probab"):
            WarmStartConfig(column_accuracy=bad).check("config: model.warm_start.")
    with pytest.raises(ValueError, match="task"):
        WarmStartConfig(task="columns").check("config: model.warm_start.")
