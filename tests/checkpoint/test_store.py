"""One checkpoint store over both formats (``ar_torchrl.checkpoint.store``): the same calls save,
find, verify and load a ``.pt`` file (one process) and a DCP directory (FSDP2 on a one-rank gloo
group); one naming rule; the optional HMAC (``hmac_key_env``): signed checkpoints load, unsigned,
tampered, renamed and wrongly signed ones are refused before anything is hashed, unpickled or
loaded, naming the checkpoint and the variable; the key never shows."""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from ar_torchrl.checkpoint import (
    CheckpointSigner,
    CheckpointStore,
    LocalStore,
    ShardedStore,
    _safe_io,
    checkpoint_name,
    checkpoint_store,
    local,
    sharded,
)
from ar_torchrl.distributed import distributed, shard_actor_critic
from ar_torchrl.models.tiny import build_tiny_qwen3
from ar_torchrl.modules import LMActorCritic, attach_value_head

torch.set_num_threads(1)
ENV, OTHER_ENV = "AR_TORCHRL_TEST_CHECKPOINT_KEY", "AR_TORCHRL_TEST_OTHER_KEY"
KEY, OTHER_KEY = "5f3c9a1e77d24b08a6c1e0f2d9b84c3a", "0d1e2f3a4b5c6d7e8f9a0b1c2d3e4f5a"


@pytest.fixture(params=["local", "sharded"])
def run(request, monkeypatch):
    """``(sharded, ctx, make)``: ``make(seed)`` is an actor-critic (FSDP2 when sharded) with its
    AdamW after one step; the keys are in the environment."""
    monkeypatch.setenv(ENV, KEY)
    monkeypatch.setenv(OTHER_ENV, OTHER_KEY)
    is_sharded = request.param == "sharded"

    def make(seed: int = 0):
        ac = LMActorCritic(attach_value_head(build_tiny_qwen3(99, hidden_size=32, seed=seed)))
        if is_sharded:
            shard_actor_critic(ac, ctx, compute_dtype="float32")
        opt = torch.optim.AdamW(ac.parameters(), lr=1e-2)
        for p in ac.parameters():
            p.grad = torch.full_like(p, 0.1)
        opt.step()
        opt.zero_grad()
        return ac, opt

    if not is_sharded:
        ctx = None
        yield False, None, make
        return
    with distributed("cpu", process_group=True) as ctx:
        yield True, ctx, make


def store_of(run, env=None) -> CheckpointStore:
    is_sharded, ctx, _ = run
    return checkpoint_store(sharded=is_sharded, ctx=ctx, hmac_key_env=env)


def full_state(ac) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(ac, options=StateDictOptions(full_state_dict=True))


def make_pair(run):
    return run[2]()


def save(store, directory: Path, step: int, ac, opt) -> Path:
    return store.save(directory, step, actor_critic=ac, optimizer=opt, extra={"cursor": step * 16})


# ----------------------------------------------------------------------------- one interface
def test_one_function_chooses_the_store_and_one_rule_names_its_checkpoints():
    local_store = checkpoint_store(sharded=False)
    assert isinstance(local_store, LocalStore) and isinstance(local_store, CheckpointStore)
    assert (local_store.kind, local_store.pattern) == ("a single-process", "step_<N>.pt")
    dcp_store = checkpoint_store(sharded=True)
    assert isinstance(dcp_store, ShardedStore) and isinstance(dcp_store, CheckpointStore)
    assert (dcp_store.kind, dcp_store.pattern) == ("a distributed (FSDP2)", "step_<N>")
    assert checkpoint_name(7, sharded=False) == "step_7.pt"
    assert checkpoint_name(7, sharded=True) == "step_7"


def test_the_same_calls_save_find_verify_and_load_either_format(run, tmp_path):
    is_sharded, _, make = run
    store = store_of(run)
    ac, opt = make()
    for step in (2, 4):
        path = save(store, tmp_path, step, ac, opt)
        assert path == tmp_path / checkpoint_name(step, sharded=is_sharded)
    assert store.latest(tmp_path) == path and store.verify(path) is None
    store.check(path)  # its kind, intact
    fresh, fresh_opt = make(seed=1)
    state = store.load(path, actor_critic=fresh, optimizer=fresh_opt)
    assert state["step"] == 4 and state["extra"] == {"cursor": 64}
    want, got = full_state(ac), full_state(fresh)
    assert all(torch.equal(want[k], got[k]) for k in want)
    other, _ = make(seed=2)
    what = store.load_critic(path, critic=None, actor_critic=other)
    assert what == f"the value head of {path.name}"
    head = full_state(other)
    assert all(torch.equal(head[k], want[k]) for k in want if "value_head" in k)
    with pytest.raises(ValueError, match=r"train.resume_from: .* checkpoint but this run"):
        checkpoint_store(sharded=not is_sharded).check(path)


