"""SGLang weight sync: each sender against the real server, plus fast protocol checks on the double."""
# ruff: noqa: F811 - pytest fixtures imported from sglang_fixtures are redefined as arguments

from __future__ import annotations

import base64
import pickle
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing  # noqa: F401 - registers the reductions used to decode tensor payloads
from safetensors import safe_open
from sglang_fixtures import (  # noqa: F401
    sglang_double,
    sglang_model_dir,
    sglang_server,
    trainer_log_probs,
)

from ar_torchrl.assets import build_tiny_qwen3
from ar_torchrl.backends import SamplingParams
from ar_torchrl.backends.sglang import SGLangBackend
from ar_torchrl.modules import attach_value_head
from ar_torchrl.weight_sync.errors import WeightSyncError
from ar_torchrl.weight_sync.names import named_policy_tensors
from ar_torchrl.weight_sync.sglang import bucketize, flatten_bucket, policy_tensors

PROMPTS = [[1, 40, 41, 42], [1, 50, 51]]


def trainer_with_value_head(seed: int) -> torch.nn.Module:
    """Tiny Qwen3 (seed 0) + value head, every tensor perturbed by ``0.1 * N(0, 1)`` (``seed``)."""
    torch.set_num_threads(1)
    model = attach_value_head(build_tiny_qwen3(99, seed=0))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    assert "value_head.weight" in model.state_dict()
    return model


class SentNames:
    """Records the tensor names every weight-sync request carries, by wrapping the HTTP session.

    The payload is decoded while the request is in flight (the temp dir and the shared-memory
    tensors still exist): safetensors keys (disk), the pickled bucket's metadata (tensor), or the
    ``names`` field (distributed).
    """

    def __init__(self, backend: SGLangBackend) -> None:
        self.names: list[str] = []
        self.paths: list[str] = []
        self.bodies: list[dict] = []
        session = backend.session
        inner = session.request

        def request(method, url, json=None, **kw):
            path = "/" + url.split("/", 3)[3]
            if method == "POST":
                self.paths.append(path)
                self.bodies.append(json)
                self.names += self._decode(path, json)
            return inner(method, url, json=json, **kw)

        session.request = request

    @staticmethod
    def _decode(path: str, body: dict) -> list[str]:
        if path == "/update_weights_from_disk":
            with safe_open(str(Path(body["model_path"]) / "model.safetensors"), "pt") as f:
                return list(f.keys())
        if path == "/update_weights_from_tensor":
            names = []
            for payload in body["serialized_named_tensors"]:
                names += [m.name for m in pickle.loads(base64.b64decode(payload))["metadata"]]
            return names
        if path == "/update_weights_from_distributed":
            return list(body["names"])
        return []


def assert_server_matches(backend: SGLangBackend, model, version: int) -> None:
    """Greedy and T=0.8 log-probs of the server equal the trainer's fp32 log_softmax to 1e-4."""
    for sampling in (
        SamplingParams(max_new_tokens=8, temperature=0.0),
        SamplingParams(max_new_tokens=8, temperature=0.8),
    ):
        out = backend.generate(PROMPTS, n=2, sampling=sampling)
        assert {c.weight_version for c in out} == {str(version)}
        for c in out:
            ref = trainer_log_probs(
                model, PROMPTS[c.prompt_index], c.token_ids, temperature=sampling.temperature or 1.0
            )
            torch.testing.assert_close(torch.tensor(c.log_probs), ref, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------------
# Real server
# ---------------------------------------------------------------------------------------------


@pytest.mark.sglang
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["disk", "tensor", "distributed"])
def test_sync_through_each_sender(sglang_server, mode):
    version = {"disk": 11, "tensor": 21, "distributed": 31}[mode]
    model = trainer_with_value_head(seed=version)
    policy_names = {n for n, _ in named_policy_tensors(model)}
    with SGLangBackend(sglang_server.url, weight_sync=mode, show_progress=False) as backend:
        sent = SentNames(backend)
        # Raw state_dict (value head included): the sender must filter it (defence in depth).
        backend.sync_weights(model.state_dict().items(), version=version)
        assert backend.get(sglang_server.url, "/model_info")["weight_version"] == str(version)
        assert_server_matches(backend, model, version)
        # A second sync through the same sender (the distributed group is reused).
        model2 = trainer_with_value_head(seed=version + 1)
        backend.sync_weights(named_policy_tensors(model2), version=version + 1)
        assert_server_matches(backend, model2, version + 1)
    assert not [n for n in sent.names if n.startswith("value_head.")]
    assert set(sent.names) == policy_names and len(sent.names) == 2 * len(policy_names)
    if mode != "disk":
        assert (
            sent.paths.count("/begin_weight_update") == 2
            and sent.paths.count("/end_weight_update") == 2
        )


