"""Checkpoints: exact round trip (model, value head, optimizer, RNG), atomic writes, clear errors."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import ar_torchrl.checkpoint as ck
from ar_torchrl.assets import build_tiny_qwen3
from ar_torchrl.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from ar_torchrl.modules import attach_value_head

torch.set_num_threads(1)


def trained_model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = attach_value_head(build_tiny_qwen3(99, hidden_size=32, num_heads=2, seed=seed))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(3, 99, (2, 6))
    for _ in range(2):
        out = model(input_ids=ids, labels=ids, output_hidden_states=True)
        value = (model.value_head(out.hidden_states[-1]) - 1.0).pow(2).mean()
        (out.loss + value + 1e-3).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def draws():
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_round_trip_restores_everything(tmp_path):
    model, opt = trained_model_and_optimizer()
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    path = save_checkpoint(tmp_path, step=7, model=model, optimizer=opt,
                           extra={"collector": {"cursor": 48}})  # fmt: skip
    expected = draws()
    fresh, fresh_opt = trained_model_and_optimizer(seed=5)
    state = load_checkpoint(path, model=fresh, optimizer=fresh_opt)
    assert state == {"step": 7, "extra": {"collector": {"cursor": 48}}}
    assert draws() == expected
    torch.testing.assert_close(fresh.state_dict(), model.state_dict(), rtol=0, atol=0)
    assert fresh.value_head.weight.abs().sum() > 0  # the value head is in the checkpoint
    for a, b in zip(fresh_opt.state_dict()["state"].values(), opt.state_dict()["state"].values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_write_is_atomic_and_old_checkpoint_survives_a_crash(tmp_path, monkeypatch):
    model, opt = trained_model_and_optimizer()
    good = save_checkpoint(tmp_path, step=1, model=model, optimizer=opt)

    def crash(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(ck.torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, step=2, model=model, optimizer=opt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1.pt"]  # no partial file, no temp
    assert latest_checkpoint(tmp_path) == good


def test_keep_last_and_latest(tmp_path):
    model = torch.nn.Linear(2, 1)
    for step in (1, 2, 10, 11):
        save_checkpoint(tmp_path, step=step, model=model, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_10.pt", "step_11.pt"]
    assert latest_checkpoint(tmp_path).name == "step_11.pt"
    assert latest_checkpoint(tmp_path / "missing") is None


def test_errors_name_the_problem(tmp_path):
    model = torch.nn.Linear(2, 1)
    path = save_checkpoint(tmp_path, step=1, model=model)
    with pytest.raises(ValueError, match="does not match the model"):
        load_checkpoint(path, model=torch.nn.Linear(3, 1))
    with pytest.raises(ValueError, match="has no optimizer state"):
        load_checkpoint(path, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1))
    with pytest.raises(FileNotFoundError, match="no checkpoint file at"):
        load_checkpoint(tmp_path / "step_9.pt", model=model)
