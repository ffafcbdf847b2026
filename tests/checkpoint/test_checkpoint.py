"""Checkpoints: exact round trip (model, value head, optimizer, RNG), atomic writes, clear errors,
loading that never runs code from the file."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ar_torchrl.checkpoint import checkpoint_step, local, remove_partial_checkpoints
from ar_torchrl.models.tiny import build_tiny_qwen3
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
    path = local.save(
        tmp_path, step=7, model=model, optimizer=opt, extra={"collector": {"cursor": 48}}
    )
    expected = draws()
    fresh, fresh_opt = trained_model_and_optimizer(seed=5)
    state = local.load(path, model=fresh, optimizer=fresh_opt)
    assert state == {"step": 7, "extra": {"collector": {"cursor": 48}}}
    assert draws() == expected
    torch.testing.assert_close(fresh.state_dict(), model.state_dict(), rtol=0, atol=0)
    assert fresh.value_head.weight.abs().sum() > 0  # the value head is in the checkpoint
    for a, b in zip(fresh_opt.state_dict()["state"].values(), opt.state_dict()["state"].values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_write_is_atomic_and_old_checkpoint_survives_a_crash(tmp_path, monkeypatch):
    model, opt = trained_model_and_optimizer()
    good = local.save(tmp_path, step=1, model=model, optimizer=opt)

    def crash(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        local.save(tmp_path, step=2, model=model, optimizer=opt)
    # no partial file, no temporary file, no manifest of the failed save
    assert sorted(p.name for p in tmp_path.iterdir()) == [".step_1.pt.manifest.json", "step_1.pt"]
    assert local.latest(tmp_path) == good


def test_keep_last_and_latest(tmp_path):
    model = torch.nn.Linear(2, 1)
    for step in (1, 2, 10, 11):
        local.save(tmp_path, step=step, model=model, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".step_10.pt.manifest.json",
        ".step_11.pt.manifest.json",
        "step_10.pt",
        "step_11.pt",
    ]  # the manifests of the deleted ones are deleted too
    assert local.latest(tmp_path).name == "step_11.pt"
    assert local.latest(tmp_path / "missing") is None


def test_errors_name_the_problem(tmp_path):
    model = torch.nn.Linear(2, 1)
    path = local.save(tmp_path, step=1, model=model)
    with pytest.raises(ValueError, match="does not match the model"):
        local.load(path, model=torch.nn.Linear(3, 1))
    with pytest.raises(ValueError, match="has no optimizer state"):
        local.load(path, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1))
    with pytest.raises(FileNotFoundError, match="no checkpoint file at"):
        local.load(tmp_path / "step_9.pt", model=model)


class _RunsCode:
    """Unpickling this calls ``Path.touch`` on a marker file: what a malicious checkpoint could do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_loading_never_runs_code_from_the_file(tmp_path):
    marker = tmp_path / "code_ran"
    path = tmp_path / "step_1.pt"
    torch.save({"step": 1, "model": {}, "extra": _RunsCode(marker)}, path)
    with pytest.raises(ValueError, match=r"holds objects other than tensors .* not loaded"):
        local.load(path, model=torch.nn.Linear(2, 1))
    assert not marker.exists()


def test_checkpoint_is_plain_data(tmp_path):
    """What save_checkpoint writes loads with weights_only=True (numpy RNG state included)."""
    model, opt = trained_model_and_optimizer()
    path = local.save(
        tmp_path,
        step=3,
        model=model,
        optimizer=opt,
        extra={"shuffle": torch.Generator().get_state(), "cursor": [1, 2]},
    )
    payload = torch.load(path, weights_only=True)
    assert set(payload) == {"step", "model", "optimizer", "rng", "extra"}
    assert payload["rng"]["numpy"]["keys"].dtype == torch.int64


