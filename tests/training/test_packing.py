"""Padding-free (packed) micro-batches: geometry, equality with padded forwards, ratio exactly 1."""

from __future__ import annotations

import pytest
import torch
from support.trajectories import make_trajectory, tiny_actor_critic

from ar_torchrl.modules import PACKED_KEY, LMActorCritic, pack_rows, packed_layout
from ar_torchrl.objectives import TokenGAE, TokenPPOLoss
from ar_torchrl.training import plan_micro_batches, ppo_update, recompute_old_log_probs_and_values
from ar_torchrl.training.micro_batch import AUTO_PACKING_MIN_PADDING

torch.set_num_threads(1)

# Left-padded prompts of 1..9 tokens, responses of 1..40: rows of very different lengths.
PROMPTS = [3, 9, 1, 5, 2, 7, 1, 4]
RESPONSES = [4, 1, 40, 6, 2, 25, 1, 13]


def _actor_critic(**kwargs):
    ac = tiny_actor_critic(seed=3, **kwargs)
    torch.nn.init.normal_(ac.model.value_head.weight, std=0.1)
    torch.nn.init.normal_(ac.model.value_head.bias, std=0.1)
    return ac


def _packed(td):
    sub = td.select("tokens", "attention_mask").clone()
    sub.set_non_tensor(PACKED_KEY, True)
    return sub


def _has_previous(mask):
    return mask & (mask.long().cumsum(-1) > 1)


def test_pack_rows_is_first_fit_decreasing():
    bins, slots = pack_rows([5, 2, 3, 1, 4, 1])
    # longest first into bins of width 5: 5 | 4 + 1 | 3 + 2 | the last 1 finds no room
    assert bins == 4
    assert slots == [(0, 0), (2, 3), (2, 0), (1, 4), (1, 0), (3, 0)]
    width = 5
    used = {}
    for (b, off), n in zip(slots, [5, 2, 3, 1, 4, 1]):
        assert 0 <= off and off + n <= width
        used.setdefault(b, []).append((off, off + n))
    for spans in used.values():  # rows of one bin never overlap
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert pack_rows([]) == (0, [])
    assert pack_rows([3, 3, 3]) == (3, [(0, 0), (1, 0), (2, 0)])


def test_packed_layout_positions_restart_per_row_and_slack():
    td = make_trajectory([2, 1, 3], [3, 1, 1], seed=0)  # real lengths 5, 2, 4 -> width 5
    layout = packed_layout(td["tokens"], td["attention_mask"])
    assert layout.input_ids.shape == (3, 5)  # 5 | 4 + slack 1 | 2 + slack 3
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 0], [0, 1, 0, 1, 2]]
    mask = td["attention_mask"]
    assert torch.equal(layout.input_ids.flatten()[layout.index[mask]], td["tokens"][mask])
    assert (layout.index[~mask] == -1).all()
    assert torch.equal(layout.previous, _has_previous(mask))
    flat = packed_layout(td["tokens"], td["attention_mask"], varlen=True)
    assert flat.input_ids.shape == (1, 11)  # rows end to end, no slack
    assert flat.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 0, 1, 2, 3]]
    assert torch.equal(flat.input_ids.flatten()[flat.index[mask]], td["tokens"][mask])
    empty = mask.clone()
    empty[1] = False
    with pytest.raises(ValueError, match=r"rows \[1\] have no real token"):
        packed_layout(td["tokens"], empty)


@pytest.mark.parametrize("entropy,temperature", [(False, 1.0), (True, 0.7)])
def test_packed_outputs_equal_padded_ones(entropy, temperature):
    ac = _actor_critic(return_entropy=entropy, temperature=temperature)
    td = make_trajectory(PROMPTS, RESPONSES, seed=1)
    padded = ac(td.select("tokens", "attention_mask").clone())
    packed = ac(_packed(td))
    mask = td["attention_mask"]
    has = _has_previous(mask)
    keys = ["log_prob", "state_value"] + (["entropy"] if entropy else [])
    for key in keys:
        a, b = padded[key].reshape(mask.shape), packed[key].reshape(mask.shape)
        assert torch.allclose(a[has], b[has], atol=1e-5, rtol=0), key
        assert (b[~has] == 0).all(), key  # padding and each row's first token: nothing defined
    a, b = padded["next", "state_value"].squeeze(-1), packed["next", "state_value"].squeeze(-1)
    assert torch.allclose(a[mask], b[mask], atol=1e-5, rtol=0)
    assert (b[~mask] == 0).all()


def test_packed_equals_padded_with_eager_attention():
    ac = _actor_critic()
    ac.model.set_attn_implementation("eager")  # the block mask goes through eager's matmuls too
    td = make_trajectory(PROMPTS, RESPONSES, seed=6)
    padded = ac(td.select("tokens", "attention_mask").clone())
    packed = ac(_packed(td))
    has = _has_previous(td["attention_mask"])
    assert torch.allclose(padded["log_prob"][has], packed["log_prob"][has], atol=1e-5, rtol=0)


def test_varlen_layout_equals_bins():
    """The one-row layout of variable-length kernels gives the same hidden states as the bins
    (run here through sdpa, which detects the packed rows in one row too)."""
    ac = _actor_critic()
    td = make_trajectory(PROMPTS, RESPONSES, seed=2)
    mask = td["attention_mask"]
    decoder = ac.model.get_decoder()
    hidden = {}
    for varlen in (False, True):
        layout = packed_layout(td["tokens"], mask, varlen=varlen)
        out = decoder(input_ids=layout.input_ids, position_ids=layout.position_ids, use_cache=False)
        hidden[varlen] = out.last_hidden_state.reshape(-1, 64)[layout.index[mask]]
    assert torch.allclose(hidden[False], hidden[True], atol=1e-5)


