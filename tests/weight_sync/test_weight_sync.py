"""weight_sync base, names and registry: lazy buckets, the value head never sent, one registry."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from ar_torchrl.models.tiny import build_tiny_qwen3
from ar_torchrl.modules import attach_value_head
from ar_torchrl.weight_sync import (
    SYNC_METHODS,
    WeightSender,
    WeightSyncError,
    iter_buckets,
    make_sender,
    named_policy_tensors,
    policy_only,
    sync_methods,
)
from ar_torchrl.weight_sync.base import with_last
from ar_torchrl.weight_sync.registry import register_sync_method

PACKAGE = Path(__file__).resolve().parents[2] / "ar_torchrl"


def test_policy_only_and_named_policy_tensors_never_yield_the_value_head():
    model = attach_value_head(build_tiny_qwen3(99))
    assert any(n.startswith("value_head.") for n in model.state_dict())
    names = [n for n, _ in policy_only(model.state_dict().items())]
    assert names == [n for n, _ in named_policy_tensors(model)]
    assert not any(n.startswith("value_head.") for n in names)


def test_named_policy_tensors_converts_floating_tensors_to_the_engine_dtype():
    model = build_tiny_qwen3(99)
    model.register_buffer("step", torch.tensor([3]), persistent=True)
    converted = dict(named_policy_tensors(model, dtype=torch.bfloat16))
    assert converted["step"].dtype == torch.int64  # integer buffers are left alone
    floats = [t for n, t in converted.items() if n != "step"]
    assert floats and all(t.dtype == torch.bfloat16 for t in floats)
    torch.testing.assert_close(
        converted["lm_head.weight"].float(), model.lm_head.weight, atol=1e-2, rtol=1e-2
    )


def test_iter_buckets_pulls_the_stream_lazily_and_aligns_dtypes():
    pulled = []

    def stream():
        for i in range(6):
            pulled.append(i)
            yield f"t{i}", torch.zeros(4, dtype=torch.float16 if i % 2 else torch.float32)

    buckets = iter_buckets(stream(), bucket_bytes=24)  # 16-byte fp32 + 8-byte fp16 per bucket
    first = next(buckets)
    assert [n for n, _ in first] == ["t0", "t1"] and pulled == [0, 1, 2]  # one tensor of look-ahead
    rest = list(buckets)
    assert [[n for n, _ in b] for b in rest] == [["t2", "t3"], ["t4", "t5"]]
    mixed = next(
        iter_buckets(
            [("h", torch.zeros(3, dtype=torch.float16)), ("d", torch.zeros(1, dtype=torch.float64))]
        )
    )
    assert [n for n, _ in mixed] == ["d", "h"]  # widest dtype first: aligned offsets


def test_iter_buckets_refuses_an_empty_stream():
    with pytest.raises(WeightSyncError, match="no policy tensors to send"):
        list(iter_buckets([("value_head.weight", torch.ones(1))]))
    assert list(with_last([])) == [] and list(with_last([1, 2])) == [(1, False), (2, True)]


def test_registry_builds_every_method_and_rejects_the_wrong_engine():
    assert sync_methods("trainside") == ["copy", "share"]
    assert sync_methods("sglang") == ["disk", "tensor", "distributed"]
    rollout = build_tiny_qwen3(99)
    for method in SYNC_METHODS.entries():
        target = rollout if method.engine in ("trainside", "torchrl") else None
        sender = make_sender(method.name, target, engine=method.engine)
        assert isinstance(sender, WeightSender), method.name
        sender.close()
    with pytest.raises(
        ValueError, match=r"'ftp' is unknown; choose one of \['disk', 'tensor', 'distributed'\]"
    ):
        make_sender("ftp", None, engine="sglang")
    with pytest.raises(
        ValueError, match=r"'disk' does not serve trainside; choose one of \['copy', 'share'\]"
    ):
        make_sender("disk", rollout, engine="trainside")


def test_a_new_method_is_one_registry_entry(monkeypatch):
    """Registering a method (with its options' schema) is all it takes for a backend to use it by
    name, its options checked against the schema."""
    from ar_torchrl.backends.sglang import SGLangBackend

    class Recorder:
        def __init__(self, client, *, tag):
            self.client, self.tag, self.sent = client, tag, []

        def send(self, named_tensors, version):
            self.sent += [(n, version) for n, _ in policy_only(named_tensors)]

        def close(self):
            pass

    @dataclasses.dataclass
    class RecordOptions:
        tag: str = ""

    monkeypatch.setattr(SYNC_METHODS, "_entries", dict(SYNC_METHODS._entries))
    register_sync_method("record", engine="sglang", config=RecordOptions, help="records")(
        lambda options, *, target: Recorder(target, tag=options.tag)
    )
    with pytest.raises(ValueError, match=r"'record' has no option 'tga' \(did you mean 'tag'\?\)"):
        SGLangBackend("http://127.0.0.1:9", weight_sync="record", weight_sync_options={"tga": "x"})
    backend = SGLangBackend(
        "http://127.0.0.1:9", weight_sync="record", weight_sync_options={"tag": "x"}
    )
    backend.sync_weights([("a", torch.ones(1)), ("value_head.bias", torch.ones(1))], version=2)
    assert backend.sender.sent == [("a", 2)] and backend.policy_version == 2
    backend.close()


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_senders_never_import_their_engines():
    """Senders live with their engine but are given a client (or rollout model): they never import
    the engine's class, and the protocol package imports no engine at all."""
    engines = ("ar_torchrl.backends.sglang.client", "ar_torchrl.backends.transformers.backend")
    senders = [
        *(PACKAGE / "backends" / "sglang" / "senders").glob("*.py"),
        PACKAGE / "backends" / "transformers" / "sender.py",
    ]
    offenders = {p.name: sorted(set(_imports(p)) & set(engines)) for p in senders}
    assert not any(offenders.values()), offenders
    protocol = {
        p.name: sorted(m for m in _imports(p) if m.startswith("ar_torchrl.backends"))
        for p in (PACKAGE / "weight_sync").glob("*.py")
    }
    assert not any(protocol.values()), protocol
