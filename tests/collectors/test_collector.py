"""WeightSyncCollector: batch versions, async staleness bound, failed syncs, value head never sent."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
from support.scripted_backend import ScriptedBackend

from ar_torchrl.backends import SamplingParams, TransformersBackend
from ar_torchrl.collectors import WeightSyncCollector, batch_policy_version
from ar_torchrl.data import arithmetic_dataset
from ar_torchrl.envs import LLMEnv
from ar_torchrl.models.tiny import build_char_tokenizer, build_tiny_qwen3
from ar_torchrl.modules import attach_value_head
from ar_torchrl.weight_sync import VALUE_HEAD_PREFIX, TrainsideSender, WeightSyncError

torch.set_num_threads(1)


class FailingSender:
    def send(self, named_tensors, version):
        raise WeightSyncError("boom", partial=False)

    def close(self):
        pass


class RecordingBackend(TransformersBackend):
    """The real TransformersBackend, recording which thread generated and which names were synced."""

    def __init__(self, *args, fail_sync: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.threads: list[str] = []
        self.synced: list[list[str]] = []
        if fail_sync:
            self._sender = FailingSender()  # test only: a sender that refuses every sync

    def _generate(self, prompts, n, sampling):
        self.threads.append(threading.current_thread().name)
        return super()._generate(prompts, n, sampling)

    def sync_weights(self, named_tensors, version):
        items = list(named_tensors)
        self.synced.append([name for name, _ in items])
        super().sync_weights(items, version)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def make(
    tok,
    *,
    mode="sync",
    total_batches=3,
    max_policy_lag=1,
    seed=0,
    wrap=None,
    backend_cls=None,
    max_new_tokens=4,
    **backend_kwargs,
):
    """A collector over an LLMEnv of 2 prompts x 2 samples and the engine ``backend_cls``
    (default :class:`RecordingBackend`; ``model_eos``: the model's EOS id, default 2)."""
    eos = backend_kwargs.pop("model_eos", 2)
    model = attach_value_head(build_tiny_qwen3(len(tok), seed=0, eos_token_id=eos))
    backend = (backend_cls or RecordingBackend)(model, seed=seed, **backend_kwargs)
    env = LLMEnv(
        arithmetic_dataset(16, seed=0),
        tok,
        backend,
        num_samples=2,
        prompts_per_batch=2,
        sampling=SamplingParams(max_new_tokens=max_new_tokens),
    )
    collector = WeightSyncCollector(
        env if wrap is None else wrap(env),
        model,
        total_batches=total_batches,
        mode=mode,
        max_policy_lag=max_policy_lag,
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


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_transformed_env_is_collected_with_its_transforms(tok, mode):
    """main: WeightSyncCollector(TransformedEnv(...)) failed with `TypeError: EnvBase.rollout() got
    an unexpected keyword argument 'token_trajectory'`."""
    from torchrl.envs import RewardScaling, TransformedEnv

    plain, _, _ = make(tok, mode=mode, total_batches=2)
    expected = [b["next", "reward"].sum((1, 2)) for b in plain]
    plain.shutdown()

    def wrap(env):  # exactly as a TorchRL user writes it
        return TransformedEnv(env, RewardScaling(loc=1.0, scale=3.0))

    collector, model, backend = make(tok, mode=mode, total_batches=2, wrap=wrap)
    got = [b["next", "reward"].sum((1, 2)) for b in collector]  # same seeds: the same samples
    collector.shutdown()
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, 1.0 + 3.0 * e)
    assert backend.threads and collector.last_batch_stats["samples"] == 4


def test_sync_mode_versions(tok):
    collector, _, backend = make(tok, mode="sync", total_batches=3)
    assert len(collector) == 3
    versions, lags = run(collector)
    assert versions == [0, 1, 2] and lags == [0, 0, 0]
    assert collector.policy_version == backend.policy_version == 3
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


@pytest.mark.parametrize(("max_policy_lag", "versions", "dropped"), [(1, [0, 2, 4], 2)])
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
            match=r"weight sync to version 1 failed \(boom\); the engine keeps policy_version 0",
        ),
    ):
        collector.update_policy_weights_()
    assert "keeps policy_version 0" in caplog.text
    assert collector.policy_version == backend.policy_version == 0
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