@pytest.mark.sglang
@pytest.mark.slow
def test_failed_sync_raises_weight_sync_error(sglang_server):
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
        ):
            backend.sync_weights(bad, version=7)
        assert "/update_weights_from_disk" not in sent.paths
        assert backend.get(sglang_server.url, "/model_info")["weight_version"] != "7"
        backend.sync_weights(named_policy_tensors(model), version=8)  # the server is still usable
        assert_server_matches(backend, model, 8)


# ---------------------------------------------------------------------------------------------
# Fast checks on the double (protocol details the real 0.5.23 server cannot show)
# ---------------------------------------------------------------------------------------------


def _tensor_handlers(double, *, set_version: bool = True, begin_status: int = 404):
    """Older server (404 on begin/end) accepting flattened buckets; records what it received."""

    def update(body):
        metas = pickle.loads(base64.b64decode(body["serialized_named_tensors"][0]))["metadata"]
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


def test_tensor_sender_buckets_versions_and_404_sessions(sglang_double):
    _tensor_handlers(sglang_double)
    model = trainer_with_value_head(seed=1)
    options = {"bucket_bytes": 20_000}
    with SGLangBackend(
        sglang_double.url, weight_sync="tensor", weight_sync_options=options
    ) as backend:
        backend.sync_weights(model.state_dict().items(), version=3)
    bodies = [b for p, b in sglang_double.requests if p == "/update_weights_from_tensor"]
    assert len(bodies) > 1 and sglang_double.weight_version == "3"
    assert ["weight_version" in b for b in bodies] == [False] * (len(bodies) - 1) + [True]
    assert [b["flush_cache"] for b in bodies] == [False] * (len(bodies) - 1) + [True]
    assert all(b["load_format"] == "flattened_bucket" for b in bodies)
    received = [n for bucket in sglang_double.received for n in bucket]
    assert sorted(received) == sorted(n for n, _ in named_policy_tensors(model))


def test_version_mismatch_and_rejection_raise(sglang_double):
    _tensor_handlers(sglang_double, set_version=False)
    model = build_tiny_qwen3(99)
    with SGLangBackend(sglang_double.url, weight_sync="tensor") as backend:
        with pytest.raises(
            WeightSyncError, match=r"reports weight_version='default', expected '4'"
        ):
            backend.sync_weights(named_policy_tensors(model), version=4)
    sglang_double.handlers["/update_weights_from_tensor"] = lambda body: (
        400,
        {"success": False, "message": "Failed to update weights: size mismatch for lm_head.weight"},
    )
    with SGLangBackend(sglang_double.url, weight_sync="tensor") as backend:
        with pytest.raises(
            WeightSyncError,
            match=r"tensor weight sync \(version 5\) failed.*size mismatch for lm_head",
        ):
            backend.sync_weights(named_policy_tensors(model), version=5)


def test_session_error_other_than_404_is_raised(sglang_double):
    _tensor_handlers(sglang_double, begin_status=400)
    with SGLangBackend(sglang_double.url, weight_sync="tensor") as backend:
        with pytest.raises(
            WeightSyncError, match=r"begin_weight_update rejected the request \(HTTP 400\)"
        ):
            backend.sync_weights(named_policy_tensors(build_tiny_qwen3(99)), version=1)


def test_policy_tensors_and_buckets():
    with pytest.raises(WeightSyncError, match="no policy tensors to send"):
        policy_tensors([("value_head.weight", torch.ones(1))])
    items = [
        ("h", torch.ones(3, dtype=torch.float16)),
        ("f", torch.ones(2)),
        ("d", torch.ones(1, dtype=torch.float64)),
    ]
    (bucket,) = bucketize(items, bucket_bytes=1 << 20)
    flat, meta = flatten_bucket(bucket)
    assert [m.name for m in meta] == ["d", "f", "h"]  # widest dtype first: aligned offsets
    assert [(m.start_idx, m.end_idx) for m in meta] == [(0, 8), (8, 16), (16, 22)]
    assert torch.equal(flat[8:16].view(torch.float32), torch.ones(2))


@pytest.mark.sglang
@pytest.mark.slow
def test_disk_dir_outlives_a_client_process_while_the_server_serves_it(sglang_server, tmp_path):
    """A client process that syncs from disk and exits must not delete the dir the shared server
    serves: the next client (this process) reads the served config from it."""
    import subprocess

    code = (
        "from ar_torchrl.backends.sglang import SGLangBackend\n"
        "from ar_torchrl.assets import build_tiny_qwen3\n"
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
        backend.sync_weights(named_policy_tensors(trainer_with_value_head(seed=6)), version=42)
        assert backend.get(sglang_server.url, "/model_info")["weight_version"] == "42"