def test_unfinished_saves_are_removed(tmp_path, caplog):
    model = torch.nn.Linear(2, 1)
    local.save(tmp_path, step=1, model=model)
    left = tmp_path / ".step_2.pt-k3j2x.tmp"  # a save killed mid-write (SIGKILL, power loss)
    left.write_bytes(b"half a checkpoint")
    assert local.latest(tmp_path).name == "step_1.pt"  # never mistaken for a checkpoint
    local.save(tmp_path, step=2, model=model)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == [
        "step_1.pt",
        "step_2.pt",
    ]
    assert ".step_2.pt-k3j2x.tmp" in caplog.text and "did not finish" in caplog.text
    left.write_bytes(b"again")
    manifest_left = tmp_path / ".step_2.pt.manifest.json-p9q8.tmp"  # killed writing the manifest
    manifest_left.write_bytes(b"{")
    assert remove_partial_checkpoints(tmp_path) == [left, manifest_left] and not left.exists()
    assert remove_partial_checkpoints(tmp_path / "missing") == []
    # distributed checkpoints: a save killed before its rename, a replaced one not yet deleted
    dcp = [tmp_path / ".step_3.tmp", tmp_path / ".step_2.old"]
    for d in dcp:
        (d / "rng").mkdir(parents=True)
        (d / "__0_0.distcp").write_bytes(b"shard")
    (tmp_path / "step_2").mkdir()  # a complete one is kept
    assert remove_partial_checkpoints(tmp_path) == sorted(dcp)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".step_1.pt.manifest.json",
        ".step_2.pt.manifest.json",
        "step_1.pt",
        "step_2",
        "step_2.pt",
    ]


def test_checkpoint_step_names():
    assert checkpoint_step("a/step_40.pt") == 40 and checkpoint_step("a/step_8") == 8
    with pytest.raises(ValueError, match=r"'a/step_x' is not a checkpoint name \(step_<N>.pt"):
        checkpoint_step("a/step_x")


def test_keep_last_must_keep_one(tmp_path):
    """keep_last=-1 used to delete each checkpoint right after writing it."""
    for bad in (-1, 0):
        with pytest.raises(ValueError, match=f"save_checkpoint: keep_last must be >= 1, got {bad}"):
            local.save(tmp_path, step=1, model=torch.nn.Linear(2, 1), keep_last=bad)
    assert not list(tmp_path.glob("step_*.pt"))
    assert checkpoint_step(tmp_path / "step_12.pt") == 12
    with pytest.raises(ValueError, match="is not a checkpoint name"):
        checkpoint_step("model.safetensors")


def test_module_imports_no_torch():
    code = "import sys, ar_torchrl.checkpoint.local; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_torch_save_of_something_else_is_named_not_an_attribute_error(tmp_path):
    """critic.init_from (or train.resume_from) at a valid torch.save of a non-checkpoint (N7)."""
    model = attach_value_head(build_tiny_qwen3(99, hidden_size=32, num_heads=2))
    found = {
        "a list": [1, 2, 3],
        "a dict without \\['model'\\] \\(its keys: \\['lm_head.weight', 'model.embed_tokens": (
            model.state_dict()
        ),  # a bare state_dict
        "a str under 'model', not a state dict": {"model": "weights.bin"},
    }
    for i, (what, payload) in enumerate(found.items()):
        path = tmp_path / f"thing_{i}.pt"
        torch.save(payload, path)
        with pytest.raises(
            ValueError,
            match=rf"critic.init_from: {path} holds {what}.*: expected a dict with \['model'\]",
        ):
            local.load_critic(path, critic=None, model=model)
    path = tmp_path / "step_2.pt"
    torch.save([1, 2, 3], path)
    resume_keys = r"\['step', 'model', 'optimizer', 'rng', 'extra'\]"
    with pytest.raises(
        ValueError,
        match=rf"load_checkpoint: {path} holds a list, not a checkpoint: .*{resume_keys}",
    ):
        local.load(path, model=model)