def test_weights_as_a_stream_are_converted_and_versioned(tok):
    """An FSDP rank 0 pushes a stream of gathered tensors, not its (sharded) module."""
    from ar_torchrl.distributed import distributed, shard_actor_critic
    from ar_torchrl.modules import LMActorCritic
    from ar_torchrl.weight_sync import named_policy_tensors

    collector, _, backend = make(tok, mode="sync", total_batches=1)
    backend.model.to(torch.bfloat16)  # a bf16 engine: the fp32 stream is converted on the fly
    new = build_tiny_qwen3(len(tok), seed=7)
    seen = []
    stream = ((seen.append(n) or n, t) for n, t in named_policy_tensors(new))
    collector.update_policy_weights_(stream)
    assert collector.policy_version == backend.policy_version == 1 and len(seen) > 1
    assert torch.equal(backend.model.lm_head.weight, new.lm_head.weight.to(torch.bfloat16))
    collector.resync_policy_weights_(dict(named_policy_tensors(new)))
    assert backend.policy_version == 1
    with pytest.raises(TypeError, match="pass the trainer's nn.Module, .* got int"):
        collector.update_policy_weights_(3)
    with distributed("cpu", process_group=True) as ctx:
        sharded = shard_actor_critic(LMActorCritic(attach_value_head(new)), ctx)
        with pytest.raises(TypeError, match="FSDP-sharded; push it from every rank"):
            collector.update_policy_weights_(sharded.model)
    assert backend.policy_version == 1


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


def scripted(
    tok,
    *,
    wrong=lambda total: total % 2,
    mode="sync",
    rounds=4,
    prompts=4,
    dynamic=True,
    total=2,
    critic_flat_groups=False,
):
    def answer(a, b, j):  # sample j is off by j * wrong(a + b): groups with wrong() == 0 agree
        return a + b + j * wrong(a + b)

    backend = ScriptedBackend(tok, answer, sender=TrainsideSender(torch.nn.Linear(1, 1), "share"))
    env = LLMEnv(
        arithmetic_dataset(64, seed=0),
        tok,
        backend,
        num_samples=2,
        prompts_per_batch=prompts,
        sampling=SamplingParams(max_new_tokens=12),
        seed=0,
    )
    model = torch.nn.Linear(1, 1)
    return WeightSyncCollector(
        env,
        model,
        total_batches=total,
        mode=mode,
        dynamic_sampling=dynamic,
        max_sampling_rounds=rounds,
        critic_flat_groups=critic_flat_groups,
    )


def seq_rewards(batch):
    return batch["next", "reward"].sum((1, 2)).view(-1, 2)


def test_dynamic_sampling_refills_with_groups_that_have_a_spread(tok):
    plain = scripted(tok, dynamic=False, total=1)
    (first,) = list(plain)
    first_stats = plain.last_batch_stats
    # even sums: both samples right (zero spread); odd sums: one right, one wrong
    zero = int((seq_rewards(first)[:, 0] == seq_rewards(first)[:, 1]).sum())
    assert (
        0 < zero < 4
        and first_stats["groups_kept"] == 4
        and first_stats["groups_zero_spread"] == zero
    )
    collector = scripted(tok, dynamic=True, total=1)
    (batch,) = list(collector)
    stats = collector.last_batch_stats
    rewards = seq_rewards(batch)
    assert rewards.shape == (4, 2) and (rewards[:, 0] != rewards[:, 1]).all()  # only spread groups
    assert stats["groups_kept"] == 4 and stats["sampling_rounds"] >= 2
    assert stats["groups_generated"] == 4 * stats["sampling_rounds"]
    assert stats["groups_dropped"] == stats["groups_generated"] - 4 >= stats["groups_zero_spread"]
    # the logged reward and accuracy are over EVERY generated sample, not the kept ones
    assert stats["samples"] == 2 * stats["groups_generated"]
    assert stats["reward_mean"] > float(
        rewards.mean()
    )  # all-right groups were generated, then dropped
    assert first_stats["reward_mean"] == float(seq_rewards(first).mean())


