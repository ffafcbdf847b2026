"""Supervised warm start: targets, batch layout, learning, caching by settings, clear errors."""

from __future__ import annotations

import json
import random

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
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left
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