# ----------------------------------------------------------------------------- HMAC
def test_signed_checkpoints_load_and_unsigned_ones_are_refused_before_anything_is_read(
    run, tmp_path, caplog
):
    is_sharded, _, make = run
    ac, opt = make()
    signed_store, plain_store = store_of(run, ENV), store_of(run)
    older = save(signed_store, tmp_path, 2, ac, opt)
    unsigned = save(plain_store, tmp_path, 4, ac, opt)
    owner = "load_distributed_checkpoint" if is_sharded else "load_checkpoint"
    with pytest.MonkeyPatch.context() as spies:  # a checkpoint nobody signed is never read
        reads = spy_reads(spies)
        problem = signed_store.verify(unsigned)
        assert problem.startswith(f"{unsigned.name} is not signed (its manifest has no HMAC)")
        assert f"the key in ${ENV}" in problem and reads == []
        with caplog.at_level(logging.WARNING):
            assert signed_store.latest(tmp_path) == older
        assert f"checkpoint {unsigned} is unusable ({unsigned.name} is not signed" in caplog.text
        reads.clear()  # (latest went on to verify the older one)
        with pytest.raises(ValueError, match=rf"{owner}: {unsigned} is unusable: .* \${ENV}"):
            signed_store.load(unsigned, actor_critic=ac, optimizer=opt)
        with pytest.raises(
            ValueError, match=rf"critic.init_from: {unsigned} is unusable: .*\${ENV}"
        ):
            signed_store.load_critic(unsigned, critic=None, actor_critic=ac)
        with pytest.raises(
            ValueError, match=rf"train.resume_from: {unsigned} is unusable: .*\${ENV}"
        ):
            signed_store.check(unsigned)
        assert reads == []  # no file hashed, nothing unpickled or loaded
    # signed ones load with the key, and without it (checksums only)
    assert signed_store.verify(older) is None and plain_store.verify(older) is None
    assert signed_store.load(older, actor_critic=ac, optimizer=opt)["step"] == 2
    assert plain_store.load(older, actor_critic=ac, optimizer=opt)["step"] == 2


def spy_reads(monkeypatch) -> list[str]:
    """Records every file hashed, ``torch.load`` and DCP ``.metadata`` unpickling."""
    reads: list[str] = []

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            reads.append(name)
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(local, "file_sha256", spy("hash", local.file_sha256))
    monkeypatch.setattr(sharded, "_digests", spy("hash", sharded._digests))
    monkeypatch.setattr(torch, "load", spy("torch.load", torch.load))
    monkeypatch.setattr(
        _safe_io._MetadataUnpickler, "load", spy("unpickle", _safe_io._MetadataUnpickler.load)
    )
    return reads


def manifest_of(path: Path) -> Path:
    return path / "meta.json" if path.is_dir() else path.with_name(f".{path.name}.manifest.json")


def forge(path: Path, change) -> None:
    """Tamper as someone who can write the directory would: change the content, then recompute
    every checksum (sizes, SHA-256s, meta.json's own digest), keeping the old HMAC."""
    manifest = manifest_of(path)
    record = json.loads(manifest.read_text())
    change(path, record)
    if path.is_dir():
        for name in record["files"]:
            data = (path / name).read_bytes()
            record["files"][name] = len(data)
            record["sha256"][name] = hashlib.sha256(data).hexdigest()
        record["meta_sha256"] = sharded._meta_digest(record)
    else:
        data = path.read_bytes()
        record["size"], record["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    manifest.write_text(json.dumps(record))


def other_weights(path: Path, record: dict) -> None:
    if path.is_dir():  # the collector state and the RNG states live in meta.json / rng/*.json
        record["extra"]["cursor"] = 9999
        return
    payload = torch.load(path, weights_only=True)
    payload["model"] = {k: torch.zeros_like(v) for k, v in payload["model"].items()}
    torch.save(payload, path)


def no_signature(path: Path, record: dict) -> None:
    del record["hmac_sha256"]


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (other_weights, "its HMAC does not match the key in \\$" + ENV),
        (no_signature, "is not signed .its manifest has no HMAC. but checkpoints are authentic"),
    ],
    ids=["content changed", "signature deleted"],
)
def test_a_tampered_checkpoint_with_consistent_checksums_is_refused(run, tmp_path, change, problem):
    ac, opt = make_pair(run)
    store = store_of(run, ENV)
    path = save(store, tmp_path, 2, ac, opt)
    forge(path, change)
    assert store_of(run).verify(path) is None  # the checksums alone cannot tell
    with pytest.MonkeyPatch.context() as spies:
        reads = spy_reads(spies)
        with pytest.raises(ValueError, match=rf"{path} is unusable: .*{problem}"):
            store.load(path, actor_critic=ac, optimizer=opt)
        assert store.latest(tmp_path) is None
        assert reads == []


