"""plan_micro_batches / MicroBatchPlan."""

from __future__ import annotations

import pytest
import torch
from support.trajectories import make_trajectory
from tensordict import TensorDict

from ar_torchrl.training import plan_micro_batches


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("budget,max_rows", [(40, None), (64, 3), (200, None), (17, 1)])
def test_plan_covers_every_row_once_within_budget(seed, budget, max_rows):
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, 8, (11,), generator=g).tolist()
    responses = torch.randint(1, 10, (11,), generator=g).tolist()
    td = make_trajectory(prompts, responses, seed=seed)
    plan = plan_micro_batches(td, token_budget=budget, max_rows=max_rows)
    rows = sorted(r for mb in plan.micro_batches for r in mb.rows)
    assert rows == list(range(11))
    for mb, sub in zip(plan.micro_batches, plan.split(td)):
        assert mb.num_tokens <= budget
        assert max_rows is None or len(mb.rows) <= max_rows
        assert tuple(sub.batch_size) == (len(mb.rows), mb.width)
        # no real token is cropped away
        assert sub["attention_mask"].sum() == td["attention_mask"][list(mb.rows)].sum()
        assert torch.equal(sub["tokens"], td["tokens"][list(mb.rows), mb.start : mb.end])


def test_packing_sorts_by_length_and_removes_padding():
    td = make_trajectory([1, 8, 1, 8], [1, 8, 1, 8])
    plan = plan_micro_batches(td, token_budget=32)
    assert [mb.rows for mb in plan.micro_batches] == [(1, 3), (0, 2)]
    assert sum(mb.num_tokens for mb in plan.micro_batches) < td.numel()


def test_minibatches_group_micro_batches_and_scatter_round_trips():
    td = make_trajectory([2] * 8, [3] * 8)
    plan = plan_micro_batches(td, token_budget=10)
    groups = plan.minibatches(2, generator=torch.Generator().manual_seed(0))
    assert sorted(mb for grp in groups for mb in grp) == sorted(plan.micro_batches)
    full = torch.zeros(td.shape)
    for mb, sub in zip(plan.micro_batches, plan.split(td)):
        plan.scatter(full, mb, sub["tokens"].float())
    assert torch.equal(full[td["attention_mask"]], td["tokens"][td["attention_mask"]].float())
    with pytest.raises(ValueError, match=r"cannot make 9 mini-batches from 4 micro-batches"):
        plan.minibatches(9)


def test_plan_errors():
    td = make_trajectory([3, 2], [4, 5])
    with pytest.raises(
        ValueError,
        match=r"token_budget=5 is smaller than the longest row \(7 tokens\); raise token_budget to at least 7",
    ):
        plan_micro_batches(td, token_budget=5)
    with pytest.raises(ValueError, match="token_budget must be >= 1, got 0"):
        plan_micro_batches(td, token_budget=0)
    with pytest.raises(ValueError, match="max_rows must be >= 1 or None, got 0"):
        plan_micro_batches(td, token_budget=50, max_rows=0)
    with pytest.raises(ValueError, match=r"expects a \[B, L\] TensorDict, got batch_size \(2,\)"):
        plan_micro_batches(
            TensorDict({"attention_mask": torch.ones(2, 3, dtype=torch.bool)}, [2]), token_budget=9
        )
    empty = td.clone()
    empty["attention_mask"][1] = False
    with pytest.raises(ValueError, match=r"rows \[1\] have no real token"):
        plan_micro_batches(empty, token_budget=50)
    plan = plan_micro_batches(td, token_budget=50)
    with pytest.raises(
        ValueError,
        match=r"made for a batch of size \(2, 8\), got a TensorDict with batch_size \(3, 8\)",
    ):
        list(plan.split(make_trajectory([3, 2, 1], [4, 5, 1])))