def test_zero_spread_groups_can_stay_for_the_critic_only(tok):
    plain = scripted(tok, total=1)
    (policy_only,) = list(plain)
    collector = scripted(tok, total=1, critic_flat_groups=True)
    (batch,) = list(collector)
    stats = collector.last_batch_stats
    rows = batch["policy_mask"].any(-1)
    assert torch.equal(batch["policy_mask"], batch["loss_mask"] & rows.unsqueeze(-1))
    rewards = seq_rewards(batch)
    policy_groups, critic_groups = rewards[rows.view(-1, 2)[:, 0]], rewards[~rows.view(-1, 2)[:, 0]]
    assert (policy_groups[:, 0] != policy_groups[:, 1]).all()  # the policy's: spread groups
    assert (critic_groups[:, 0] == critic_groups[:, 1]).all() and len(critic_groups) > 0
    assert stats["groups_critic_only"] == len(critic_groups) == stats["groups_zero_spread"]
    assert (
        stats["groups_kept"] == 4
        and stats["groups_dropped"] == plain.last_batch_stats["groups_dropped"]
    )
    # the policy's rows are exactly the batch the plain collector gives (same draws)
    torch.testing.assert_close(batch[:8]["tokens"], policy_only["tokens"][:, : batch.shape[1]])
    with pytest.raises(ValueError, match="critic_flat_groups=True keeps the groups dynamic"):
        scripted(tok, dynamic=False, critic_flat_groups=True)


def test_dynamic_sampling_gives_up_after_max_rounds(tok, caplog):
    collector = scripted(tok, wrong=lambda total: 0, rounds=3, total=1)  # every answer right
    with caplog.at_level(logging.WARNING):
        (batch,) = list(collector)
    stats = collector.last_batch_stats
    assert batch.shape[0] == 0 and batch.batch_dims == 2  # nothing to train on: skip the update
    assert (
        stats["groups_kept"] == 0
        and stats["sampling_rounds"] == 3
        and stats["groups_generated"] == 12
    )
    assert stats["reward_mean"] == 1.0 and stats["accuracy"] == 1.0
    assert "only 0 of 4 groups have a reward spread after 3 rounds" in caplog.text


def test_dynamic_sampling_in_async_mode_keeps_one_version_per_batch(tok):
    collector = scripted(tok, mode="async", total=3)
    versions, kept = [], []
    for batch in collector:
        versions.append(batch_policy_version(batch))
        kept.append(collector.last_batch_stats["groups_kept"])
        collector.update_policy_weights_()
    collector.shutdown()
    assert versions == [0, 0, 1] and kept == [4, 4, 4]


def test_resume_pushes_the_restored_weights_under_the_restored_version(tok):
    collector, model, _ = make(tok, mode="sync", total_batches=2)
    list(collector_with_updates(collector))
    state = collector.state_dict()
    assert state["policy_version"] == 2
    fresh, _, backend = make(tok, mode="sync", total_batches=1)
    fresh.load_state_dict(state)
    fresh.resync_policy_weights_()  # what the recipe calls after loading a checkpoint
    assert backend.policy_version == fresh.policy_version == 2 and len(backend.synced) == 1
    (batch,) = list(fresh)
    assert batch_policy_version(batch) == 2 and len(backend.synced) == 1  # pushed once


