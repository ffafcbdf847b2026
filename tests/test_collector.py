"""WeightSyncCollector: batch versions, async staleness bound, failed syncs, value head never sent."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from ar_torchrl.assets import build_char_tokenizer, build_tiny_qwen3
from ar_torchrl.backends import SamplingParams, TransformersBackend
from ar_torchrl.collectors import WeightSyncCollector, batch_policy_version
from ar_torchrl.data import arithmetic_dataset
from ar_torchrl.envs import LLMEnv
from ar_torchrl.modules import attach_value_head
from ar_torchrl.weight_sync import VALUE_HEAD_PREFIX, WeightSyncError, named_policy_tensors

torch.set_num_threads(1)


class RecordingBackend(TransformersBackend):
    """The real TransformersBackend, recording which thread generated and which names were synced."""

    def __init__(self, *args, fail_sync: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.threads: list[str] = []
        self.synced: list[list[str]] = []
        self.fail_sync = fail_sync

    def generate(self, prompt_token_ids, n, sampling):
        self.threads.append(threading.current_thread().name)
        return super().generate(prompt_token_ids, n, sampling)

    def sync_weights(self, named_tensors, version):
        if self.fail_sync:
            raise RuntimeError("boom")
        items = list(named_tensors)
        self.synced.append([name for name, _ in items])
        super().sync_weights(items, version)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def make(tok, *, mode="sync", total_batches=3, max_policy_lag=1, seed=0, **backend_kwargs):
    model = attach_value_head(build_tiny_qwen3(len(tok), seed=0))
    backend = RecordingBackend(model, seed=seed, **backend_kwargs)
    env = LLMEnv(
        arithmetic_dataset(16, seed=0), tok, backend, num_samples=2, prompts_per_batch=2,
        sampling=SamplingParams(max_new_tokens=4),
    )  # fmt: skip
    collector = WeightSyncCollector(
        env, model, total_batches=total_batches, mode=mode, max_policy_lag=max_policy_lag
    )
    return collector, model, backend


def run(collector, updates_per_batch=1):
    versions, lags = [], []
    for batch in collector:
        versions.append(batch_policy_version(batch))
        lags.append(collector.last_policy_lag)
        for _ in range(updates_per_batch):
            collector.update_policy_weights_()
    collector.shutdown()
    return versions, lags


def test_sync_mode_versions(tok):
    collector, _, backend = make(tok, mode="sync", total_batches=3)
    assert len(collector) == 3
    versions, lags = run(collector)
    assert versions == [0, 1, 2] and lags == [0, 0, 0]
    assert collector.policy_version == collector.env.policy_version == backend.policy_version == 3
    assert backend.threads == ["MainThread"] * 3


def test_async_mode_generates_in_the_background_one_step_stale(tok):
    collector, _, backend = make(tok, mode="async", total_batches=4)
    versions, lags = run(collector)
    assert versions == [0, 0, 1, 2] and lags == [0, 1, 1, 1]
    assert backend.threads[0] == "MainThread"
    assert (
        all(name.startswith("rollout") for name in backend.threads[1:])
        and len(backend.threads) == 4
    )
    assert collector.stale_batches_dropped == 0


@pytest.mark.parametrize(
    ("max_policy_lag", "versions", "dropped"), [(1, [0, 2, 4], 2), (2, [0, 0, 2], 0)]
)
def test_async_staleness_bound(tok, caplog, max_policy_lag, versions, dropped):
    collector, _, _ = make(tok, mode="async", total_batches=3, max_policy_lag=max_policy_lag)
    with caplog.at_level(logging.WARNING):
        got, lags = run(collector, updates_per_batch=2)  # two syncs per batch: prefetch is 2 behind
    assert got == versions and max(lags) <= max_policy_lag
    assert collector.stale_batches_dropped == dropped
    assert sum("dropped a prefetched batch" in r.message for r in caplog.records) == dropped


def test_failed_sync_keeps_the_version_and_says_so(tok, caplog):
    collector, _, backend = make(tok, mode="sync", total_batches=2, fail_sync=True)
    it = iter(collector)
    assert batch_policy_version(next(it)) == 0
    with (
        caplog.at_level(logging.ERROR),
        pytest.raises(
            WeightSyncError,
            match=r"weight sync to version 1 failed \(RuntimeError: boom\); the collector's policy_version stays 0",
        ),
    ):
        collector.update_policy_weights_()
    assert "policy_version stays 0" in caplog.text
    assert collector.policy_version == collector.env.policy_version == backend.policy_version == 0
    assert batch_policy_version(next(it)) == 0  # rollouts continue with the previous weights
    collector.shutdown()


def test_rejected_weights_keep_the_version(tok):
    collector, _, backend = make(tok, mode="sync", total_batches=1)
    wrong = build_tiny_qwen3(len(tok), hidden_size=32)
    with pytest.raises(
        WeightSyncError, match=r"shape of 'model.embed_tokens.weight' is \(99, 32\)"
    ):
        collector.update_policy_weights_(wrong)
    assert collector.policy_version == backend.policy_version == 0


def test_value_head_never_reaches_the_backend_and_weights_are_copied(tok):
    collector, model, backend = make(tok, mode="sync", total_batches=1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    collector.update_policy_weights_()
    (names,) = backend.synced
    expected = {n for n in model.state_dict() if not n.startswith(VALUE_HEAD_PREFIX)}
    assert set(names) == expected and not any(n.startswith(VALUE_HEAD_PREFIX) for n in names)
    assert any(n.startswith(VALUE_HEAD_PREFIX) for n in model.state_dict())
    rollout_state = backend.model.state_dict()
    for name in expected:
        assert torch.equal(rollout_state[name], model.state_dict()[name])


def test_state_dict_resumes_before_the_prefetched_batch(tok):
    collector, _, _ = make(tok, mode="async", total_batches=3, seed=4)
    it = iter(collector)
    next(it)
    state = collector.state_dict()  # a prefetched batch is in flight: state is from before it
    expected = next(it)
    collector.shutdown()
    assert state["batches_yielded"] == 1
    fresh, _, _ = make(tok, mode="async", total_batches=2, seed=99)  # the 2 batches left
    fresh.load_state_dict(state)
    resumed = list(fresh)
    assert len(resumed) == 2 and fresh.batches_yielded == 3
    assert torch.equal(resumed[0]["tokens"], expected["tokens"])


def _train_step(collector, model):
    """Stands in for a PPO update: new weights, then the sync."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05)
    collector.update_policy_weights_()


