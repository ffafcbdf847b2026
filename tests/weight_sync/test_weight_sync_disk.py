"""DiskWeightSender: shards written as they arrive, loaded by the real server; refused shapes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.sglang_helpers import SentNames, assert_server_matches, trainer_with_value_head

from ar_torchrl.backends.sglang import SGLangBackend
from ar_torchrl.models.tiny import build_tiny_qwen3
from ar_torchrl.weight_sync import WeightSyncError, named_policy_tensors


@pytest.mark.sglang
@pytest.mark.slow
def test_disk_sync_in_shards(sglang_server):
    model = trainer_with_value_head(seed=11)
    policy = {n for n, _ in named_policy_tensors(model)}
    options = {"bucket_bytes": 20_000}  # several shards + an index, as a big model would get
    with SGLangBackend(
        sglang_server.url, weight_sync="disk", weight_sync_options=options, show_progress=False
    ) as backend:
        sent = SentNames(backend)
        backend.sync_weights(model.state_dict().items(), version=11)  # raw state_dict: head dropped
        served = Path(backend.get(sglang_server.url, "/model_info")["model_path"])
        shards = sorted(served.glob("model-*.safetensors"))
        index = json.loads((served / "model.safetensors.index.json").read_text())
        assert len(shards) > 1 and set(index["weight_map"]) == policy
        assert served.name.startswith("ar_torchrl-weights-") and (served / "config.json").is_file()
        assert_server_matches(backend, model, 11)
        model2 = trainer_with_value_head(seed=12)
        backend.sync_weights(named_policy_tensors(model2), version=12)
        assert_server_matches(backend, model2, 12)  # the same prompts: the cache was flushed
        assert not served.exists()  # the previous sync's dir is removed once replaced
    assert set(sent.names) == policy and len(sent.names) == 2 * len(policy)
    assert not [p for p in sent.paths if p.startswith("/flush_cache")]  # the update flushed


@pytest.mark.sglang
@pytest.mark.slow
def test_wrong_shapes_are_refused_before_the_server_sees_them(sglang_server):
    # A wrong-shaped disk update kills an SGLang 0.5.23 scheduler (its rollback re-reads the bad
    # files), so the disk sender refuses it against the served checkpoint's shapes.
    model = trainer_with_value_head(seed=5)
    bad = [
        (n, t[:, :32] if n == "model.embed_tokens.weight" else t)
        for n, t in named_policy_tensors(model)
    ]
    with SGLangBackend(sglang_server.url, weight_sync="disk", show_progress=False) as backend:
        sent = SentNames(backend)
        with pytest.raises(
            WeightSyncError,
            match=r"shapes differ.*'model.embed_tokens.weight', \(99, 32\), \(99, 64\)",
        ) as info:
            backend.sync_weights(bad, version=7)
        assert not info.value.partial and "/update_weights_from_disk" not in sent.paths
        assert backend.get(sglang_server.url, "/model_info")["weight_version"] != "7"
        backend.sync_weights(named_policy_tensors(model), version=8)  # the server is still usable
        assert_server_matches(backend, model, 8)


@pytest.mark.sglang
@pytest.mark.slow
def test_disk_dir_outlives_a_client_process_while_the_server_serves_it(sglang_server):
    """A client process that syncs from disk and exits must not delete the dir the shared server
    serves: the next client (this process) reads the served config from it."""
    code = (
        "from ar_torchrl.backends.sglang import SGLangBackend\n"
        "from ar_torchrl.models.tiny import build_tiny_qwen3\n"
        "from ar_torchrl.weight_sync import named_policy_tensors\n"
        f"b = SGLangBackend({sglang_server.url!r}, weight_sync='disk', show_progress=False)\n"
        "b.sync_weights(named_policy_tensors(build_tiny_qwen3(99, seed=3)), version=41)\n"
        "b.close()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with SGLangBackend(sglang_server.url, weight_sync="disk", show_progress=False) as backend:
        served = Path(backend.get(sglang_server.url, "/model_info")["model_path"])
        assert served.is_dir()
        backend.sync_weights(named_policy_tensors(build_tiny_qwen3(99, seed=6)), version=42)
        assert backend.get(sglang_server.url, "/model_info")["weight_version"] == "42"
    assert not served.exists()  # no longer served and its writer is gone: removed by this sync


def test_a_missing_config_source_is_named(sglang_double, tmp_path):
    with SGLangBackend(sglang_double.url, weight_sync="disk", show_progress=False) as backend:
        with pytest.raises(
            WeightSyncError, match=r"config source double does not exist .*config_dir"
        ) as info:
            backend.sync_weights(named_policy_tensors(build_tiny_qwen3(99)), version=1)
        assert not info.value.partial and backend.policy_version == 0


def test_an_orphaned_weights_dir_is_removed_only_when_its_writer_is_gone(tmp_path):
    import os
    import socket

    from ar_torchrl.backends.sglang.senders.disk import OWNER_FILE, remove_if_orphaned

    dead = subprocess.Popen(["true"])
    dead.wait()
    dirs = {}
    for name, owner in [
        ("ar_torchrl-weights-dead", dead.pid),
        ("ar_torchrl-weights-alive", os.getpid()),
        ("model", dead.pid),
        ("ar_torchrl-weights-none", None),
    ]:
        dirs[name] = tmp_path / name
        dirs[name].mkdir()
        if owner is not None:
            (dirs[name] / OWNER_FILE).write_text(f"{socket.gethostname()} {owner}")
        remove_if_orphaned(dirs[name])
    kept = {n for n, d in dirs.items() if d.exists()}
    assert kept == {"ar_torchrl-weights-alive", "model", "ar_torchrl-weights-none"}
