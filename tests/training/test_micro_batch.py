"""plan_micro_batches / MicroBatchPlan."""

from __future__ import annotations

import pytest
import torch
from support.trajectories import make_trajectory, shared_prompt_batch
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


# ----------------------------------------------------------------------------- shared prefixes
def _groups(td) -> dict[int, set[int]]:
    ids = td["prompt_id"][:, 0].tolist()
    return {p: {b for b, q in enumerate(ids) if q == p} for p in set(ids)}


@pytest.mark.parametrize(
    ("budget", "max_rows"), [(48, None), (80, None), (10_000, 6), (10_000, None)]
)
def test_shared_prefix_plans_keep_groups_together_within_budget(budget, max_rows):
    td = shared_prompt_batch(groups=6, n=4, seed=7)
    plan = plan_micro_batches(td, budget, max_rows, shared_prefix=True)
    rows = sorted(r for mb in plan.micro_batches for r in mb.rows)
    assert rows == list(range(td.shape[0]))  # every row once
    width = int(
        td["loss_mask"].int().argmax(-1).max()
    )  # the prompts' end: the first trained column
    for mb in plan.micro_batches:
        assert mb.num_tokens <= budget and (max_rows is None or len(mb.rows) <= max_rows)
        split, groups = mb.shared
        assert split == width and len(groups) == len(mb.rows)
        members = {}
        for row, g in zip(mb.rows, groups):
            members.setdefault(g, set()).add(row)
        tokens = (
            td["tokens"][list(mb.rows), mb.start : split]
            * td["attention_mask"][list(mb.rows), mb.start : split]
        )
        for rows_of_g in members.values():  # a group: rows of one prompt, the same prefix
            first = tokens[mb.rows.index(min(rows_of_g))]
            assert all(torch.equal(tokens[mb.rows.index(r)], first) for r in rows_of_g)
            assert len({int(td["prompt_id"][r, 0]) for r in rows_of_g}) == 1
        prefix, rest = split - mb.start, mb.end - split
        assert mb.num_tokens == len(members) * prefix + len(mb.rows) * rest
    if budget >= 10_000 and max_rows is None:  # one micro-batch: each prompt is one group
        assert len(plan) == 1 and len(set(plan.micro_batches[0].shared[1])) == 6
        assert plan.num_tokens < plan_micro_batches(td, budget).num_tokens


def test_auto_shares_where_groups_save_tokens_packed_with_the_tree_layout():
    grouped, single = shared_prompt_batch(6, 4, seed=1), shared_prompt_batch(12, 1, seed=1)
    padded = plan_micro_batches(grouped, 10_000, shared_prefix="auto")
    assert all(mb.shared and not mb.packed for mb in padded.micro_batches)
    alone = plan_micro_batches(single, 10_000, shared_prefix=True)  # n = 1: nothing to share
    assert all(mb.shared is None for mb in alone.micro_batches)
    assert plan_micro_batches(single, 10_000, shared_prefix="auto") == plan_micro_batches(
        single, 10_000
    )
    # packed (True or auto): the tree layout, one unit per group, fewer tokens than packing alone
    for packing in (True, "auto"):
        tree = plan_micro_batches(grouped, 10_000, packing=packing, shared_prefix="auto")
        assert all(mb.packed and mb.shared for mb in tree.micro_batches), packing
        assert tree == plan_micro_batches(grouped, 10_000, packing=True, shared_prefix=True)
    assert tree.num_tokens < plan_micro_batches(grouped, 10_000, packing=True).num_tokens
    # shared_padded=False (FSDP2, activation checkpointing): packed or nothing shared
    assert plan_micro_batches(grouped, 10_000, shared_prefix="auto", shared_padded=False) == (
        plan_micro_batches(grouped, 10_000)
    )
    only_tree = plan_micro_batches(
        grouped, 10_000, packing="auto", shared_prefix=True, shared_padded=False
    )
    assert only_tree == tree
    with pytest.raises(ValueError, match=r"shared_padded=False needs packed micro-batches"):
        plan_micro_batches(grouped, 10_000, shared_prefix=True, shared_padded=False)
    # shared_packed=False (a kernel without dense masks): padded or nothing shared
    for packing in ("auto", False):
        only_padded = plan_micro_batches(
            grouped, 10_000, packing=packing, shared_prefix="auto", shared_packed=False
        )
        assert only_padded == padded, packing
    assert plan_micro_batches(
        grouped, 10_000, packing=True, shared_prefix="auto", shared_packed=False
    ) == plan_micro_batches(grouped, 10_000, packing=True)
    with pytest.raises(
        ValueError,
        match=r"shared_prefix=True with shared_packed=False needs padded micro-batches, but "
        r"packing=True",
    ):
        plan_micro_batches(grouped, 10_000, packing=True, shared_prefix=True, shared_packed=False)
    with pytest.raises(ValueError, match=r"shared_prefix must be True, False or 'auto', got 'yes'"):
        plan_micro_batches(grouped, 10_000, shared_prefix="yes")