def collector_with_updates(collector):
    for batch in collector:
        collector.update_policy_weights_()
        yield batch


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
    torch.save(
        {"collector": collector.state_dict(include_pending=True), "model": model.state_dict()},
        tmp_path / "ckpt.pt",
    )
    straight = [next(it), collector.last_policy_lag, collector.last_batch_stats]
    _train_step(collector, model)
    straight += [next(it), collector.last_policy_lag, collector.last_batch_stats]
    collector.shutdown()

    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)  # plain tensors and containers
    fresh, fresh_model, _ = make(tok, mode="async", total_batches=2, seed=99)
    fresh_model.load_state_dict(state["model"])
    fresh.load_state_dict(state["collector"])
    fresh.resync_policy_weights_()  # the backend still holds the starting weights
    it = iter(fresh)
    resumed = [next(it), fresh.last_policy_lag, fresh.last_batch_stats]
    _train_step(fresh, fresh_model)
    resumed += [next(it), fresh.last_policy_lag, fresh.last_batch_stats]
    fresh.shutdown()
    assert straight[1::3] == resumed[1::3] == [1, 1]
    assert straight[2::3] == resumed[2::3]  # the stats travel with the saved batch
    for a, b in zip(straight[::3], resumed[::3]):
        assert batch_policy_version(a) == batch_policy_version(b)
        assert (a == b).all(), "the resumed batch differs"


# ----------------------------------------------------------------------------- bounded staleness
class SlowTrainer:
    """Stands in for a trainer slower than generation: each update takes ``seconds``."""

    def __init__(self, collector, model, seconds: float):
        self.collector, self.model, self.seconds = collector, model, seconds

    def step(self):
        threading.Event().wait(self.seconds)
        _train_step(self.collector, self.model)


@pytest.mark.parametrize("k", [2, 3])
def test_bounded_staleness_admits_batches_while_their_lag_stays_within_k(tok, k):
    """A fast generator tries to run ahead of a slow trainer: admission control keeps it at most
    k batches ahead (the batch held plus those waiting), every lag is <= k, nothing is dropped,
    and in steady state the lag is exactly k."""
    collector, model, backend = make(tok, mode="async", total_batches=7, max_policy_lag=k)
    assert collector.pipelined
    trainer, ahead, lags = SlowTrainer(collector, model, 0.3), [], []
    for _batch in collector:
        lags.append(collector.last_policy_lag)
        trainer.step()
        with collector._ahead.cv:
            ahead.append(int(collector._ahead.held) + len(collector._ahead.queue))
    collector.shutdown()
    assert max(ahead) <= k and max(lags) <= k and lags[-1] == k
    assert lags[: k + 1] == list(range(k + 1))  # the first batches: 0, 1, .., k behind
    assert collector.stale_batches_dropped == 0 and sum(collector.lag_histogram.values()) == 7
    assert all(name == "rollout-ahead" for name in backend.threads)


def test_bounded_staleness_refuses_a_second_sync_for_one_batch(tok):
    collector, model, _ = make(tok, mode="async", total_batches=3, max_policy_lag=2)
    it = iter(collector)
    next(it)
    _train_step(collector, model)
    with pytest.raises(
        RuntimeError, match=r"a second weight update for the same batch; with max_policy_lag=2"
    ):
        _train_step(collector, model)
    collector.resync_policy_weights_()  # the same version again is not an update: allowed
    next(it)
    _train_step(collector, model)
    collector.shutdown()


def test_bounded_staleness_checkpoint_keeps_the_waiting_batches(tok):
    """state_dict(include_pending=True) first lets the generator generate every batch admission
    allows, then stores them: after one sync at k=2 always 3 (batches 2-4), whatever the timing; a
    collector restored from it hands them out first, unchanged, then generates on."""
    collector, model, _ = make(tok, mode="async", total_batches=5, max_policy_lag=2, seed=3)
    trainer = SlowTrainer(collector, model, 0.05)
    it = iter(collector)
    next(it)
    trainer.step()
    state = collector.state_dict(include_pending=True)
    waiting = [_restored_batch(x) for x in state["pending_batches"]]
    assert [batch_policy_version(b) for b in waiting] == [0, 0, 1]
    collector.shutdown()
    fresh, _, _ = make(tok, mode="async", total_batches=4, max_policy_lag=2, seed=3)
    fresh.load_state_dict(state)
    got = [b["tokens"].clone() for b in fresh]
    fresh.shutdown()
    assert len(got) == 4 and all(torch.equal(a["tokens"], b) for a, b in zip(waiting, got))


