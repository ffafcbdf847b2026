"""TensorWeightSender: buckets through shared memory, inside weight-update sessions."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing  # noqa: F401 - registers the reductions used to decode tensor payloads
from support.sglang_helpers import (
    ROOT,
    SentNames,
    alive,
    assert_server_matches,
    metadata_only,
    sglang_backend,
    trainer_with_value_head,
    wait_until,
)

from ar_torchrl.backends.sglang import SGLangBackend
from ar_torchrl.backends.sglang.senders.tensor import flatten_bucket
from ar_torchrl.models.tiny import build_tiny_qwen3
from ar_torchrl.weight_sync import WeightSyncError, named_policy_tensors


@pytest.mark.sglang
@pytest.mark.slow
def test_tensor_sync_in_buckets_on_the_real_server(sglang_server):
    model = trainer_with_value_head(seed=21)
    policy = {n for n, _ in named_policy_tensors(model)}
    options = {"bucket_bytes": 20_000}
    with SGLangBackend(
        sglang_server.url, weight_sync="tensor", weight_sync_options=options, show_progress=False
    ) as backend:
        sent = SentNames(backend)
        backend.sync_weights(model.state_dict().items(), version=21)
        assert_server_matches(backend, model, 21)
        model2 = trainer_with_value_head(seed=22)
        backend.sync_weights(named_policy_tensors(model2), version=22)
        assert_server_matches(backend, model2, 22)  # the same prompts: the cache was flushed
    assert set(sent.names) == policy and len(sent.names) == 2 * len(policy)
    assert sent.paths.count("/update_weights_from_tensor") > 2  # several buckets per sync
    assert not [p for p in sent.paths if p.startswith("/flush_cache")]  # the update flushed
    assert (
        sent.paths.count("/begin_weight_update") == 2
        and sent.paths.count("/end_weight_update") == 2
    )


def _tensor_handlers(double, *, set_version: bool = True, begin_status: int = 404):
    """Older server (404 on begin/end) accepting flattened buckets; records what it received."""

    def update(body):
        metas = metadata_only(body["serialized_named_tensors"][0])["metadata"]
        double.received = getattr(double, "received", []) + [[m.name for m in metas]]
        if set_version and "weight_version" in body:
            double.weight_version = body["weight_version"]
        return 200, {"success": True, "message": "Success"}

    double.handlers.update(
        {
            "/begin_weight_update": lambda body: (begin_status, {"detail": "Not Found"}),
            "/end_weight_update": lambda body: (begin_status, {"detail": "Not Found"}),
            "/update_weights_from_tensor": update,
        }
    )


def test_buckets_carry_the_version_on_the_last_one(sglang_double):
    _tensor_handlers(sglang_double)
    model = trainer_with_value_head(seed=1)
    with SGLangBackend(
        sglang_double.url, weight_sync="tensor", weight_sync_options={"bucket_bytes": 20_000}
    ) as backend:
        backend.sync_weights(model.state_dict().items(), version=3)
    bodies = [b for p, b in sglang_double.requests if p == "/update_weights_from_tensor"]
    assert len(bodies) > 1 and sglang_double.weight_version == "3"
    assert ["weight_version" in b for b in bodies] == [False] * (len(bodies) - 1) + [True]
    assert [b["flush_cache"] for b in bodies] == [False] * (len(bodies) - 1) + [True]
    assert all(b["load_format"] == "flattened_bucket" for b in bodies)
    received = [n for bucket in sglang_double.received for n in bucket]
    assert sorted(received) == sorted(n for n, _ in named_policy_tensors(model))


def test_the_last_update_flushes_the_cache_without_a_separate_flush_call(sglang_double):
    """Issue 31 item 4: SGLang's update endpoints flush the cache themselves (``flush_cache`` on
    the last bucket); no ``/flush_cache`` round trip follows. A server that refuses that flush
    (another client's requests run: the weights are loaded, the call fails) is flushed once idle;
    one that stays busy fails the sync, partial (it serves the new weights over a stale cache)."""
    sglang_double.accept_weight_updates(refuse_flushes=1)
    model = build_tiny_qwen3(99)
    with sglang_backend(
        sglang_double.url, weight_sync="tensor", weight_sync_options={"bucket_bytes": 20_000}
    ) as backend:
        backend.sync_weights(named_policy_tensors(model), version=2)  # refused, then flushed
        paths = [p for p, _ in sglang_double.requests]
        last_update = max(i for i, p in enumerate(paths) if p == "/update_weights_from_tensor")
        assert paths.index("/flush_cache?timeout=30") == last_update + 1
        assert sglang_double.flushes == 1 and backend.policy_version == 2
        del sglang_double.requests[:]
        backend.sync_weights(named_policy_tensors(model), version=3)
        paths = [p for p, _ in sglang_double.requests]
        assert paths.count("/update_weights_from_tensor") > 1
        assert not [p for p in paths if p.startswith("/flush_cache")]
        assert sglang_double.flushes == 2 and backend.policy_version == 3
        sglang_double.accept_weight_updates(refuse_flushes=1)
        sglang_double.handlers["/flush_cache?timeout=30"] = lambda body: (400, "busy")
        with pytest.raises(
            WeightSyncError, match=r"loaded the weights but did not flush its cache \(busy for"
        ) as info:
            backend.sync_weights(named_policy_tensors(model), version=4)
        assert info.value.partial and backend.policy_version == 3


def test_version_mismatch_rejection_and_session_errors(sglang_double):
    _tensor_handlers(sglang_double, set_version=False)
    model = build_tiny_qwen3(99)
    with SGLangBackend(sglang_double.url, weight_sync="tensor") as backend:
        with pytest.raises(
            WeightSyncError, match=r"report weight_version \['default'\].*expected '4'"
        ) as info:
            backend.sync_weights(named_policy_tensors(model), version=4)
        assert info.value.partial and backend.policy_version == 0
    sglang_double.handlers["/update_weights_from_tensor"] = lambda body: (
        400,
        {"success": False, "message": "Failed to update weights: size mismatch for lm_head.weight"},
    )
    with SGLangBackend(sglang_double.url, weight_sync="tensor") as backend:
        with pytest.raises(
            WeightSyncError,
            match=r"SGLang update_weights_from_tensor failed on 1 of 1 server\(s\).*size mismatch for lm_head",
        ):
            backend.sync_weights(named_policy_tensors(model), version=5)
    _tensor_handlers(sglang_double, begin_status=400)
    with SGLangBackend(sglang_double.url, weight_sync="tensor") as backend:
        with pytest.raises(
            WeightSyncError, match=r"begin_weight_update rejected the request \(HTTP 400\)"
        ) as info:
            backend.sync_weights(named_policy_tensors(model), version=1)
        assert not info.value.partial


def test_flatten_bucket_offsets():
    bucket = [
        ("d", torch.ones(1, dtype=torch.float64)),
        ("f", torch.ones(2)),
        ("h", torch.ones(3, dtype=torch.float16)),
    ]
    flat, meta = flatten_bucket(bucket)
    assert [(m.start_idx, m.end_idx) for m in meta] == [(0, 8), (8, 16), (16, 22)]
    assert torch.equal(flat[8:16].view(torch.float32), torch.ones(2))


def test_flatten_bucket_into_shared_memory_equals_the_plain_one():
    """shared=True concatenates straight into a shared-memory segment (pickling copies nothing)."""
    bucket = [("a", torch.randn(3, 5)), ("b", torch.arange(7, dtype=torch.int64))]
    plain, meta = flatten_bucket(bucket)
    shared, shared_meta = flatten_bucket(bucket, shared=True)
    assert shared.is_shared() and not plain.is_shared()
    assert torch.equal(shared, plain) and shared.shape == (3 * 5 * 4 + 7 * 8,)
    assert [vars(m) for m in shared_meta] == [vars(m) for m in meta]


def test_flatten_bucket_refills_a_buffer_that_fits_and_replaces_one_that_does_not():
    bucket = [("a", torch.randn(3, 5)), ("b", torch.arange(7, dtype=torch.int64))]
    first, _ = flatten_bucket(bucket)
    bucket = [("a", torch.randn(3, 5)), ("b", torch.arange(7, dtype=torch.int64) + 1)]
    again, _ = flatten_bucket(bucket, out=first)
    assert again.data_ptr() == first.data_ptr() and torch.equal(again, flatten_bucket(bucket)[0])
    other, _ = flatten_bucket(bucket[:1], out=first)  # another size: a new buffer
    assert other.data_ptr() != first.data_ptr() and other.numel() == 60


# A stand-in trainer: shares a tensor the way the tensor sender does (file_system strategy, which
# starts torch's torch_shm_manager), hands it to a stand-in server that opens it and then keeps
# running (as an SGLang scheduler does, connected to the manager), registers its manager with the
# reaper, reports, and waits.
SHARING_TRAINER = """
import json, subprocess, sys, tempfile, time
from pathlib import Path
import torch
from ar_torchrl.backends.sglang.senders import tensor

torch.multiprocessing.set_sharing_strategy("file_system")
flat, _ = tensor.flatten_bucket([("w", torch.ones(1000))], shared=True)
work = Path(tempfile.mkdtemp(prefix="ar_torchrl-test-"))
(work / "payload").write_text(tensor.serialize_for_sglang(flat))
server = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(work)], start_new_session=True)
while not (work / "opened").exists():
    time.sleep(0.1)