def test_auto_packing_keeps_wide_trees_padded(monkeypatch):
    """``packing="auto"`` lays shared micro-batches out as a tree only while every bin is at most
    ``AUTO_TREE_MAX_WIDTH`` wide (its dense mask: bins x width^2); wider, the padded shared
    layout; ``packing=True`` (asked for) and ``shared_padded=False`` (nothing else runs) keep it."""
    from ar_torchrl.training import micro_batch

    td = shared_prompt_batch(6, 4, seed=1)
    tree = plan_micro_batches(td, 10_000, packing="auto", shared_prefix="auto")
    width = max(mb.packed_shape[1] for mb in tree.micro_batches)
    assert all(mb.packed and mb.shared for mb in tree.micro_batches)
    monkeypatch.setattr(micro_batch, "AUTO_TREE_MAX_WIDTH", width - 1)
    wide = plan_micro_batches(td, 10_000, packing="auto", shared_prefix="auto")
    assert all(mb.shared and not mb.packed for mb in wide.micro_batches)
    assert wide == plan_micro_batches(td, 10_000, shared_prefix=True)
    assert plan_micro_batches(td, 10_000, packing=True, shared_prefix="auto") == tree
    only = plan_micro_batches(td, 10_000, packing="auto", shared_prefix="auto", shared_padded=False)
    assert only == tree


@pytest.mark.parametrize("budget", [40, 90, 10_000])
def test_tree_plans_count_what_the_tree_layout_computes(budget):
    """Every packed shared micro-batch's ``packed_shape`` is the shape of the input the tree
    forward lays out for its crop (the same lengths, the same first-fit call); the budget holds;
    every row is in exactly one micro-batch."""
    from ar_torchrl.modules.shared_prefix import tree_layout

    td = shared_prompt_batch(groups=5, n=4, seed=7)
    plan = plan_micro_batches(td, budget, packing=True, shared_prefix=True)
    assert sorted(r for mb in plan.micro_batches for r in mb.rows) == list(range(td.shape[0]))
    assert any(mb.shared for mb in plan.micro_batches)
    for mb in plan.micro_batches:
        assert mb.packed and mb.num_tokens <= budget
        crop = plan.crop(td, mb)
        if mb.shared is None:
            continue
        layout = tree_layout(
            crop["tokens"], crop["attention_mask"], crop.get_non_tensor("shared_prefix")
        )
        assert tuple(layout.input_ids.shape) == mb.packed_shape
        # every real token sits where its row's padded forward had it: the same ids and positions
        mask = crop["attention_mask"]
        ids = layout.input_ids.reshape(-1)[layout.index[mask]]
        assert torch.equal(ids, crop["tokens"][mask])
        pos = layout.position_ids.reshape(-1)[layout.index[mask]]
        assert torch.equal(pos, (mask.long().cumsum(-1) - 1)[mask])


@pytest.mark.parametrize(("n", "max_response"), [(4, 9), (2, 40), (1, 40)])
def test_auto_takes_the_plan_that_computes_fewest_tokens(n, max_response):
    """``shared_prefix="auto"`` with ``packing="auto"``: shared when it saves >= 20 % of the
    padded plan's tokens and computes no more than the packed plan packing would choose."""
    from ar_torchrl.training.micro_batch import AUTO_PACKING_MIN_PADDING, AUTO_SHARED_MIN_SAVING

    td = shared_prompt_batch(groups=6, n=n, seed=3, max_response=max_response)
    padded = plan_micro_batches(td, 10_000)
    shared = plan_micro_batches(td, 10_000, packing=True, shared_prefix=True)  # the tree
    packed = plan_micro_batches(td, 10_000, packing=True)
    chosen = plan_micro_batches(td, 10_000, packing="auto", shared_prefix="auto")
    real = int(td["attention_mask"].sum())
    candidates = [padded]
    if 1 - real / padded.num_tokens >= AUTO_PACKING_MIN_PADDING:
        candidates = [packed]
    if 1 - shared.num_tokens / padded.num_tokens >= AUTO_SHARED_MIN_SAVING:
        candidates.append(shared)
    best = min(candidates, key=lambda p: (p.num_tokens, p is not shared))
    assert chosen == best


def test_shared_prefix_needs_tokens_and_loss_mask():
    td = shared_prompt_batch(groups=3, n=2, seed=2)
    del td["loss_mask"]
    assert plan_micro_batches(td, 10_000, shared_prefix="auto") == plan_micro_batches(td, 10_000)
    with pytest.raises(ValueError, match=r"the batch has no \['loss_mask'\]"):
        plan_micro_batches(td, 10_000, shared_prefix=True)


def test_rows_whose_masks_differ_before_the_split_are_not_one_group():
    """Two samples of a prompt whose prompts differ only in the mask (a real token 0 in one row,
    a masked hole holding 0 in the other) compute different prefixes: not one group."""
    td = shared_prompt_batch(groups=1, n=3, seed=4)
    col = int(td["loss_mask"].int().argmax(-1).min()) - 2  # a prompt column of every row
    assert bool(td["attention_mask"][:, col].all())
    td["tokens"][:, col] = 0
    td["attention_mask"][1, col] = False
    (mb,) = plan_micro_batches(td, 10_000, shared_prefix=True).micro_batches
    groups = mb.shared[1]
    row_group = dict(zip(mb.rows, groups))
    assert row_group[0] == row_group[2] != row_group[1]