def test_packed_gradients_equal_padded_ones():
    ac = _actor_critic()
    td = make_trajectory(PROMPTS, RESPONSES, seed=3)
    has = _has_previous(td["attention_mask"])
    grads = []
    for sub in (td.select("tokens", "attention_mask").clone(), _packed(td)):
        ac.model.zero_grad()
        out = ac(sub)
        loss = out["log_prob"][has].sum() + out["state_value"].squeeze(-1)[has].sum()
        loss.backward()
        grads.append([p.grad.clone() for p in ac.model.parameters()])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("budget", [None, 99 * 4 * 5 * 3])  # default, or 3 positions per chunk
def test_packed_plan_first_update_has_ratio_exactly_one(budget):
    ac = _actor_critic(**({} if budget is None else {"logits_memory_budget": budget}))
    td = make_trajectory(PROMPTS, RESPONSES, seed=4)
    plan = plan_micro_batches(td, token_budget=64, packing=True)
    assert len(plan) >= 2 and all(mb.packed for mb in plan.micro_batches)
    recompute_old_log_probs_and_values(ac, td, plan)
    td = TokenGAE(gamma=1.0, lmbda=0.95)(td)
    loss = TokenPPOLoss(ac, clip_epsilon=(0.2, 0.28), clip_value=0.2, entropy_coeff=0.01)
    for sub in plan.split(td):
        assert sub.get_non_tensor(PACKED_KEY)
        out = loss(sub)
        assert out["min_ratio"].item() == 1.0 and out["max_ratio"].item() == 1.0
        assert out["approx_kl"].item() == 0.0 and out["value_clip_fraction"].item() == 0.0
    opt = torch.optim.SGD(ac.parameters(), lr=1e-3)
    metrics = ppo_update(loss, opt, td, plan, epochs=1, num_minibatches=2)
    assert metrics["train/optimizer_steps"] == 2.0 and metrics["train/skipped_steps"] == 0.0


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget,max_rows", [(48, None), (64, 3), (200, None)])
def test_packed_plan_counts_the_tokens_the_forward_computes(seed, budget, max_rows):
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, 8, (11,), generator=g).tolist()
    responses = torch.randint(1, 40, (11,), generator=g).tolist()
    td = make_trajectory(prompts, responses, seed=seed)
    plan = plan_micro_batches(td, token_budget=budget, max_rows=max_rows, packing=True)
    padded = plan_micro_batches(td, token_budget=budget, max_rows=max_rows)
    assert sorted(r for mb in plan.micro_batches for r in mb.rows) == list(range(11))
    assert plan.num_tokens <= padded.num_tokens
    for mb, sub in zip(plan.micro_batches, plan.split(td)):
        layout = packed_layout(sub["tokens"], sub["attention_mask"])
        assert mb.packed_shape == tuple(layout.input_ids.shape)  # the plan's count is the forward's
        assert mb.num_tokens <= budget
        assert max_rows is None or len(mb.rows) <= max_rows
        assert sub["attention_mask"].sum() == td["attention_mask"][list(mb.rows)].sum()


def test_auto_packs_only_where_the_padded_plan_pads_enough():
    ragged = make_trajectory(PROMPTS, RESPONSES)
    auto = plan_micro_batches(ragged, token_budget=64, packing="auto")
    assert all(mb.packed for mb in auto.micro_batches)
    even = make_trajectory([4] * 8, [6] * 8)  # no padding at all: nothing to gain
    auto = plan_micro_batches(even, token_budget=64, packing="auto")
    assert not any(mb.packed for mb in auto.micro_batches)
    choices = set()
    for seed in range(8):  # the rule, on batches with 18-33 % padding
        g = torch.Generator().manual_seed(seed)
        td = make_trajectory(
            torch.randint(1, 4 + seed, (8,), generator=g).tolist(),
            torch.randint(2, 6 + 2 * seed, (8,), generator=g).tolist(),
        )
        padded = plan_micro_batches(td, token_budget=64)
        padding = 1 - td["attention_mask"].sum().item() / padded.num_tokens
        auto = plan_micro_batches(td, token_budget=64, packing="auto")
        assert auto.micro_batches[0].packed == (padding >= AUTO_PACKING_MIN_PADDING)
        choices.add(auto.micro_batches[0].packed)
    assert choices == {True, False}
    with pytest.raises(ValueError, match="packing must be True, False or 'auto', got 'yes'"):
        plan_micro_batches(even, token_budget=64, packing="yes")


def test_packed_reference_actor_without_value_head():
    """A critic-free reference actor packs the same crops (ref log-probs for the KL term)."""
    ac = _actor_critic()
    ref = LMActorCritic(ac.model, critic=False)
    td = make_trajectory(PROMPTS, RESPONSES, seed=5)
    plan = plan_micro_batches(td, token_budget=64, packing=True)
    recompute_old_log_probs_and_values(ac, td, plan, ref_actor=ref)
    assert torch.equal(td["ref_log_prob"], td["sample_log_prob"])  # same weights, same crops
    out = ref(_packed(td))
    assert set(out.keys()) == {"tokens", "attention_mask", PACKED_KEY, "log_prob"}
