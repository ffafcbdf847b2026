"""DCP's ``.metadata`` is unpickled through exact ``(module, name)`` pairs (N9, issue 29): the
classes DCP really pickles there (found by saving real checkpoints, pinned here), refused dotted
names (``torch.distributed.checkpoint.metadata`` imports ``os``, so with protocol 4 the global
``"os.system"`` of that module resolved and a ``REDUCE`` called it), refused non-classes; a planted
``.metadata`` never runs on any load path (resume, ``critic.init_from``, ``latest``/``auto``)."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import struct
from pathlib import Path

import pytest
import torch
from support.recipe_helpers import load

from ar_torchrl.checkpoint import _safe_io, checkpoint_store, sharded
from ar_torchrl.checkpoint._safe_io import METADATA_GLOBALS, SafeReader, _MetadataUnpickler
from ar_torchrl.distributed import DistContext, distributed, shard_actor_critic
from ar_torchrl.models.tiny import build_tiny_qwen3
from ar_torchrl.modules import LMActorCritic, attach_value_head, build_separate_critic
from ar_torchrl.recipes import dapo_ppo

torch.set_num_threads(1)
DCP_META = "torch.distributed.checkpoint.metadata"


def _str(text: str) -> bytes:
    data = text.encode()
    return b"\x8c" + struct.pack("<B", len(data)) + data  # SHORT_BINUNICODE


def calls(module: str, name: str, arg: str) -> bytes:
    """A protocol-4 pickle of ``module.name(arg)``: STACK_GLOBAL, then REDUCE."""
    return b"\x80\x04" + _str(module) + _str(name) + b"\x93" + _str(arg) + b"\x85R."


def touch(marker: Path) -> str:
    return f"touch {marker}"


def unpickle(data: bytes):
    import io

    return _MetadataUnpickler(io.BytesIO(data)).load()


# ----------------------------------------------------------------------------- the allowlist
class _Recorder(pickle.Unpickler):
    def __init__(self, file, seen: set) -> None:
        super().__init__(file)
        self.seen = seen

    def find_class(self, module, name):
        self.seen.add((module, name))
        return super().find_class(module, name)


def _step(module, opt) -> None:
    for p in module.parameters():
        p.grad = torch.full_like(p, 0.1)
    opt.step()
    opt.zero_grad()


def test_the_allowlist_is_what_dcp_pickles_and_real_checkpoints_load(tmp_path):
    """Model only, model + AdamW, FSDP2 (float32 and bfloat16 compute) and a separate critic:
    every global their ``.metadata`` names is allowed, and nothing else is allowed but torch's
    dtypes and BytesStorageMetadata (the metadata of a non-tensor item, refused when loaded)."""
    seen: set[tuple[str, str]] = set()
    paths = []

    def save(model, opt, ctx, name):
        path = sharded.save(tmp_path / name, step=1, model=model, optimizer=opt, ctx=ctx)
        with open(path / ".metadata", "rb") as f:
            _Recorder(f, seen).load()
        paths.append(path)

    plain = attach_value_head(build_tiny_qwen3(99, hidden_size=16, num_heads=2))
    save(plain, None, DistContext(), "model")
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    _step(plain, opt)
    save(plain, opt, DistContext(), "model_adamw")
    with distributed("cpu", process_group=True) as ctx:
        for dtype in ("float32", "bfloat16"):
            ac = LMActorCritic(attach_value_head(build_tiny_qwen3(99, hidden_size=32)))
            shard_actor_critic(ac, ctx, compute_dtype=dtype)
            opt = torch.optim.AdamW(ac.parameters(), lr=1e-3)
            _step(ac, opt)
            save(ac, opt, ctx, f"fsdp2_{dtype}")
        policy = build_tiny_qwen3(99, hidden_size=32)
        critic = build_separate_critic(policy)
        both = torch.nn.ModuleDict(
            {"policy": LMActorCritic(policy, critic=False), "critic": critic}
        )
        for module in both.values():
            shard_actor_critic(module, ctx, compute_dtype="bfloat16")
        opt = torch.optim.AdamW(both.parameters(), lr=1e-3)
        _step(both, opt)
        save(both, opt, ctx, "separate_critic")
    assert seen <= set(METADATA_GLOBALS), sorted(seen - set(METADATA_GLOBALS))
    allowed = {k for k, v in METADATA_GLOBALS.items() if not isinstance(v, torch.dtype)}
    assert allowed - seen == {(DCP_META, "BytesStorageMetadata")}
    for path in paths:  # each one unpickles through the allowlist
        assert SafeReader(path).read_metadata().state_dict_metadata


def test_a_dotted_name_is_refused_and_never_runs(tmp_path):
    """The global that passed the module-wide allowlist: it runs under plain pickle."""
    marker = tmp_path / "code_ran"
    data = calls(DCP_META, "os.system", touch(marker))
    with pytest.raises(
        pickle.UnpicklingError,
        match=rf"refers to {DCP_META}\.os\.system, which is not one of the DCP metadata classes",
    ):
        unpickle(data)
    assert not marker.exists()
    pickle.loads(data)  # what the old reader did (pickle.load): the payload is live
    assert marker.exists()


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("posix", "system"),
        ("os", "system"),
        ("builtins", "eval"),
        (DCP_META, "cast"),  # a function imported there
        ("torch", "load"),
        ("torch.serialization", "os.system"),
    ],
)
def test_anything_but_the_exact_pairs_is_refused(tmp_path, module, name):
    marker = tmp_path / "code_ran"
    with pytest.raises(pickle.UnpicklingError, match=rf"refers to {module}\.{name}, which is not"):
        unpickle(calls(module, name, touch(marker)))
    assert not marker.exists()


def test_an_allowed_name_that_is_not_a_class_is_refused(tmp_path, monkeypatch):
    """The second line: a pair listed as a class must resolve to a class."""
    monkeypatch.setitem(METADATA_GLOBALS, ("os", "system"), None)
    marker = tmp_path / "code_ran"
    with pytest.raises(pickle.UnpicklingError, match=r"os.system, which is not a class here"):
        unpickle(calls("os", "system", touch(marker)))
    assert not marker.exists()


def test_layouts_and_dtypes_resolve_to_themselves_only():
    assert unpickle(calls("torch.serialization", "_get_layout", "torch.strided")) is torch.strided
    with pytest.raises(pickle.UnpicklingError, match="names the layout 'os', not a layout"):
        unpickle(calls("torch.serialization", "_get_layout", "os"))
    assert unpickle(b"\x80\x04" + _str("torch") + _str("bfloat16") + b"\x93.") is torch.bfloat16
    with pytest.raises(ValueError, match=r"'load' is not a torch dtype"):
        _safe_io.decode({"__tensor__": "", "dtype": "load", "shape": [0]})


# ----------------------------------------------------------------------------- planted checkpoints
def plant(path: Path, marker: Path) -> None:
    """Replace ``.metadata`` with a payload that would run ``touch marker`` and recompute every
    checksum, as someone who can write the run directory would."""
    (path / ".metadata").write_bytes(calls(DCP_META, "os.system", touch(marker)))
    meta = json.loads((path / "meta.json").read_text())
    data = (path / ".metadata").read_bytes()
    meta["files"][".metadata"] = len(data)
    meta["sha256"][".metadata"] = hashlib.sha256(data).hexdigest()
    meta["meta_sha256"] = sharded._meta_digest(meta)
    (path / "meta.json").write_text(json.dumps(meta))


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """A run directory with an intact step_2 and a planted step_4 (a one-rank FSDP2 group);
    ``unpickled`` counts every ``.metadata`` unpickling."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "a"
    marker = tmp_path / "code_ran"
    unpickled = []
    original = _MetadataUnpickler.load
    monkeypatch.setattr(
        _MetadataUnpickler, "load", lambda self: unpickled.append(1) or original(self)
    )
    with distributed("cpu", process_group=True) as ctx:
        ac = LMActorCritic(attach_value_head(build_tiny_qwen3(99, hidden_size=32)))
        shard_actor_critic(ac, ctx, compute_dtype="bfloat16")
        for step in (2, 4):
            sharded.save(run / "checkpoints", step=step, model=ac, optimizer=None, ctx=ctx)
        plant(run / "checkpoints" / "step_4", marker)
        unpickled.clear()
        yield ctx, ac, run, marker, unpickled
    assert not marker.exists()


