"""Checkpoint integrity: a damaged newest checkpoint (truncated, empty, one byte flipped, 4 KiB
overwritten) is skipped for the previous intact one with a warning naming the damaged file; naming
a damaged one explicitly is an error naming it; checkpoints saved before checksums still load.

Single-process ``.pt`` checkpoints (ar_torchrl.checkpoint.local), distributed ones on a one-rank
gloo group with FSDP2 (ar_torchrl.checkpoint.sharded), the recipe's choice of the checkpoint to
resume (``train.resume_from``), and the recipe end to end (slow).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from support.recipe_helpers import load
from support.recipe_runs import COMMON, run_recipe, same_runs

from ar_torchrl.checkpoint import LocalStore, ShardedStore, local
from ar_torchrl.checkpoint import sharded as dck
from ar_torchrl.distributed import distributed, shard_actor_critic
from ar_torchrl.models.tiny import build_tiny_qwen3
from ar_torchrl.modules import LMActorCritic, attach_value_head
from ar_torchrl.recipes import dapo_ppo

torch.set_num_threads(1)


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 0x01
    path.write_bytes(bytes(data))


def overwrite_4k(path: Path) -> None:
    """4 KiB of other bytes in the middle of the file: same size, other content."""
    data = bytearray(path.read_bytes())
    start = len(data) // 2 - 2048
    data[start : start + 4096] = bytes((b + 0x5A) % 256 for b in data[start : start + 4096])
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def empty(path: Path) -> None:
    path.write_bytes(b"")


def model_and_optimizer(seed: int = 0):
    model = attach_value_head(build_tiny_qwen3(99, hidden_size=32, num_heads=2, seed=seed))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.arange(3, 13).view(2, 5)).logits.square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


# ----------------------------------------------------------------------------- .pt files
PT_DAMAGE = {
    "truncated": (truncate, r"step_4\.pt has \d+ bytes, its manifest \.step_4\.pt\.manifest\.json"),
    "empty": (empty, r"step_4\.pt is empty \(0 bytes\)"),
    "flipped": (flip_byte, r"step_4\.pt does not match the SHA-256 in its manifest"),
}


@pytest.mark.parametrize("damage", list(PT_DAMAGE))
def test_damaged_newest_pt_is_skipped_and_refused_by_name(tmp_path, caplog, damage):
    model, opt = model_and_optimizer()
    older = local.save(tmp_path, step=2, model=model, optimizer=opt)
    newest = local.save(tmp_path, step=4, model=model, optimizer=opt)
    hurt, problem = PT_DAMAGE[damage]
    hurt(newest)
    if damage == "flipped":  # the case the checksum exists for: torch itself loads it silently
        torch.load(newest, weights_only=True)
    with caplog.at_level(logging.WARNING):
        assert local.latest(tmp_path) == older
        assert LocalStore().latest(tmp_path) == older
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2 and all(f"checkpoint {newest} is unusable (" in w for w in warnings)
    with pytest.raises(ValueError, match=f"load_checkpoint: {newest} is unusable: {problem}"):
        local.load(newest, model=model, optimizer=opt)
    with pytest.raises(ValueError, match=f"train.resume_from: {newest} is unusable: {problem}"):
        LocalStore().check(newest)
    fresh, fresh_opt = model_and_optimizer(seed=1)
    assert local.load(older, model=fresh, optimizer=fresh_opt)["step"] == 2
    torch.testing.assert_close(fresh.state_dict(), model.state_dict(), rtol=0, atol=0)


def test_resaving_a_damaged_step_writes_a_matching_manifest(tmp_path):
    """The resumed run saves step_4.pt again over the damaged one (and its manifest)."""
    model = torch.nn.Linear(2, 1)
    path = local.save(tmp_path, step=4, model=model)
    flip_byte(path)
    assert local.verify(path) is not None
    with torch.no_grad():
        model.weight.add_(1.0)
    assert local.save(tmp_path, step=4, model=model) == path
    assert local.verify(path) is None
    manifest = json.loads((tmp_path / ".step_4.pt.manifest.json").read_text())
    assert manifest["file"] == "step_4.pt" and manifest["size"] == path.stat().st_size
    assert len(manifest["sha256"]) == 64


def test_a_damaged_manifest_makes_its_checkpoint_unusable(tmp_path, caplog):
    model = torch.nn.Linear(2, 1)
    older = local.save(tmp_path, step=1, model=model)
    local.save(tmp_path, step=2, model=model)
    (tmp_path / ".step_2.pt.manifest.json").write_text('{"size": 7')
    with caplog.at_level(logging.WARNING):
        assert local.latest(tmp_path) == older
    assert "its manifest .step_2.pt.manifest.json is unreadable (JSONDecodeError" in caplog.text


def test_checkpoints_saved_before_manifests_load_unverified(tmp_path, caplog):
    """A .pt without a manifest (today's checkpoints) loads, logged once as unverified; its zip
    structure and CRC-32s still catch truncation, emptiness and flipped bytes."""
    model, opt = model_and_optimizer()
    for step in (1, 2, 3, 4, 5):
        local.save(tmp_path, step=step, model=model, optimizer=opt)
        (tmp_path / f".step_{step}.pt.manifest.json").unlink()  # as saved before this change
    truncate(tmp_path / "step_5.pt")
    flip_byte(tmp_path / "step_4.pt")
    empty(tmp_path / "step_3.pt")
    with caplog.at_level(logging.WARNING):
        assert local.latest(tmp_path).name == "step_2.pt"
        assert local.load(tmp_path / "step_2.pt", model=model, optimizer=opt)["step"] == 2
    assert "step_5.pt is not a complete torch.save archive, truncated or damaged" in caplog.text
    assert (
        "step_4.pt: its record 'archive/data/" in caplog.text and "fails its CRC-32" in caplog.text
    )
    assert "step_3.pt is empty (0 bytes)" in caplog.text
    unverified = [r for r in caplog.records if "is unverified" in r.getMessage()]
    assert len(unverified) == 1 and "step_2.pt has no manifest" in unverified[0].getMessage()
    torch.serialization.set_crc32_options(False)  # a file written without CRC-32s (all zero)
    try:
        path = local.save(tmp_path / "nocrc", step=1, model=model)
    finally:
        torch.serialization.set_crc32_options(True)
    (tmp_path / "nocrc" / ".step_1.pt.manifest.json").unlink()
    assert local.load(path, model=model)["step"] == 1


def test_damage_the_checks_cannot_see_is_still_named(tmp_path, monkeypatch):
    """A file torch cannot read although its checks passed gives an error naming it, not torch's
    bare PytorchStreamReader/EOFError message."""
    path = local.save(tmp_path, step=1, model=torch.nn.Linear(2, 1))
    empty(path)
    monkeypatch.setattr(local, "verify", lambda p, signer=None: None)
    with pytest.raises(ValueError, match=f"load_checkpoint: {path} could not be read .damaged"):
        local.load(path, model=torch.nn.Linear(2, 1))


# ----------------------------------------------------------------------------- DCP directories
@pytest.fixture
def sharded(tmp_path):
    """A one-rank gloo group, an FSDP2 actor-critic with AdamW states, and its checkpoints at
    steps 2 and 4 under ``tmp_path/checkpoints``."""
    with distributed("cpu", process_group=True) as ctx:
        ac = LMActorCritic(attach_value_head(build_tiny_qwen3(99, hidden_size=64, seed=0)))
        shard_actor_critic(ac, ctx, compute_dtype="float32")
        opt = torch.optim.AdamW(ac.parameters(), lr=1e-3)
        for param in ac.parameters():  # one AdamW step: optimizer states in the checkpoint
            param.grad = torch.ones_like(param)
        opt.step()
        opt.zero_grad()
        for step in (2, 4):
            dck.save(tmp_path / "checkpoints", step=step, model=ac, optimizer=opt, ctx=ctx)
        yield ctx, ac, opt, tmp_path / "checkpoints"


DCP_DAMAGE = {"flipped": flip_byte, "4 KiB overwritten": overwrite_4k}


@pytest.mark.parametrize("damage", list(DCP_DAMAGE))
def test_damaged_newest_dcp_shard_is_skipped_and_refused_by_name(sharded, caplog, damage):
    ctx, ac, opt, directory = sharded
    shard = directory / "step_4" / "__0_0.distcp"
    size = shard.stat().st_size
    assert size > 16 * 1024
    DCP_DAMAGE[damage](shard)
    assert shard.stat().st_size == size  # the size check alone passes
    problem = r"__0_0\.distcp does not match its SHA-256 in meta\.json \(same size, damaged"
    with caplog.at_level(logging.WARNING):
        assert dck.latest(directory, ctx) == directory / "step_2"
        assert ShardedStore(ctx).latest(directory) == directory / "step_2"
    assert f"checkpoint {directory / 'step_4'} is unusable (" in caplog.text
    assert "__0_0.distcp does not match" in caplog.text
    with pytest.raises(ValueError, match=f"step_4 is unusable: {problem}"):
        dck.load(directory / "step_4", model=ac, optimizer=opt, ctx=ctx)
    with pytest.raises(ValueError, match=f"train.resume_from: .*step_4 is unusable: {problem}"):
        ShardedStore(ctx).check(directory / "step_4")
    state = dck.load(directory / "step_2", model=ac, optimizer=opt, ctx=ctx)
    assert state["step"] == 2


def test_damaged_dcp_metadata_and_meta_json_are_named(sharded, caplog):
    ctx, ac, opt, directory = sharded
    flip_byte(directory / "step_4" / ".metadata")
    assert dck.verify(directory / "step_4").startswith(
        ".metadata does not match its SHA-256 in meta.json"
    )
    meta_path = directory / "step_2" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["step"] = 3  # valid JSON, other content: the collector state could be changed alike
    meta_path.write_text(json.dumps(meta))
    assert dck.verify(directory / "step_2") == (
        "meta.json does not match its own SHA-256 (damaged content)"
    )
    with caplog.at_level(logging.WARNING):
        assert dck.latest(directory) is None


def test_dcp_checkpoints_saved_before_checksums_load_unverified(sharded, caplog):
    ctx, ac, opt, directory = sharded
    for step in (2, 4):  # as saved before this change: sizes only
        meta_path = directory / f"step_{step}" / "meta.json"
        meta = json.loads(meta_path.read_text())
        del meta["sha256"], meta["meta_sha256"]
        meta_path.write_text(json.dumps(meta))
    truncate(directory / "step_4" / "__0_0.distcp")
    with caplog.at_level(logging.WARNING):
        found = dck.latest(directory)
        ShardedStore(ctx).check(found)
        state = dck.load(found, model=ac, optimizer=opt, ctx=ctx)
    assert found.name == "step_2" and state["step"] == 2
    assert "step_4 is unusable (__0_0.distcp has" in caplog.text  # sizes are still checked
    unverified = [r for r in caplog.records if "is unverified" in r.getMessage()]
    assert len(unverified) == 1 and "step_2 has no checksums" in unverified[0].getMessage()


# ----------------------------------------------------------------------------- the recipe's choice
def test_resume_from_names_the_damaged_checkpoint_and_a_run_dir_falls_back(tmp_path):
    """``train.resume_from=<damaged step_4.pt>`` is an error naming it; ``=<its run dir>``
    resumes from the intact step_2.pt."""
    run = tmp_path / "run"
    model = torch.nn.Linear(2, 1)
    for step in (2, 4):
        local.save(run / "checkpoints", step=step, model=model)
    damaged = run / "checkpoints" / "step_4.pt"
    flip_byte(damaged)

    def find(source):
        raw = load([f"train.resume_from={source}"])
        return dapo_ppo.checkpoint_to_resume(
            dapo_ppo.validate_config(raw), raw, tmp_path / "here", LocalStore()
        )

    with pytest.raises(
        ValueError, match=f"train.resume_from: {damaged} is unusable: step_4.pt does not match"
    ):
        find(damaged)
    assert find(run) == run / "checkpoints" / "step_2.pt"


# ----------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_recipe_resumes_from_the_intact_checkpoint_before_a_damaged_one(tmp_path, cache_dir):
    """A 6-iteration run (checkpoints at 2, 4, 6), copied back to its state after step 4 (step_6.pt
    removed) with one byte of step_4.pt flipped, rerun to 6: it resumes from step_2.pt (naming the
    damaged step_4.pt) and continues exactly as the uninterrupted run (two launches, not three)."""
    common = [*COMMON, "train.keep_checkpoints=null", "train.iterations=6"]
    straight_dir, run = tmp_path / "straight", tmp_path / "run"
    _, straight = run_recipe(straight_dir, cache_dir, *common)
    shutil.copytree(straight_dir, run)
    for path in (run / "checkpoints").glob("step_6*"):
        path.unlink()
    flip_byte(run / "checkpoints" / "step_4.pt")
    proc, resumed = run_recipe(run, cache_dir, *common)
    output = proc.stdout + proc.stderr  # hydra logs to stdout
    assert f"checkpoint {run / 'checkpoints' / 'step_4.pt'} is unusable (step_4.pt does" in output
    assert f"resumed from {run / 'checkpoints' / 'step_2.pt'} (step 2)" in output
    assert [h["step"] for h in resumed] == list(range(7))
    same_runs([h for h in straight if h["step"] >= 3], [h for h in resumed if h["step"] >= 3])
    same_runs(straight, resumed)  # steps 0-2 come from the first run's history
    assert os.path.exists(run / "checkpoints" / "step_6.pt")