def test_a_wrong_key_and_a_renamed_checkpoint_are_refused(run, tmp_path):
    is_sharded, _, _ = run
    ac, opt = make_pair(run)
    path = save(store_of(run, ENV), tmp_path, 2, ac, opt)
    assert store_of(run, OTHER_ENV).verify(path) == (
        f"{path.name}: its HMAC does not match the key in ${OTHER_ENV} (signed with another key, "
        "or its manifest was altered): refused, it could have been planted or changed"
    )
    # an older signed checkpoint under a newer name (to roll a run back) is not the newer one
    renamed = tmp_path / checkpoint_name(8, sharded=is_sharded)
    shutil.move(path, renamed)
    if not is_sharded:
        shutil.move(manifest_of(path), manifest_of(renamed))
    assert "(renamed?)" in store_of(run, ENV).verify(renamed)
    assert store_of(run, ENV).latest(tmp_path) is None


def test_the_key_is_never_shown(run, tmp_path, monkeypatch, caplog):
    ac, opt = make_pair(run)
    store = store_of(run, ENV)
    with caplog.at_level(logging.DEBUG):
        path = save(store, tmp_path, 2, ac, opt)
        store.load(path, actor_critic=ac, optimizer=opt)
        store_of(run, OTHER_ENV).latest(tmp_path)
    shown = caplog.text + repr(store) + repr(store.signer) + manifest_of(path).read_text()
    assert KEY not in shown and OTHER_KEY not in shown and f"${ENV}" in repr(store)
    with pytest.raises(TypeError, match="holds a secret key and is not pickled"):
        pickle.dumps(store.signer)
    monkeypatch.setenv(ENV, "short-secret")  # too short: named, not shown
    with pytest.raises(ValueError, match=rf"hmac_key_env={ENV}: the key in \${ENV} has 12 bytes"):
        store_of(run, ENV)
    for value, message in ((None, "is not set"), ("", "is empty")):
        if value is None:
            monkeypatch.delenv(ENV)
        else:
            monkeypatch.setenv(ENV, value)
        with pytest.raises(ValueError, match=rf"the environment variable \${ENV} {message}"):
            store_of(run, ENV)
    with pytest.raises(ValueError, match="not the key itself; the value given is not printed"):
        CheckpointSigner.from_env(f"{KEY}+/=")


# ----------------------------------------------------------------------------- the old names
OLD_NAMES = {
    "save_checkpoint": local.save,
    "load_checkpoint": local.load,
    "latest_checkpoint": local.latest,
    "verify_checkpoint_file": local.verify,
    "load_critic_weights": local.load_critic,
    "save_distributed_checkpoint": sharded.save,
    "load_distributed_checkpoint": sharded.load,
    "latest_distributed_checkpoint": sharded.latest,
    "verify_checkpoint": sharded.verify,
    "load_distributed_critic": sharded.load_critic,
}


@pytest.mark.parametrize("old", sorted(OLD_NAMES))
def test_the_names_of_before_the_store_still_work_with_a_warning(old):
    import ar_torchrl.checkpoint as package

    new = OLD_NAMES[old]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert getattr(package, old) is new
        assert getattr(local if new.__module__.endswith("local") else sharded, old) is new
    expected = f"is now {new.__module__}.{new.__name__}"
    assert len(caught) == 2 and all(expected in str(w.message) for w in caught)
    assert all(w.category is DeprecationWarning for w in caught)
    for name in ("capture_rng_state", "restore_rng_state", "checkpoint_step"):
        assert callable(getattr(package, name))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from ar_torchrl.checkpoint.local import checkpoint_step, remove_partial_checkpoints
    assert checkpoint_step("x/step_3.pt") == 3 and callable(remove_partial_checkpoints)