del flat  # as the sender does once every server has answered
tensor._guard_shm_manager()
managers = [pid for pid, _ in tensor.shm_managers()]
print(json.dumps({"managers": managers, "server": server.pid, "work": str(work)}), flush=True)
sys.stdin.read()
"""
SERVER = """
import base64, pickle, sys, time
from pathlib import Path
work = Path(sys.argv[1])
t = pickle.loads(base64.b64decode((work / "payload").read_text()))
(work / "opened").write_text(str(t.numel()))
del t
time.sleep(120)
"""


def test_the_shm_manager_ends_with_the_trainer_though_a_server_holds_it():
    """torch's torch_shm_manager exits only once no client is connected, and a server that opened
    one of our segments stays connected: without the reaper it outlives the trainer (~100 MB)."""
    trainer = subprocess.Popen(
        [sys.executable, "-c", SHARING_TRAINER, SERVER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    info = json.loads(trainer.stdout.readline())
    try:
        assert len(info["managers"]) == 1 and alive(info["managers"][0])
        trainer.kill()
        trainer.wait(10)
        took = wait_until(lambda: not alive(info["managers"][0]), 15)
        assert took < 15, "torch_shm_manager outlived its trainer"
        assert alive(info["server"])  # it was stopped although its client still runs
        assert not list(Path("/dev/shm").glob(f"torch_{trainer.pid}_*"))
    finally:
        os.kill(info["server"], signal.SIGKILL)
        shutil.rmtree(info["work"], ignore_errors=True)
