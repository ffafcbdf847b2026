"""ar_torchrl.checkpoint.sharded in one process: atomicity, damage detection, no code execution.

DCP runs without a process group here; the 2-rank resume is in tests/distributed/test_distributed.py.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import random

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

import ar_torchrl.checkpoint.sharded as ckpt
from ar_torchrl.checkpoint._safe_io import TensorsOnlyPlanner
from ar_torchrl.distributed import DistContext
from ar_torchrl.models.tiny import build_tiny_qwen3
from ar_torchrl.modules import attach_value_head

torch.set_num_threads(1)
CTX = DistContext()


def _model(seed=0):
    model = attach_value_head(build_tiny_qwen3(99, hidden_size=16, num_heads=2, seed=seed))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt


def _step(model, opt):
    model(torch.arange(3, 13).view(2, 5)).logits.square().mean().backward()
    opt.step()
    opt.zero_grad()


def _save(directory, step, model, opt, **kwargs):
    return ckpt.save(directory, step=step, model=model, optimizer=opt, ctx=CTX, **kwargs)


def test_roundtrip_restores_model_optimizer_rng_and_extra(tmp_path):
    model, opt = _model()
    _step(model, opt)
    gen = torch.Generator().manual_seed(5)
    path = _save(tmp_path, 3, model, opt, extra={"gen": gen.get_state(), "pos": [1, {"a": 2}]})
    draws = (torch.rand(3), random.random(), np.random.rand())
    other, other_opt = _model(seed=1)
    state = ckpt.load(path, model=other, optimizer=other_opt, ctx=CTX)
    assert state["step"] == 3 and state["extra"]["pos"] == [1, {"a": 2}]
    assert torch.equal(state["extra"]["gen"], gen.get_state())
    assert torch.equal(draws[0], torch.rand(3)) and draws[1:] == (random.random(), np.random.rand())
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name
    _step(model, opt)
    _step(other, other_opt)  # the same optimizer state: the same next step
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name
    assert {n for n, p in other.named_parameters() if p in other_opt.state} == {
        n for n, p in model.named_parameters() if p in opt.state
    }  # the value head got no gradient: no state saved, none restored


def test_a_crash_mid_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    model, opt = _model()
    _save(tmp_path, 1, model, opt)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(FileSystemWriter, "write_data", crash)
    with pytest.raises(BaseException, match="disk full"):  # DCP's CheckpointException
        _save(tmp_path, 2, model, opt)
    monkeypatch.undo()
    monkeypatch.setattr(ckpt, "_replace_dir", crash)  # everything written, not yet renamed
    with pytest.raises(OSError, match="disk full"):
        _save(tmp_path, 3, model, opt)
    monkeypatch.undo()
    assert (tmp_path / ".step_3.tmp").is_dir()
    assert ckpt.latest(tmp_path).name == "step_1"
    _save(tmp_path, 3, model, opt, keep_last=1)  # a later save cleans up and prunes
    assert sorted(p.name for p in tmp_path.iterdir()) == [".step_2.tmp", "step_3"]


def test_damaged_checkpoints_are_named_and_skipped(tmp_path, caplog):
    model, opt = _model()
    for step in (1, 2, 3):
        _save(tmp_path, step, model, opt)
    shard = tmp_path / "step_3" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    (tmp_path / "step_2" / "meta.json").unlink()
    with caplog.at_level(logging.WARNING):
        assert ckpt.latest(tmp_path).name == "step_1"
    assert "step_3 is unusable (__0_0.distcp has 100 bytes" in caplog.text
    assert "step_2 is unusable (meta.json is missing" in caplog.text
    with pytest.raises(ValueError, match=r"step_3 is unusable: __0_0.distcp has 100 bytes"):
        ckpt.load(tmp_path / "step_3", model=model, optimizer=opt, ctx=CTX)
    assert ckpt.latest(tmp_path / "nowhere") is None


class _Evil:
    def __reduce__(self):
        return os.system, ("touch PWNED",)


def test_metadata_that_would_run_code_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, opt = _model()
    path = _save(tmp_path / "ckpt", 1, model, opt)
    (path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    meta = json.loads((path / "meta.json").read_text())
    meta["files"][".metadata"] = (path / ".metadata").stat().st_size  # a consistent forgery
    meta["sha256"][".metadata"] = hashlib.sha256((path / ".metadata").read_bytes()).hexdigest()
    meta["meta_sha256"] = ckpt._meta_digest(meta)
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(pickle.UnpicklingError, match=r"refers to (posix|os)\.system"):
        ckpt.load(path, model=model, optimizer=opt, ctx=CTX)
    assert not (tmp_path / "PWNED").exists()


def test_pickled_checkpoint_items_are_refused():
    """DCP's DefaultLoadPlanner.load_bytes would torch.load(weights_only=False) them."""
    item = type("Item", (), {"dest_index": type("Index", (), {"fqn": "optim.lr"})()})()
    with pytest.raises(ValueError, match=r"'optim.lr' is a pickled object, not a tensor"):
        TensorsOnlyPlanner().load_bytes(item, io.BytesIO(b"anything"))


def test_bad_extra_and_other_model_fail_clearly(tmp_path):
    model, opt = _model()
    with pytest.raises(TypeError, match="cannot store a object without pickling"):
        _save(tmp_path, 1, model, opt, extra={"x": object()})
    path = _save(tmp_path, 2, model, opt)
    bigger, bigger_opt = (
        attach_value_head(build_tiny_qwen3(99, hidden_size=16, num_heads=2, num_layers=3)),
        None,
    )
    with pytest.raises(ValueError, match=r"has no \['model.layers.2"):
        ckpt.load(path, model=bigger, optimizer=bigger_opt, ctx=CTX)


def test_extra_tensors_are_stored_as_raw_bytes():
    """A checkpoint's ``extra`` holds an async run's pending rollout batch: decimal lists made it
    ~10x its size (a 512 x 8k-token batch near 1 GB of JSON); raw bytes in base64 are 4/3."""
    from ar_torchrl.checkpoint._safe_io import decode, encode

    tensors = [
        torch.randn(3, 4),
        torch.tensor(5),
        torch.zeros(0, 3),
        torch.ones(2, dtype=torch.bool),
        torch.randn(5).bfloat16(),
        torch.randint(0, 9, (2, 3)),
        torch.Generator().get_state(),
    ]
    for t in tensors:
        back = decode(json.loads(json.dumps(encode(t))))
        assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)
    batch = torch.randn(64, 1024)
    assert len(json.dumps(encode(batch))) < 1.4 * batch.numel() * 4
    old = {"__tensor__": [1, 2], "dtype": "int64", "shape": [2]}  # the first format still reads
    assert torch.equal(decode(old), torch.tensor([1, 2]))