def _restored_batch(saved):
    from tensordict import TensorDict

    return TensorDict(saved["data"], saved["batch_size"])


def test_bounded_staleness_versions_do_not_depend_on_the_trainer_speed(tok):
    """A sync waits until the generator has generated every batch admission allows: the n-th
    batch is always sampled by version max(0, n - 1 - k), whether the trainer is slower than the
    generator or instant (main: an instant trainer's syncs overtook the batches admitted before
    them, which were then sampled by newer weights)."""
    runs = []
    for seconds in (0.0, 0.05):
        collector, model, _ = make(tok, mode="async", total_batches=6, max_policy_lag=2, seed=7)
        trainer, batches = SlowTrainer(collector, model, seconds), []
        for batch in collector:
            batches.append((batch.clone(), collector.last_policy_lag))
            trainer.step()
        collector.shutdown()
        runs.append(batches)
    for batches in runs:
        assert [batch_policy_version(b) for b, _ in batches] == [0, 0, 0, 1, 2, 3]
        assert [lag for _, lag in batches] == [0, 1, 2, 2, 2, 2]
    assert all((a == b).all() for (a, _), (b, _) in zip(*runs))


class HoldingBackend(TransformersBackend):
    """The real trainside backend; at its ``hold_at``-th forward it signals ``reached`` and waits
    until a weight sync interrupts it or the test sets ``release`` (a test double of the timing:
    the generation is deterministically in flight at that moment)."""

    def __init__(self, *args, hold_at: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.hold_at, self.forwards = hold_at, 0
        self.reached, self.release = threading.Event(), threading.Event()

    def _forward(self, ids, mask, positions, cache, *args, **kwargs):
        self.forwards += 1
        if self.forwards == self.hold_at:
            self.reached.set()
            deadline = time.monotonic() + 120
            while not (self.interrupted or self.release.is_set()):
                assert time.monotonic() < deadline, "the held generation was never let go"
                threading.Event().wait(0.001)
        return super()._forward(ids, mask, positions, cache, *args, **kwargs)


#: 8 tokens per response, never EOS: every generation is 8 forwards (a prefill and 7 decodes)
TOKENS = 8


def _partial(tok, k, total, backend_cls, seed, **kwargs):
    collector, model, backend = make(
        tok,
        mode="async",
        total_batches=total,
        max_policy_lag=k,
        backend_cls=backend_cls,
        model_eos=len(tok) + 5,
        max_new_tokens=TOKENS,
        seed=seed,
        **kwargs,
    )
    backend.partial_rollouts = True
    return collector, model, backend


def _settle(collector):
    """Wait until the generator has generated what it may (it keeps up with the trainer)."""
    ahead = collector._ahead
    with ahead.cv:
        ahead.cv.wait_for(ahead._settled)


def _finish(collector, model, it, held=None):
    """The rest of a run: each batch (what the recipe logs of it), an update, a sync. ``held``: the
    backend holding the first batch generated after a restore; the second sync must wait for it."""
    out = []
    for i, batch in enumerate(it):
        backend = collector.env.backend
        out.append((batch, collector.last_policy_lag, collector.last_batch_stats))
        out[-1] += (collector.last_token_lags, backend.interruptions, backend.policy_version)
        if held is not None and i == 1:
            _sync_waits_for_the_held_batch(collector, model, held)
        else:
            _settle(collector)
            _train_step(collector, model)
    collector.shutdown()
    return out


def _sync_waits_for_the_held_batch(collector, model, backend):
    assert backend.reached.wait(60)
    cuts = backend.interruptions
    syncing = threading.Thread(target=_train_step, args=(collector, model))
    syncing.start()
    syncing.join(0.3)
    assert syncing.is_alive() and backend.interruptions == cuts  # it waits, it does not cut
    backend.release.set()
    syncing.join(60)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("moment", ["settled", "mid_generation", "interrupted"])
def test_partial_rollouts_resume_exactly_at_any_lag(tmp_path, tok, k, moment):
    """max_policy_lag=k with partial rollouts, checkpointed after the first sync (the generator
    settled, or generating the first batch after the pipeline's fill) or right after a second
    sync that interrupted that batch mid-response: a collector restored on another backend
    (another seed) hands out exactly what the uninterrupted one does from there on: batches
    (tokens, per-token versions and log-probs), stats, lags, interruption count (main: the count
    restarted at 0, and a sync cut the restored run's first, slower, generation, see N10)."""
    first_fresh = k + 2  # batches 1..k+1 fill the pipeline with version 0; this one starts at 1
    hold_at = (first_fresh - 1) * TOKENS + 3 if moment != "settled" else 0
    collector, model, backend = _partial(tok, k, k + 5, HoldingBackend, 5, hold_at=hold_at)
    it = iter(collector)
    handed = [next(it)]
    _train_step(collector, model)  # version 1: the first fresh batch starts
    if moment == "interrupted":
        handed.append(next(it))
        assert backend.reached.wait(60)
        _train_step(collector, model)  # version 2 interrupts it after 3 of its 8 tokens
    if moment == "mid_generation":
        assert backend.reached.wait(60)
        box: list = []
        saving = threading.Thread(
            target=lambda: box.append(collector.state_dict(include_pending=True))
        )
        saving.start()
        saving.join(0.3)
        assert saving.is_alive() and not box  # it waits for the batch being generated
        backend.release.set()
        saving.join(60)
        state = box[0]
    else:
        state = collector.state_dict(include_pending=True)
    torch.save({"collector": state, "model": model.state_dict()}, tmp_path / "ckpt.pt")
    pending = [_restored_batch(p) for p in state["pending_batches"]]
    assert len(pending) == k + 1  # every batch admitted, whatever the timing
    if moment == "interrupted":
        cut = pending[first_fresh - 3]
        assert set(cut["policy_version"][cut["loss_mask"]].tolist()) == {1, 2}
        assert state["interruptions"] == backend.interruptions == 1
    straight = _finish(collector, model, it)

    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    # the first batch the restored collector generates is held mid-response (a cold process is
    # slow): the sync that follows waits for it, as the uninterrupted run's generator was done
    fresh, fresh_model, held = _partial(tok, k, k + 5 - len(handed), HoldingBackend, 99, hold_at=3)
    fresh_model.load_state_dict(saved["model"])
    fresh.load_state_dict(saved["collector"])
    fresh.resync_policy_weights_()
    resumed = _finish(fresh, fresh_model, iter(fresh), held=held)
    assert len(straight) == len(resumed) == k + 5 - len(handed)
    for a, b in zip(straight, resumed):
        assert (a[0] == b[0]).all(), "a resumed batch differs"
        assert a[1:] == b[1:]  # lag, stats, token lags, interruptions, version
    assert straight[-1][4] == (1 if moment == "interrupted" else 0)  # no cut but the test's


def test_partial_rollouts_wait_until_the_pipeline_is_primed(tok):
    """Until the generator has filled its window once, a sync waits for the batch in flight
    instead of cutting it (start-up speed must not decide where a batch is cut); after that it
    interrupts: the batch's rows carry both versions, token by token."""
    # batches 1-2 fill the pipeline (k=1): the sync after batch 1 waits for batch 2, held at its
    # 4th forward; batch 3 (started by that sync) is held at its 4th and cut by the next sync
    collector, model, backend = _partial(tok, 1, 4, HoldingBackend, 0, hold_at=TOKENS + 4)
    assert collector.pipelined
    it = iter(collector)
    first = next(it)
    assert set(first["policy_version"][first["loss_mask"]].tolist()) == {0}
    assert backend.reached.wait(60)
    syncing = threading.Thread(target=_train_step, args=(collector, model))
    syncing.start()
    syncing.join(0.3)
    assert syncing.is_alive() and backend.policy_version == 0  # it waits for batch 2
    backend.release.set()
    syncing.join(60)
    second = next(it)
    assert set(second["policy_version"][second["loss_mask"]].tolist()) == {0}
    backend.hold_at, backend.release = 2 * TOKENS + 4, threading.Event()
    backend.reached.clear()
    assert backend.reached.wait(60)
    _train_step(collector, model)  # interrupts batch 3
    third = next(it)
    versions = third["policy_version"][third["loss_mask"]]
    assert set(versions.tolist()) == {1, 2} and backend.interruptions == 1
    assert collector.last_policy_lag == 1 and collector.last_token_lags[1] > 0
    assert sum(collector.last_token_lags.values()) == int(third["loss_mask"].sum())
    for row in range(third.shape[0]):  # within a row: the old version first, then the new
        v = third["policy_version"][row][third["loss_mask"][row]].tolist()
        assert v == sorted(v) and v[0] == 1 and v[-1] == 2
    _train_step(collector, model)
    next(it)
    collector.shutdown()


def test_shutdown_keeps_restored_batches_it_did_not_hand_out(tok):
    """A restored collector shut down before handing out its restored batches still saves them
    (main: shutdown rewound the env to before the first batch it generated and dropped them)."""
    collector, model, _ = make(tok, mode="async", total_batches=6, max_policy_lag=2, seed=3)
    it = iter(collector)
    next(it)
    _train_step(collector, model)
    state = collector.state_dict(include_pending=True)
    collector.shutdown()
    fresh, fresh_model, _ = make(tok, mode="async", total_batches=5, max_policy_lag=2, seed=3)
    fresh.load_state_dict(state)
    it = iter(fresh)
    next(it)  # one of the 3 restored batches handed out
    _train_step(fresh, fresh_model)
    _settle(fresh)  # a new batch was generated after the 2 restored ones waiting
    assert len(fresh._ahead.queue) == 3
    fresh.shutdown()
    again = fresh.state_dict(include_pending=True)
    kept = [_restored_batch(p)["tokens"] for p in again["pending_batches"]]
    want = [_restored_batch(p)["tokens"] for p in state["pending_batches"][1:]]
    assert len(kept) == 2 and all(torch.equal(a, b) for a, b in zip(kept, want))
    assert again["env"]["sampler"] == state["env"]["sampler"]  # rewound to after the restored


def test_a_checkpoint_resumes_under_another_staleness_bound(tok):
    """A one-step-async state (its prefetched batch) restored into a bounded-staleness collector
    hands that batch out first (main: the generator ignored it, the batch was lost); a state with
    several batches ahead cannot be restored into a collector that holds at most one."""
    collector, model, _ = make(tok, mode="async", total_batches=3, seed=2)
    it = iter(collector)
    next(it)
    _train_step(collector, model)
    state = collector.state_dict(include_pending=True)
    saved = _restored_batch(state["pending_batch"])
    collector.shutdown()
    ahead, _, _ = make(tok, mode="async", total_batches=2, max_policy_lag=2, seed=2)
    ahead.load_state_dict(state)
    assert ahead.pipelined and torch.equal(next(iter(ahead))["tokens"], saved["tokens"])
    ahead.shutdown()
    three = ahead.state_dict(include_pending=True)  # 0 left: nothing more was generated
    three["pending_batches"] = [state["pending_batch"]] * 3
    one, _, _ = make(tok, mode="async", total_batches=2, seed=2)
    with pytest.raises(ValueError, match=r"holds 3 batches generated ahead .* max_policy_lag=1"):
        one.load_state_dict(three)