REFUSED = rf"refers to {DCP_META}\.os\.system, which is not one of the DCP metadata classes"


def test_a_planted_metadata_never_runs_on_any_load_path(planted):
    ctx, ac, run, marker, unpickled = planted
    store, step_4 = checkpoint_store(sharded=True, ctx=ctx), run / "checkpoints" / "step_4"
    # choosing: the checksums match (a forgery), and nothing is unpickled to choose
    assert store.latest(run / "checkpoints") == step_4 and unpickled == []
    for source in (str(run), str(step_4)):
        raw = load(["model.dtype=bfloat16", f"train.resume_from={source}"])
        cfg = dapo_ppo.validate_config(raw)
        assert dapo_ppo.checkpoint_to_resume(cfg, raw, run.parent / "b", store) == step_4
        raw = load(["model.dtype=bfloat16", f"critic.init_from={source}"])
        cfg = dapo_ppo.validate_config(raw)
        assert dapo_ppo.main.find_critic_source(cfg, store) == step_4
    auto = load(["model.dtype=bfloat16", f"runs_dir={run.parent}", "train.resume_from=auto"])
    (run / ".hydra").mkdir()
    (run / ".hydra" / "config.yaml").write_text(json.dumps(_config(auto)))
    assert dapo_ppo.checkpoint_to_resume(
        dapo_ppo.validate_config(auto), auto, run.parent / "b", store
    ) == (step_4)
    assert unpickled == [] and not marker.exists()
    # loading: refused, naming the global, nothing run
    with pytest.raises(pickle.UnpicklingError, match=REFUSED):
        store.load(step_4, actor_critic=ac, optimizer=None)
    with pytest.raises(pickle.UnpicklingError, match=REFUSED):
        store.load_critic(step_4, critic=None, actor_critic=ac)
    assert len(unpickled) == 2  # the reader got there, and refused
    assert store.load(run / "checkpoints" / "step_2", actor_critic=ac, optimizer=None)["step"] == 2


