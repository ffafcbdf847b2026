"""DistributedWeightSender: a gloo group with the real server; the rendezvous listens on one address."""

from __future__ import annotations

from datetime import timedelta

import pytest
from support.sglang_helpers import (
    SentNames,
    assert_server_matches,
    listening_addresses,
    trainer_with_value_head,
)

from ar_torchrl.backends.sglang import SGLangBackend
from ar_torchrl.backends.sglang.senders.distributed import bound_store, listening_socket
from ar_torchrl.weight_sync import named_policy_tensors


def test_the_rendezvous_store_listens_on_the_given_address_only():
    store = bound_store(listening_socket("127.0.0.1"), 1, timedelta(seconds=10))
    store.set("k", "v")
    assert store.get("k") == b"v"
    assert listening_addresses(store.port) == ["127.0.0.1"]  # not 0.0.0.0 / :: (every interface)


@pytest.mark.sglang
@pytest.mark.slow
def test_distributed_sync_on_the_real_server(sglang_server):
    model = trainer_with_value_head(seed=31)
    policy = {n for n, _ in named_policy_tensors(model)}
    with SGLangBackend(
        sglang_server.url, weight_sync="distributed", show_progress=False
    ) as backend:
        sent = SentNames(backend)
        backend.sync_weights(model.state_dict().items(), version=31)
        assert listening_addresses(backend.sender.store_port) == ["127.0.0.1"]
        assert_server_matches(backend, model, 31)
        model2 = trainer_with_value_head(seed=32)
        backend.sync_weights(named_policy_tensors(model2), version=32)  # the group is reused
        assert_server_matches(backend, model2, 32)  # the same prompts: the cache was flushed
    assert set(sent.names) == policy and len(sent.names) == 2 * len(policy)
    assert not [p for p in sent.paths if p.startswith("/flush_cache")]  # the update flushed
    assert sent.paths.count("/init_weights_update_group") == 1
