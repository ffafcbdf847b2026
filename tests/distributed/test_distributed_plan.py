"""shard_plan / ShardedPlan and ppo_update on a ShardedPlan, in one process (no collectives)."""

from __future__ import annotations

import copy

import pytest
import torch
from support.dist_workers import actor_critic, batch, ppo_loss, prepare
from support.threaded_ranks import ThreadedRanks
from support.trajectories import make_trajectory, perturb

from ar_torchrl.distributed import ShardedPlan, shard_plan
from ar_torchrl.training import MicroBatch, plan_micro_batches, ppo_update

torch.set_num_threads(1)


def _shards(td, budget, world_size):
    plan = plan_micro_batches(td, budget)
    return [shard_plan(plan, td, rank=r, world_size=world_size) for r in range(world_size)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("budget", [12, 20, 40])
def test_every_micro_batch_has_one_owner_and_ranks_run_equal_passes(world_size, budget):
    td = make_trajectory([3, 1, 4, 2, 5, 1, 3, 2, 4], [5, 2, 7, 1, 3, 6, 4, 8, 2], seed=1)
    shards = _shards(td, budget, world_size)
    plan = shards[0].plan
    assert sorted(r for mb in plan.micro_batches for r in mb.rows) == list(range(9))
    loads = shards[0].rank_tokens()
    assert max(loads) - min(loads) <= max(mb.num_tokens for mb in plan.micro_batches)
    assert len({len(s.local_plan) for s in shards}) == 1  # the anchor pass: same forwards
    for s in shards:
        real = [mb for mb in s.local_plan.micro_batches if not mb.padding]
        assert tuple(real) == s.owned()
        for mb in s.local_plan.micro_batches[len(real) :]:
            assert mb.padding and len(mb.rows) == 1 and mb.width == 2
    for k in range(1, len(plan) + 1):
        groups = [s.minibatches(k, torch.Generator().manual_seed(3)) for s in shards]
        assert all(len(g) == k for g in groups)
        seen = []
        for j in range(k):
            assert len({len(g[j]) for g in groups}) == 1  # each mini-batch: same passes per rank
            for rank, g in enumerate(groups):
                real = [mb for mb in g[j] if not mb.padding]
                assert set(real) <= set(shards[rank].owned())
                seen += real
            assert any(not mb.padding for g in groups for mb in g[j])  # no empty mini-batch
        assert sorted(seen) == sorted(plan.micro_batches)


def test_world_size_1_deals_mini_batches_like_the_plain_plan():
    td = batch()
    plan = plan_micro_batches(td, 20)
    sharded = shard_plan(plan, td, rank=0, world_size=1, collective=False)
    for k in (1, 2, 5):
        a = sharded.minibatches(k, torch.Generator().manual_seed(7))
        assert a == plan.minibatches(k, torch.Generator().manual_seed(7))


def test_fewer_micro_batches_than_ranks_are_split_or_padded():
    td = make_trajectory([2, 3, 1, 4], [3, 1, 2, 5], seed=0)
    plan = plan_micro_batches(td, 1000)
    assert len(plan) == 1
    shards = _shards(td, 1000, 3)
    assert len(shards[0].plan) == 3 and all(len(s.owned()) == 1 for s in shards)
    mask = td["attention_mask"]
    for mb in shards[0].plan.micro_batches:  # each part re-cropped, no real token lost
        sub = shards[0].crop(td, mb)
        assert sub["attention_mask"].sum() == mask[list(mb.rows)].sum()
    one_row = make_trajectory([2], [3], seed=0)
    shards = _shards(one_row, 1000, 2)
    assert shards[1].owned() == () and shards[1].local_plan.micro_batches[0].padding


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("world_size", [2, 3])
def test_splitting_keeps_packed_and_shared_layouts(groups, world_size):
    """A packed shared-prefix (tree) micro-batch split for more ranks keeps the tree layout:
    halves of whole groups (one group: of its rows), each re-planned with the counts its forward
    lays out; a packed one without groups stays packed; the outputs equal the unsplit plan's."""
    from support.trajectories import shared_prompt_batch

    from ar_torchrl.modules.shared_prefix import tree_layout
    from ar_torchrl.training import recompute_old_log_probs_and_values

    td = shared_prompt_batch(groups=groups, n=4, seed=2)
    plan = plan_micro_batches(td, 10_000, packing=True, shared_prefix=True)
    assert len(plan) == 1 and plan.micro_batches[0].shared
    shards = [shard_plan(plan, td, rank=r, world_size=world_size) for r in range(world_size)]
    split = shards[0].plan
    assert len(split) == world_size
    assert sorted(r for mb in split.micro_batches for r in mb.rows) == list(range(4 * groups))
    for mb in split.micro_batches:
        assert mb.packed and bool(mb.shared) == (len(mb.rows) > 1), mb  # one row shares nothing
        if not mb.shared:
            continue
        if groups > 1 and world_size == 2:  # whole groups on each side
            ids = {int(td["prompt_id"][r, 0]) for r in mb.rows}
            assert len(mb.rows) == 4 * len(ids)
        crop = split.crop(td, mb)
        layout = tree_layout(
            crop["tokens"], crop["attention_mask"], crop.get_non_tensor("shared_prefix")
        )
        assert tuple(layout.input_ids.shape) == mb.packed_shape
    ac = actor_critic(seed=3)
    a = recompute_old_log_probs_and_values(ac, td.clone(), plan)
    b = recompute_old_log_probs_and_values(ac, td.clone(), split)
    mask = td["attention_mask"]
    defined = torch.cat([torch.zeros_like(mask[:, :1]), mask[:, 1:] & mask[:, :-1]], dim=1)
    for key in ("sample_log_prob", "state_value"):
        x, y = a[key].reshape(mask.shape), b[key].reshape(mask.shape)
        torch.testing.assert_close(x[defined], y[defined], atol=1e-6, rtol=0)
    packed = plan_micro_batches(td, 10_000, packing=True)
    halves = shard_plan(packed, td, rank=0, world_size=2).plan.micro_batches
    assert len(halves) == 2 and all(mb.packed and not mb.shared for mb in halves)


def test_world_size_1_sharded_update_is_bitwise_the_plain_one():
    ac_a, ac_b = actor_critic(seed=1), actor_critic(seed=1)
    td = batch()
    plan = plan_micro_batches(td, 20)
    td = prepare(ac_a, td, plan)
    sharded = shard_plan(plan, td, rank=0, world_size=1, collective=False)
    kwargs = dict(epochs=2, num_minibatches=2, grad_clip=0.5)
    out_a = ppo_update(
        ppo_loss(ac_a),
        torch.optim.AdamW(ac_a.parameters(), lr=1e-3),
        td.clone(),
        plan,
        generator=torch.Generator().manual_seed(0),
        **kwargs,
    )
    out_b = ppo_update(
        ppo_loss(ac_b),
        torch.optim.AdamW(ac_b.parameters(), lr=1e-3),
        td.clone(),
        sharded,
        generator=torch.Generator().manual_seed(0),
        **kwargs,
    )
    assert out_a == out_b
    for (name, a), b in zip(ac_a.state_dict().items(), ac_b.state_dict().values()):
        assert torch.equal(a, b), name


def _rank_plan(td, owners, rank):
    """``rank``'s view of 2 ranks without collectives: only its own share of each mini-batch."""
    plan = plan_micro_batches(td, 20)
    filler = MicroBatch((0,), 2, 4, padding=True)
    return plan, ShardedPlan(plan, owners, filler, rank, 2, collective=False)


def test_padding_passes_add_no_gradient_and_no_metric():
    """Rank 1 owns one micro-batch and runs padding passes: same update as that micro-batch alone."""
    td = batch()
    plan, rank1 = _rank_plan(td, (0, 0, 1, 0, 0), rank=1)
    assert [mb.padding for mb in rank1.minibatches(1)[0]] == [False, True, True, True]
    ac_a = actor_critic(seed=1)
    td = prepare(ac_a, td, plan)
    ac_b = copy.deepcopy(ac_a)
    alone = type(plan)((plan.micro_batches[2],), plan.batch_size, plan.token_budget)
    out_a = ppo_update(ppo_loss(ac_a), torch.optim.SGD(ac_a.parameters(), lr=0.5), td, alone)
    out_b = ppo_update(ppo_loss(ac_b), torch.optim.SGD(ac_b.parameters(), lr=0.5), td, rank1)
    assert out_a == out_b
    for (name, a), b in zip(ac_a.state_dict().items(), ac_b.state_dict().values()):
        assert torch.equal(a, b), name


def test_only_padding_passes_leave_weights_untouched():
    td = batch()
    plan, idle = _rank_plan(td, (0, 0, 0, 0, 0), rank=1)
    ac = actor_critic(seed=1)
    td = prepare(ac, td, plan)
    before = copy.deepcopy(ac.state_dict())
    out = ppo_update(ppo_loss(ac), torch.optim.SGD(ac.parameters(), lr=0.5), td, idle)
    assert out["train/optimizer_steps"] == 1.0 and out["train/grad_norm"] == 0.0
    assert out["train/loss_objective"] == 0.0 and out["train/mean_ratio"] == 0.0
    for name, p in ac.state_dict().items():
        assert torch.equal(p, before[name]), name


class NaNFirst:
    """Wraps a loss: the first call returns a NaN objective; counts calls."""

    def __init__(self, loss):
        self.loss, self.calls = loss, 0

    def global_normalizer(self, tds):
        return self.loss.global_normalizer(tds)

    def __call__(self, td, normalizer=None):
        self.calls += 1
        out = self.loss(td, normalizer=normalizer)
        if self.calls == 1:
            out["loss_objective"] = out["loss_objective"] * float("nan")
        return out


def test_sharded_non_finite_loss_still_runs_every_pass_then_skips():
    """FSDP collectives hang unless every rank runs every backward: no early return."""
    td = batch()
    plan = plan_micro_batches(td, 20)
    ac = actor_critic(seed=1)
    td = prepare(ac, td, plan)
    sharded = shard_plan(plan, td, rank=0, world_size=1, collective=False)
    bad = NaNFirst(ppo_loss(ac))
    out = ppo_update(bad, torch.optim.SGD(ac.parameters(), lr=0.5), td, sharded)
    assert bad.calls == len(plan) and out["train/skipped_steps"] == 1.0


def test_shard_plan_errors_name_the_problem():
    td = batch()
    plan = plan_micro_batches(td, 20)
    with pytest.raises(ValueError, match=r"need 0 <= rank < world_size, got rank=2, world_size=2"):
        shard_plan(plan, td, rank=2, world_size=2)
    with pytest.raises(ValueError, match=r"plan was made for batch size \(9, 13\), got \(3, 13\)"):
        shard_plan(plan, td[:3], rank=0, world_size=2)
    sharded = shard_plan(plan, td, rank=0, world_size=2)
    with pytest.raises(ValueError, match="cannot make 6 mini-batches from 5 micro-batches"):
        sharded.minibatches(6)


def test_two_ranks_log_the_metrics_of_the_whole_mini_batch():
    """Two ranks (threads meeting in ``plan.reduce``, as all_reduce) on a ShardedPlan log what one
    process logs over the whole batch: means, sums, maxima/minima and explained variance. One
    step, so every metric is taken at the same weights (no gradient crosses these ranks)."""
    td = batch()
    plan = plan_micro_batches(td, 20)
    ac = actor_critic(seed=1)
    td = prepare(ac, td, plan)
    perturb(ac.model, scale=0.02, seed=4)  # ratios != 1

    def update(plan_, model):
        return ppo_update(
            ppo_loss(model),
            torch.optim.SGD(model.parameters(), lr=0.5),
            td.clone(),
            plan_,
            generator=torch.Generator().manual_seed(0),
        )

    want = update(plan, copy.deepcopy(ac))
    ranks = ThreadedRanks(2)

    class Threaded(ShardedPlan):
        def reduce(self, values, op="sum"):
            return ranks.reduce(values, op)

    def rank_update(rank: int):
        mine = shard_plan(plan, td, rank=rank, world_size=2, collective=False)
        threaded = Threaded(mine.plan, mine.owners, mine.filler, rank, 2, collective=False)
        return update(threaded, copy.deepcopy(ac))

    got = ranks.run(rank_update)
    assert got[0].keys() == got[1].keys() == want.keys()
    assert want["train/max_ratio"] > 1.01 and want["train/min_ratio"] < 0.99
    for key, value in want.items():
        if key.startswith("train/grad_norm"):
            continue  # each thread's gradient is its share (FSDP would all-reduce it)
        for out in got:
            assert out[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