def _config(raw) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(raw, resolve=False)


def test_with_a_key_a_planted_checkpoint_is_refused_before_it_is_unpickled(planted, monkeypatch):
    ctx, ac, run, marker, unpickled = planted
    monkeypatch.setenv("AR_TORCHRL_TEST_KEY", "a3f1" * 8)
    store = checkpoint_store(sharded=True, ctx=ctx, hmac_key_env="AR_TORCHRL_TEST_KEY")
    step_2 = run / "checkpoints" / "step_2"
    store.save(run / "checkpoints", 6, actor_critic=ac, optimizer=None, extra={})
    plant(run / "checkpoints" / "step_6", marker)  # signed, then planted: nobody can re-sign it
    for path in (run / "checkpoints" / "step_4", run / "checkpoints" / "step_6"):
        with pytest.raises(ValueError, match=rf"{path} is unusable: .*\$AR_TORCHRL_TEST_KEY"):
            store.load(path, actor_critic=ac, optimizer=None)
        with pytest.raises(ValueError, match=rf"{path} is unusable: .*\$AR_TORCHRL_TEST_KEY"):
            store.load_critic(path, critic=None, actor_critic=ac)
    assert store.latest(run / "checkpoints") is None  # step_2 was saved without the key
    assert checkpoint_store(sharded=True, ctx=ctx).latest(run / "checkpoints") == (
        run / "checkpoints" / "step_6"
    )
    assert unpickled == [] and step_2.is_dir()


@pytest.mark.parametrize("payload", ["dotted", "plain"])
def test_the_old_reader_paths_refuse_both_payloads(tmp_path, payload, monkeypatch):
    """``os.system`` as pickle writes it (module ``posix``) and as the N9 probe planted it."""
    monkeypatch.chdir(tmp_path)
    model = attach_value_head(build_tiny_qwen3(99, hidden_size=16, num_heads=2))
    path = sharded.save(tmp_path / "ckpt", step=1, model=model, optimizer=None, ctx=DistContext())
    marker = tmp_path / "code_ran"
    if payload == "plain":
        (path / ".metadata").write_bytes(calls(os.system.__module__, "system", touch(marker)))
    else:
        (path / ".metadata").write_bytes(calls(DCP_META, "os.system", touch(marker)))
    with pytest.raises(pickle.UnpicklingError, match=r"\.system, which is not one of the DCP"):
        SafeReader(path).read_metadata()
    assert not marker.exists()