def test_async_state_with_the_pending_batch_resumes_exactly(tmp_path, tok):
    """include_pending: the batch in flight (sampled by the weights before the update) is saved,
    so a resumed async run hands out the same batch with the same lag (1), not a regenerated one."""
    collector, model, _ = make(tok, mode="async", total_batches=3, seed=4)
    it = iter(collector)
    next(it)
    _train_step(collector, model)
    torch.save({"collector": collector.state_dict(include_pending=True),
                "model": model.state_dict()}, tmp_path / "ckpt.pt")  # fmt: skip
    straight = [next(it), collector.last_policy_lag]
    _train_step(collector, model)
    straight += [next(it), collector.last_policy_lag]
    collector.shutdown()

    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)  # plain tensors and containers
    fresh, fresh_model, _ = make(tok, mode="async", total_batches=2, seed=99)
    fresh_model.load_state_dict(state["model"])
    fresh.load_state_dict(state["collector"])
    fresh.env.backend.sync_weights(named_policy_tensors(fresh_model), version=fresh.policy_version)
    it = iter(fresh)
    resumed = [next(it), fresh.last_policy_lag]
    _train_step(fresh, fresh_model)
    resumed += [next(it), fresh.last_policy_lag]
    fresh.shutdown()
    assert straight[1::2] == resumed[1::2] == [1, 1]
    for a, b in zip(straight[::2], resumed[::2]):
        assert batch_policy_version(a) == batch_policy_version(b)
        assert (a == b).all(), "the resumed batch differs"


def test_shutdown_rewinds_an_unconsumed_prefetch(tok):
    collector, _, _ = make(tok, mode="async", total_batches=3)
    it = iter(collector)
    next(it)
    before = collector.state_dict()["env"]["sampler"]
    collector.shutdown()
    assert collector.env.state_dict()["sampler"] == before


def test_bad_arguments(tok):
    collector, model, _ = make(tok)
    env = collector.env
    with pytest.raises(ValueError, match="max_policy_lag must be >= 1 \\(got 0\\)"):
        WeightSyncCollector(env, model, mode="async", max_policy_lag=0)
    with pytest.raises(ValueError, match="mode must be 'sync' or 'async', got 'lazy'"):
        WeightSyncCollector(env, model, mode="lazy")
    env.backend = TransformersBackend(model, mode="share")
    with pytest.raises(ValueError, match="mode='share'"):
        WeightSyncCollector(env, model, mode="async")