# ----------------------------------------------------------------------------- the recipe (slow)
@pytest.mark.slow
def test_the_recipe_signs_and_refuses_with_checkpoint_hmac_key_env(
    tmp_path, cache_dir, monkeypatch
):
    """``checkpoint.hmac_key_env``: a signed run resumes exactly; the same resume without the key,
    or with another key, is refused naming the variable (and the checkpoint); the key appears in
    no file of the runs and in no output."""
    from support.recipe_runs import COMMON, run_recipe, same_runs

    monkeypatch.setenv(ENV, KEY)
    signed = [*COMMON, f"checkpoint.hmac_key_env={ENV}"]
    _, straight = run_recipe(tmp_path / "straight", cache_dir, *signed)
    step_2 = tmp_path / "straight" / "checkpoints" / "step_2.pt"
    assert "hmac_sha256" in json.loads(manifest_of(step_2).read_text())
    resume = f"train.resume_from={step_2}"
    proc, resumed = run_recipe(tmp_path / "resumed", cache_dir, *signed, resume)
    same_runs(straight, resumed)
    outputs = [proc.stdout + proc.stderr]
    monkeypatch.setenv(ENV, OTHER_KEY)
    proc, _ = run_recipe(tmp_path / "other_key", cache_dir, *signed, resume, check=False)
    assert proc.returncode == 1
    assert f"dapo_ppo: train.resume_from: {step_2} is unusable: step_2.pt: its HMAC does not " in (
        proc.stderr + proc.stdout
    )
    assert f"match the key in ${ENV}" in proc.stderr + proc.stdout
    outputs.append(proc.stdout + proc.stderr)
    monkeypatch.delenv(ENV)
    proc, _ = run_recipe(tmp_path / "no_key", cache_dir, *signed, resume, check=False)
    assert proc.returncode == 1
    assert (
        f"dapo_ppo: config: checkpoint.hmac_key_env={ENV}: the environment variable ${ENV} is not "
        "set" in proc.stderr + proc.stdout
    )
    outputs.append(proc.stdout + proc.stderr)
    for text in outputs + [p.read_bytes().decode("latin-1") for p in files(tmp_path)]:
        assert KEY not in text and OTHER_KEY not in text


def files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


@pytest.mark.slow
def test_the_recipe_never_runs_a_planted_dcp_metadata(tmp_path, cache_dir, monkeypatch):
    """N9 end to end, one FSDP2 process (bf16 compute): ``train.resume_from`` and
    ``critic.init_from`` at a DCP checkpoint whose ``.metadata`` would run a command (checksums
    recomputed by the forger) stop with the refused global named, and the command never runs;
    with ``checkpoint.hmac_key_env`` the forgery is refused before it is read."""
    from support.recipe_runs import run_recipe

    base = ["model.dtype=bfloat16", "train.eval_every=0", "train.plot=false", "logger=none"]
    run_recipe(tmp_path / "run", cache_dir, *base, "train.iterations=1")
    step_1 = tmp_path / "run" / "checkpoints" / "step_1"
    marker = tmp_path / "code_ran"
    meta = json.loads((step_1 / "meta.json").read_text())
    data = _safe_io_payload(marker)
    (step_1 / ".metadata").write_bytes(data)
    meta["files"][".metadata"] = len(data)
    meta["sha256"][".metadata"] = hashlib.sha256(data).hexdigest()
    meta["meta_sha256"] = sharded._meta_digest(meta)
    (step_1 / "meta.json").write_text(json.dumps(meta))
    refused = "refers to torch.distributed.checkpoint.metadata.os.system, which is not one of"
    for name, source in (
        ("resume", f"train.resume_from={tmp_path / 'run'}"),
        ("critic", f"critic.init_from={step_1}"),
    ):
        proc, _ = run_recipe(
            tmp_path / name, cache_dir, *base, "train.iterations=2", source, check=False
        )
        assert proc.returncode != 0 and refused in proc.stderr, proc.stderr[-3000:]
        assert not marker.exists()
    monkeypatch.setenv(ENV, KEY)
    proc, _ = run_recipe(
        tmp_path / "keyed",
        cache_dir,
        *base,
        "train.iterations=2",
        f"train.resume_from={step_1}",
        f"checkpoint.hmac_key_env={ENV}",
        check=False,
    )
    assert proc.returncode == 1 and refused not in proc.stderr
    assert f"train.resume_from: {step_1} is unusable: step_1 is not signed" in proc.stderr
    assert not marker.exists()


def _safe_io_payload(marker: Path) -> bytes:
    """``os.system("touch marker")`` through the dotted global the old allowlist let through."""

    def text(s: str) -> bytes:
        return b"\x8c" + bytes([len(s.encode())]) + s.encode()

    module, name = "torch.distributed.checkpoint.metadata", "os.system"
    return b"\x80\x04" + text(module) + text(name) + b"\x93" + text(f"touch {marker}") + b"\x85R."
