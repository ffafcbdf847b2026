"""GAE over multi-turn rows (docs/design.md section 1b): token level across observation spans, turn
level (``turn_gae`` / ``TokenGAE(timestep="turn")``), GRPO / RLOO, and the value alignment.

Every numerical claim is checked three ways: against plain Python loops written from the design's
wording over random segmentations, against properties (tool spans consume no step), and against
the peers' own recurrences, re-expressed here from their code at a pinned commit:

- verl ``compute_gae_advantage_return``, volcengine/verl@b178a3cd56f58b2d502255daba591e92833930a7,
  verl/trainer/ppo/core_algos.py (the observation mask came with 0332866, "mask out observation
  token in GAE (#2337)"), with ``masked_whiten`` from verl/utils/torch_functional.py;
- NeMo-RL ``GeneralizedAdvantageEstimator``, NVIDIA-NeMo/RL@7ea279abfbeb698b092856d0dab61e7cf39bc909,
  nemo_rl/algorithms/advantage_estimator.py (``_build_token_level_rewards``, ``_compute_gae``,
  ``compute_advantage``) and nemo_rl/algorithms/utils.py (``masked_mean`` / ``masked_var``);
- AReaL ``_compute_token_level_gae`` / ``_compute_turn_level_gae``,
  areal-project/AReaL@cbff54d645d2cd8ee1f1c358a82f3f473588433d, areal/trainer/ppo/gae.py, called
  from areal/trainer/ppo/actor.py (``_compute_advantages``: ``loss_mask`` and ``turn_ids`` rolled
  by -1, so index ``t`` holds the value ``V(h[t])`` of the state before token ``t + 1``). The
  inclusionAI/AReaL mirror (HEAD 4aef98d8d818af55b43621aaadba047ae10f4e77) has no turn mode.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from support.reference import gae_loop, grpo_loop, whiten_loop
from support.trajectories import VOCAB, tiny_actor_critic
from tensordict import TensorDict

from ar_torchrl import functional
from ar_torchrl.data.samples import Sample, Segment
from ar_torchrl.data.trajectory import build_trajectory
from ar_torchrl.modules import PACKED_KEY
from ar_torchrl.objectives import GRPOAdvantage, RLOOAdvantage, TokenGAE
from ar_torchrl.objectives.config import GAEConfig
from ar_torchrl.objectives.registry import make_advantage
from ar_torchrl.utils.checks import check_gae_args

torch.set_num_threads(1)

TOL = {torch.float64: 1e-10, torch.float32: 2e-5}


# ----------------------------------------------------------------------------- random episodes
def _episodes(seed, batch=10, *, max_turns=4, id_gaps=True, dtype=torch.float64):
    """A batch of random multi-turn rows in the design's layout.

    Each row: a left-padded prompt (1-5 tokens), 1..max_turns turns of 1-5 trained tokens with tool
    spans of 0-4 tokens between them, sometimes a tool span after the last turn (an episode cut after
    a tool answered), right padding. Rewards: a per-turn reward on some turns' last token and the
    outcome on the last trained token. Values are random everywhere (garbage on untrained tokens);
    half the rows are truncated.
    """
    rng = random.Random(seed)
    rows = []
    for _ in range(batch):
        kind, tid, rew = [], [], []

        def add(k, n, turn=-1, kind=kind, tid=tid, rew=rew):
            kind.extend([k] * n)
            tid.extend([turn] * n)
            rew.extend([0.0] * n)

        add("p", rng.randint(1, 5))
        turn = rng.randint(0, 1)
        for k in range(rng.randint(1, max_turns)):
            if k:
                add("o", rng.randint(0, 4))
            add("t", rng.randint(1, 5), turn)
            if rng.random() < 0.5:
                rew[-1] += round(rng.gauss(0.0, 0.5), 3)  # per-turn reward (e.g. a tool error)
            turn += rng.choice([1, 1, 2]) if id_gaps else 1
        if rng.random() < 0.3:
            add("o", rng.randint(1, 3))
        last = max(i for i, k in enumerate(kind) if k == "t")
        rew[last] += rng.choice([1.0, -1.0, 0.0])  # the outcome
        rows.append((kind, tid, rew))
    prompt = [r[0].count("p") for r in rows]
    width_p = max(prompt)
    width = width_p + max(len(r[0]) - p for r, p in zip(rows, prompt))
    shape = (batch, width)
    mask = torch.zeros(shape, dtype=torch.bool)
    attn = torch.zeros(shape, dtype=torch.bool)
    turn_id = torch.full(shape, -1, dtype=torch.long)
    reward = torch.zeros(shape, dtype=torch.float64)
    for b, ((kind, tid, rew), p) in enumerate(zip(rows, prompt)):
        cols = slice(width_p - p, width_p - p + len(kind))
        attn[b, cols] = True
        mask[b, cols] = torch.tensor([k == "t" for k in kind])
        turn_id[b, cols] = torch.tensor(tid)
        reward[b, cols] = torch.tensor(rew, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    value = torch.randn(shape, generator=g, dtype=torch.float64)
    value = torch.where(mask, value, 1e3 * torch.randn(shape, generator=g, dtype=torch.float64))
    next_value = torch.randn(shape, generator=g, dtype=torch.float64)
    truncated = torch.rand(batch, generator=g) < 0.5
    return {
        "reward": reward.to(dtype),
        "value": value.to(dtype),
        "next_value": next_value.to(dtype),
        "mask": mask,
        "attn": attn,
        "turn_id": turn_id,
        "truncated": truncated,
    }


def _bootstrap_loop(ep):
    """The design's "last value" of a truncated row: V after the row's last real token (a tool output
    may follow the last trained token); 0 for a terminated row."""
    out = []
    for b in range(ep["mask"].shape[0]):
        real = [t for t, a in enumerate(ep["attn"][b].tolist()) if a]
        trained = bool(ep["mask"][b].any())
        boot = float(ep["next_value"][b, real[-1]]) if trained and ep["truncated"][b] else 0.0
        out.append(boot)
    return torch.tensor(out, dtype=torch.float64)


# ----------------------------------------------------------------------------- loop twins
#: Token level, as section 3 words it (untrained tokens: prompt, tool, padding, are skipped and
#: leave the carried V_next, A_next as they are): the repository's reference loop.
token_loop = gae_loop


def _lam(x, b):
    return float(x[b]) if torch.is_tensor(x) and x.ndim else float(x)


def turns_of(mask_row, turn_row):
    """The row's turns in order: lists of positions of trained tokens sharing a turn id."""
    turns, current = [], None
    for t, (m, i) in enumerate(zip(mask_row, turn_row)):
        if not m:
            continue
        if not turns or i != current:
            turns.append([])
            current = i
        turns[-1].append(t)
    return turns


def turn_loop(reward, value, mask, turn_id, gamma, lmbda, critic_lmbda=None, bootstrap=None):
    """Turn level (AReaL's gae_timestep_unit: turn): r_u = sum of the turn's rewards, V_u = value at
    its first trained token, delta_u = r_u + gamma V_{u+1} - V_u, A_u = delta_u + gamma lmbda A_{u+1};
    A_u and A'_u + V_u on every trained token of the turn."""
    B, L = reward.shape
    adv = [[0.0] * L for _ in range(B)]
    tgt = [[0.0] * L for _ in range(B)]
    for b in range(B):
        lam = _lam(lmbda, b)
        clam = lam if critic_lmbda is None else _lam(critic_lmbda, b)
        turns = turns_of(mask[b].tolist(), turn_id[b].tolist())
        v_next = 0.0 if bootstrap is None else float(bootstrap[b])
        a_next = c_next = 0.0
        for positions in reversed(turns):
            r = sum(float(reward[b, t]) for t in positions)
            v = float(value[b, positions[0]])
            delta = r + gamma * v_next - v
            a = delta + gamma * lam * a_next
            c = delta + gamma * clam * c_next
            for t in positions:
                adv[b][t], tgt[b][t] = a, c + v
            v_next, a_next, c_next = v, a, c
    return torch.tensor(adv, dtype=torch.float64), torch.tensor(tgt, dtype=torch.float64)


def _maxdiff(x, ref):
    return float((x.double() - ref).abs().max()) if x.numel() else 0.0


HYPER = [
    (1.0, 0.95, None),
    (0.99, 0.9, 1.0),
    (1.0, 1.0, None),
    (0.5, 0.3, 0.7),
    (0.9, 0.0, None),
    (0.0, 0.95, None),
]


# ----------------------------------------------------------------------------- token level
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("gamma,lmbda,critic_lmbda", HYPER)
@pytest.mark.parametrize("seed", range(4))
def test_token_gae_over_tool_spans_matches_the_loop(seed, gamma, lmbda, critic_lmbda, dtype):
    ep = _episodes(seed, dtype=dtype)
    boot = _bootstrap_loop(ep)
    assert not functional.check_gae_inputs(
        ep["reward"], ep["value"], ep["mask"]
    )  # the compacted path
    for bootstrap in (None, boot):
        b = None if bootstrap is None else bootstrap.to(dtype)
        adv, tgt = functional.token_gae(
            ep["reward"],
            ep["value"],
            ep["mask"],
            gamma=gamma,
            lmbda=lmbda,
            critic_lmbda=critic_lmbda,
            bootstrap_value=b,
        )
        ref_adv, ref_tgt = token_loop(
            ep["reward"], ep["value"], ep["mask"], gamma, lmbda, critic_lmbda, b
        )
        assert adv.dtype == dtype
        assert _maxdiff(adv, ref_adv) <= TOL[dtype] * max(1.0, float(ref_adv.abs().max()))
        assert _maxdiff(tgt, ref_tgt) <= TOL[dtype] * max(1.0, float(ref_tgt.abs().max()))
        assert (adv[~ep["mask"]] == 0).all() and (tgt[~ep["mask"]] == 0).all()


@pytest.mark.parametrize("seed", range(3))
def test_tool_tokens_consume_no_step(seed):
    """Deleting every untrained token (each row becomes its trained tokens, contiguous) changes no
    number on a trained token, per token and per turn: tool spans consume no step."""
    ep = _episodes(seed, batch=8)
    boot = _bootstrap_loop(ep)
    n = ep["mask"].sum(-1)
    width = int(n.max())
    dense = torch.arange(width) < n.unsqueeze(-1)
    packed = {k: torch.zeros(dense.shape, dtype=ep[k].dtype) for k in ("reward", "value")}
    packed["turn_id"] = torch.full(dense.shape, -1, dtype=torch.long)
    for k in packed:
        packed[k][dense] = ep[k][ep["mask"]]
    for fn, extra in ((functional.token_gae, ()), (functional.turn_gae, ("turn_id",))):
        a, t = fn(
            ep["reward"],
            ep["value"],
            ep["mask"],
            *(ep[k] for k in extra),
            gamma=0.97,
            lmbda=0.9,
            bootstrap_value=boot,
        )
        pa, pt = fn(
            packed["reward"],
            packed["value"],
            dense,
            *(packed[k] for k in extra),
            gamma=0.97,
            lmbda=0.9,
            bootstrap_value=boot,
        )
        assert torch.allclose(a[ep["mask"]], pa[dense], atol=1e-12, rtol=0)
        assert torch.allclose(t[ep["mask"]], pt[dense], atol=1e-12, rtol=0)


def test_token_gae_carries_values_and_advantages_across_a_tool_span():
    """Hand-computed: the last token of turn 0 bootstraps from V at turn 1's first token; the tool
    tokens' values (garbage) and positions never enter; a per-turn penalty stays on turn 0."""
    #        pad  prompt turn0       tool          turn1
    mask = torch.tensor([[0, 0, 1, 1, 0, 0, 0, 1, 1]], dtype=torch.bool)
    reward = torch.tensor([[0.0, 0, 0, -0.5, 0, 0, 0, 0, 1.0]])
    value = torch.tensor([[7.0, 7, 0.2, 0.4, 99, 99, 99, 0.6, 0.8]])
    adv, tgt = functional.token_gae(reward, value, mask, gamma=1.0, lmbda=0.5)
    d8 = 1.0 - 0.8  # turn 1, last token: terminal
    d7 = 0.8 - 0.6
    d3 = -0.5 + 0.6 - 0.4  # turn 0's last token: V_next = V at turn 1's first token
    d2 = 0.4 - 0.2
    a8 = d8
    a7 = d7 + 0.5 * a8
    a3 = d3 + 0.5 * a7
    a2 = d2 + 0.5 * a3
    expected = torch.tensor([[0, 0, a2, a3, 0, 0, 0, a7, a8]])
    assert torch.allclose(adv, expected, atol=1e-6)
    assert torch.allclose(tgt, torch.where(mask, expected + value, 0.0), atol=1e-6)


def test_a_reward_on_a_tool_token_is_an_error():
    ep = _episodes(0, batch=3)
    tool = (~ep["mask"] & ep["attn"]).nonzero()
    row, col = (int(i) for i in tool[-1])
    ep["reward"][row, col] = 0.25
    msg = rf"1 non-zero reward\(s\) on masked tokens \(first at row {row}, position {col}"
    with pytest.raises(ValueError, match=rf"token_gae: {msg}"):
        functional.token_gae(ep["reward"], ep["value"], ep["mask"], gamma=1.0, lmbda=1.0)
    with pytest.raises(ValueError, match=rf"turn_gae: {msg}"):
        functional.turn_gae(
            ep["reward"], ep["value"], ep["mask"], ep["turn_id"], gamma=1.0, lmbda=1.0
        )


# ----------------------------------------------------------------------------- turn level
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("gamma,lmbda,critic_lmbda", HYPER)
@pytest.mark.parametrize("seed", range(4))
def test_turn_gae_matches_the_loop(seed, gamma, lmbda, critic_lmbda, dtype):
    ep = _episodes(seed + 10, dtype=dtype, id_gaps=seed % 2 == 0)
    boot = _bootstrap_loop(ep)
    for bootstrap in (None, boot.to(dtype)):
        adv, tgt = functional.turn_gae(
            ep["reward"],
            ep["value"],
            ep["mask"],
            ep["turn_id"],
            gamma=gamma,
            lmbda=lmbda,
            critic_lmbda=critic_lmbda,
            bootstrap_value=bootstrap,
        )
        ref_adv, ref_tgt = turn_loop(
            ep["reward"],
            ep["value"],
            ep["mask"],
            ep["turn_id"],
            gamma,
            lmbda,
            critic_lmbda,
            bootstrap,
        )
        assert adv.dtype == dtype and adv.shape == ep["reward"].shape
        assert _maxdiff(adv, ref_adv) <= TOL[dtype] * max(1.0, float(ref_adv.abs().max()))
        assert _maxdiff(tgt, ref_tgt) <= TOL[dtype] * max(1.0, float(ref_tgt.abs().max()))
        assert (adv[~ep["mask"]] == 0).all() and (tgt[~ep["mask"]] == 0).all()


def test_turn_gae_per_row_lambda_and_long_episodes():
    """Per-row lambdas, and 40 turns per row (the turn sequence goes through token_gae's blocks)."""
    ep = _episodes(3, batch=5, max_turns=40)
    lam = torch.tensor([0.0, 0.5, 0.9, 0.99, 1.0])
    boot = _bootstrap_loop(ep)
    adv, tgt = functional.turn_gae(
        ep["reward"],
        ep["value"],
        ep["mask"],
        ep["turn_id"],
        gamma=0.99,
        lmbda=lam,
        critic_lmbda=1.0,
        bootstrap_value=boot,
    )
    ref_adv, ref_tgt = turn_loop(
        ep["reward"], ep["value"], ep["mask"], ep["turn_id"], 0.99, lam, 1.0, boot
    )
    assert int(functional.count_turns(ep["mask"], ep["turn_id"]).max()) > 16
    assert _maxdiff(adv, ref_adv) < 1e-10 and _maxdiff(tgt, ref_tgt) < 1e-10


def test_turn_gae_hand_computed_and_one_token_turns_equal_token_gae():
    # prompt | turn 0 (3 tokens, penalty -0.5) | tool (2) | turn 2 (2 tokens, outcome 1) | pad
    mask = torch.tensor([[0, 1, 1, 1, 0, 0, 1, 1, 0]], dtype=torch.bool)
    turn_id = torch.tensor([[-1, 0, 0, 0, -1, -1, 2, 2, -1]])
    reward = torch.tensor([[0.0, 0, 0, -0.5, 0, 0, 0, 1.0, 0]])
    value = torch.tensor([[5.0, 0.3, 8, 8, 8, 8, 0.6, 8, 8]])  # only each turn's first value counts
    adv, tgt = functional.turn_gae(
        reward, value, mask, turn_id, gamma=0.9, lmbda=0.5, bootstrap_value=torch.tensor([2.0])
    )
    d1 = 1.0 + 0.9 * 2.0 - 0.6  # the last turn bootstraps (a truncated episode)
    d0 = -0.5 + 0.9 * 0.6 - 0.3
    a1, a0 = d1, d0 + 0.9 * 0.5 * d1
    assert torch.allclose(adv, torch.tensor([[0, a0, a0, a0, 0, 0, a1, a1, 0]]), atol=1e-6)
    exp_t = torch.tensor([[0, a0 + 0.3, a0 + 0.3, a0 + 0.3, 0, 0, a1 + 0.6, a1 + 0.6, 0]])
    assert torch.allclose(tgt, exp_t, atol=1e-6)
    # every trained token its own turn: one step per token, token_gae's numbers
    ep = _episodes(5, batch=6)
    own = torch.where(ep["mask"], ep["mask"].long().cumsum(-1), -1)
    a, t = functional.turn_gae(ep["reward"], ep["value"], ep["mask"], own, gamma=0.95, lmbda=0.8)
    ra, rt = functional.token_gae(ep["reward"], ep["value"], ep["mask"], gamma=0.95, lmbda=0.8)
    assert torch.allclose(a, ra, atol=1e-12) and torch.allclose(t, rt, atol=1e-12)


def test_turn_gae_edge_rows():
    """A row without trained tokens, an empty batch, and a turn id repeated across a tool span (one
    turn: one step, valued at its first token)."""
    mask = torch.tensor([[0, 0, 0, 0], [0, 1, 0, 1]], dtype=torch.bool)
    turn_id = torch.tensor([[-1, -1, -1, -1], [-1, 4, -1, 4]])
    reward = torch.tensor([[0.0, 0, 0, 0], [0, 0.5, 0, 1.0]])
    value = torch.tensor([[3.0, 3, 3, 3], [3, 0.25, 3, 0.75]])
    adv, tgt = functional.turn_gae(reward, value, mask, turn_id, gamma=1.0, lmbda=1.0)
    assert adv.tolist() == [[0, 0, 0, 0], [0, 1.25, 0, 1.25]]
    assert tgt.tolist() == [[0, 0, 0, 0], [0, 1.5, 0, 1.5]]
    none = torch.zeros(2, 4, dtype=torch.bool)
    a, t = functional.turn_gae(reward * 0, value, none, turn_id * 0 - 1, gamma=1.0, lmbda=1.0)
    assert a.abs().sum() == 0 and t.abs().sum() == 0
    e = torch.zeros(0, 3)
    a, t = functional.turn_gae(e, e, e.bool(), e.long(), gamma=1.0, lmbda=0.5)
    assert a.shape == (0, 3) and t.shape == (0, 3)


def test_turn_gae_errors_name_what_is_wrong():
    mask = torch.tensor([[0, 1, 1, 0, 1]], dtype=torch.bool)
    r = torch.zeros(1, 5)
    good = torch.tensor([[-1, 0, 0, -1, 1]])
    with pytest.raises(
        ValueError,
        match=r"turn_gae: turn_id is 0 at row 0, position 3, where loss_mask is False \(1 such "
        r"tokens\); turn_id must be -1 on prompt, tool/observation and padding tokens",
    ):
        functional.turn_gae(r, r, mask, torch.tensor([[-1, 0, 0, 0, 1]]), gamma=1.0, lmbda=1.0)
    with pytest.raises(
        ValueError, match=r"turn_id goes back from 1 to 0 at row 0, position 4; turn ids must be"
    ):
        functional.turn_gae(r, r, mask, torch.tensor([[-1, 0, 1, -1, 0]]), gamma=1.0, lmbda=1.0)
    with pytest.raises(
        ValueError, match=r"turn_id is -1 at row 0, position 2, a trained token \(loss_mask True\)"
    ):
        functional.turn_gae(r, r, mask, torch.tensor([[-1, 0, -1, -1, 1]]), gamma=1.0, lmbda=1.0)
    with pytest.raises(
        TypeError, match=r"turn_id must be an integer tensor .* got dtype torch.float32"
    ):
        functional.turn_gae(r, r, mask, good.float(), gamma=1.0, lmbda=1.0)
    with pytest.raises(ValueError, match=r"turn_id has shape \(1, 4\) but loss_mask has shape"):
        functional.turn_gae(r, r, mask, good[:, :4], gamma=1.0, lmbda=1.0)
    with pytest.raises(ValueError, match=r"turn_gae: gamma must be >= 0 and <= 1, got 1.5"):
        functional.turn_gae(r, r, mask, good, gamma=1.5, lmbda=1.0)
    with pytest.raises(ValueError, match=r"lmbda must be in \[0, 1\]"):
        functional.turn_gae(r, r, mask, good, gamma=1.0, lmbda=-0.1)
    with pytest.raises(ValueError, match=r"bootstrap_value must have shape \[B\]=\(1,\)"):
        functional.turn_gae(r, r, mask, good, gamma=1.0, lmbda=1.0, bootstrap_value=torch.zeros(2))
    with pytest.raises(ValueError, match=r"count_turns: turn_id goes back"):
        functional.count_turns(mask, torch.tensor([[-1, 3, 1, -1, 1]]))


# ----------------------------------------------------------------------------- TokenGAE
def _td(ep, *, turn_key="turn_id"):
    terminated = torch.zeros(ep["mask"].shape, dtype=torch.bool)
    pos = torch.arange(ep["mask"].shape[1])
    last = torch.where(ep["mask"], pos, -1).amax(-1)
    rows = torch.arange(ep["mask"].shape[0])
    terminated[rows, last.clamp_min(0)] = ~ep["truncated"]
    td = TensorDict(
        {
            "loss_mask": ep["mask"],
            "attention_mask": ep["attn"],
            "state_value": ep["value"].float().unsqueeze(-1),
            "next": {
                "reward": ep["reward"].float().unsqueeze(-1),
                "terminated": terminated.unsqueeze(-1),
                "done": torch.zeros_like(terminated).unsqueeze(-1),
                "state_value": ep["next_value"].float().unsqueeze(-1),
            },
        },
        ep["mask"].shape,
    )
    td.set(turn_key, ep["turn_id"])
    return td


@pytest.mark.parametrize("timestep", ["token", "turn"])
@pytest.mark.parametrize("bootstrap", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
def test_token_gae_module_on_multi_turn_rows(timestep, bootstrap, normalize):
    ep = _episodes(21, batch=12)
    ep = {k: v.float() if v.is_floating_point() else v for k, v in ep.items()}
    td = _td(ep)
    est = TokenGAE(
        gamma=0.99,
        lmbda=0.9,
        critic_lmbda=1.0,
        normalize_advantage=normalize,
        bootstrap_truncated=bootstrap,
        timestep=timestep,
    )
    out = est(td.clone())
    boot = _bootstrap_loop(ep) if bootstrap else None
    loop = token_loop if timestep == "token" else turn_loop
    args = (ep["reward"], ep["value"], ep["mask"])
    if timestep == "turn":
        args += (ep["turn_id"],)
    ref_adv, ref_tgt = loop(*args, 0.99, 0.9, 1.0, boot)
    if normalize:
        ref_adv = whiten_loop(ref_adv, ep["mask"])
    assert _maxdiff(out["advantage"].squeeze(-1), ref_adv) < 1e-4
    assert _maxdiff(out["value_target"].squeeze(-1), ref_tgt) < 1e-4
    assert (est.timestep, "turn_id" in est.in_keys) == (timestep, timestep == "turn")
    if bootstrap and timestep == "token":
        # rows ending on a tool output bootstrap from V after it, not after the last trained token
        tail = ep["attn"].long().cumsum(-1).argmax(-1) != torch.where(
            ep["mask"], torch.arange(ep["mask"].shape[1]), -1
        ).amax(-1)
        assert bool((tail & ep["truncated"]).any())


def test_token_gae_turn_mode_keys_adaptive_lambda_and_errors():
    ep = _episodes(2, batch=6)
    ep = {k: v.float() if v.is_floating_point() else v for k, v in ep.items()}
    td = _td(ep, turn_key=("mt", "turn"))
    est = TokenGAE(gamma=1.0, timestep="turn", adaptive_lmbda_alpha=0.5)
    with pytest.raises(
        KeyError,
        match=r"TokenGAE\(timestep='turn'\): missing key 'turn_id' \(int64 \[B, L\]: the turn index "
        r"on trained tokens, -1 elsewhere; the multi-turn env writes it",
    ):
        est(td.clone())
    est.set_keys(turn_id=("mt", "turn"))
    out = est(td.clone())
    turns = torch.tensor(
        [len(turns_of(m.tolist(), i.tolist())) for m, i in zip(ep["mask"], ep["turn_id"])]
    )
    assert torch.equal(functional.count_turns(ep["mask"], ep["turn_id"]), turns)
    lam = 1 - 1 / (0.5 * turns.double())  # VAPO's length-adaptive lambda over turns
    ref, _ = turn_loop(ep["reward"], ep["value"], ep["mask"], ep["turn_id"], 1.0, lam.clamp(0, 1))
    assert _maxdiff(out["advantage"].squeeze(-1), ref) < 1e-4
    bad = td.clone()
    bad["mt", "turn"][0, 0] = 0  # a prompt token
    plain = TokenGAE(timestep="turn")
    plain.set_keys(turn_id=("mt", "turn"))
    with pytest.raises(ValueError, match=r"turn_gae: turn_id is 0 at row 0, position 0"):
        plain(bad.clone())
    with pytest.raises(ValueError, match=r"count_turns: turn_id is 0 at row 0, position 0"):
        est(bad)
    boot = TokenGAE(bootstrap_truncated=True)
    del td["attention_mask"]
    with pytest.raises(
        KeyError, match=r"missing key 'attention_mask' \(bool \[B, L\], True on real"
    ):
        boot(td)
    with pytest.raises(
        ValueError, match=r"TokenGAE: timestep='episode' is not one of \['token', 'turn'\]"
    ):
        TokenGAE(timestep="episode")
    with pytest.raises(
        ValueError, match=r"config: algo.gae.timestep='steps' is not one of \['token', 'turn'\]"
    ):
        GAEConfig(timestep="steps").check("config: algo.gae.")
    assert check_gae_args()["timestep"] == "token"


def test_gae_config_builds_the_turn_estimator():
    est = make_advantage("gae", critic=True, gamma=1.0, timestep="turn")
    assert isinstance(est, TokenGAE) and est.timestep == "turn"
    assert (
        GAEConfig().timestep == "token" and make_advantage("gae", critic=True).timestep == "token"
    )
    with pytest.raises(ValueError, match=r"timestep='step' is not one of \['token', 'turn'\]"):
        make_advantage("gae", critic=True, timestep="step")


def test_build_trajectory_rows_through_turn_gae_and_nemo_reward_placement():
    """Samples -> build_trajectory (turn ids, outcome on the last trained token even when the episode
    ends with a tool output, as NeMo-RL's ``_build_token_level_rewards`` places it:
    ``L - 1 - argmax(flip(mask))``) -> TokenGAE per turn, equal to the loop."""
    seg = Segment
    samples = [
        Sample(
            [seg([5, 6]), seg([7, 8], True, turn=0), seg([9]), seg([10, 11, 12], True, turn=1)],
            reward=1.0,
        ),
        Sample(
            [
                seg([5]),
                seg([13], True, turn=0),
                seg([14, 15]),
                seg([16, 17], True, turn=1),
                seg([18]),
            ],
            reward=-1.0,
            finish_reason="length",  # cut by max_turns after the tool answered
        ),
        Sample([seg([4, 4, 4]), seg([19, 20, 21], True, turn=0)], reward=0.5),
    ]
    td = build_trajectory(samples, pad_token_id=0)
    mask = td["loss_mask"]
    nemo_last = mask.shape[1] - 1 - mask.fliplr().int().argmax(dim=1)  # NeMo-RL's placement
    reward = td["next", "reward"].squeeze(-1)
    assert torch.equal(reward.nonzero()[:, 1], nemo_last)
    assert reward[torch.arange(3), nemo_last].tolist() == [1.0, -1.0, 0.5]
    assert td["turn_id"][1].tolist() == [-1, -1, -1, 0, -1, -1, 1, 1, -1]  # pad, prompt, ..., tool
    g = torch.Generator().manual_seed(0)
    td["state_value"] = torch.randn(*td.shape, 1, generator=g)
    td["next", "state_value"] = torch.randn(*td.shape, 1, generator=g)
    out = TokenGAE(gamma=1.0, lmbda=0.95, timestep="turn", bootstrap_truncated=True)(td.clone())
    end = td["attention_mask"].long().cumsum(-1).argmax(-1)  # the last real token
    boot = torch.tensor([0.0, float(td["next", "state_value"][1, end[1], 0]), 0.0])
    ref, ref_t = turn_loop(
        reward, td["state_value"].squeeze(-1), mask, td["turn_id"], 1.0, 0.95, None, boot
    )
    assert _maxdiff(out["advantage"].squeeze(-1), ref) < 1e-5
    assert _maxdiff(out["value_target"].squeeze(-1), ref_t) < 1e-5


# ----------------------------------------------------------------------------- peers
def _verl_gae(reward, values, response_mask, gamma, lam):
    """verl compute_gae_advantage_return (core_algos.py, see the module docstring): backwards over
    every position; at a position with response_mask 0 (observation, padding) nextvalues and
    lastgaelam keep their values (the observation mask of #2337); returns = advantages + values;
    advantages whitened over response_mask (verl_F.masked_whiten)."""
    m = response_mask.to(values.dtype)
    nextvalues = torch.zeros(values.shape[0], dtype=values.dtype)
    lastgaelam = torch.zeros_like(nextvalues)
    out = []
    for t in reversed(range(values.shape[1])):
        delta = reward[:, t] + gamma * nextvalues - values[:, t]
        new = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * m[:, t] + (1 - m[:, t]) * nextvalues
        lastgaelam = new * m[:, t] + (1 - m[:, t]) * lastgaelam
        out.append(lastgaelam)
    adv = torch.stack(out[::-1], dim=1)
    returns = adv + values
    # verl_F.masked_whiten: mean = sum / (n + 1e-8), var = mean square * n / (n - 1), rsqrt(var + 1e-8)
    n = m.sum()
    mean = (adv * m).sum() / (n + 1e-8)
    var = (((adv - mean) ** 2) * m).sum() / (n + 1e-8) * (n / (n - 1))
    return (adv - mean) * torch.rsqrt(var + 1e-8), returns, adv


def _nemo_gae(scalar_reward, values, mask, gamma, lam, normalize):
    """NeMo-RL GeneralizedAdvantageEstimator.compute_advantage (advantage_estimator.py): the scalar
    reward goes on the last mask=1 position (``L - 1 - argmax(flip(mask))``), times mask; GAE with
    carry-forward masking; optional whitening (masked_mean / unbiased masked_var, rsqrt(var + 1e-8));
    advantages zeroed where mask is 0; returns = advantages + values."""
    m = mask.to(values.dtype)
    token_reward = torch.zeros_like(values)
    last = mask.shape[1] - 1 - mask.fliplr().int().argmax(dim=1)
    has = mask.any(dim=1)
    token_reward[has, last[has]] += scalar_reward[has]
    token_reward = token_reward * m
    next_values = torch.zeros(values.shape[0], dtype=values.dtype)
    last_gae = torch.zeros_like(next_values)
    out = []
    for t in reversed(range(values.shape[1])):
        delta = token_reward[:, t] + gamma * next_values - values[:, t]
        new = delta + gamma * lam * last_gae
        next_values = values[:, t] * m[:, t] + (1 - m[:, t]) * next_values
        last_gae = new * m[:, t] + (1 - m[:, t]) * last_gae
        out.append(last_gae)
    adv = torch.stack(out[::-1], dim=1)
    returns = adv + values
    if normalize:
        n = m.sum()
        mean = (adv * m).sum() / (n + 1e-8)
        var = (((adv - mean) ** 2) * m).sum() / (n + 1e-8) * (n / (n - 1))
        adv = (adv - mean) * torch.rsqrt(var + 1e-8)
    return adv.masked_fill(~mask, 0), returns


def _areal_token_gae(rewards, values, loss_mask, seq_no_eos, discount, lam):
    """AReaL _compute_token_level_gae (gae.py): index t is the step predicting token t + 1; the last
    column holds no step and its value, ``values[:, L-1] * seq_no_eos``, starts the recursion (the
    bootstrap of rows cut without EOS); masked steps keep nextvalues and lastgaelam."""
    bs, L = rewards.shape
    m = loss_mask.to(values.dtype)
    out = [torch.zeros(bs, dtype=values.dtype)]
    lastgaelam = torch.zeros(bs, dtype=values.dtype)
    nextvalues = values[:, L - 1] * seq_no_eos
    for t in reversed(range(L - 1)):
        delta = rewards[:, t] + discount * nextvalues - values[:, t]
        new = delta + discount * lam * lastgaelam
        nextvalues = nextvalues * (1 - m[:, t]) + values[:, t] * m[:, t]
        lastgaelam = lastgaelam * (1 - m[:, t]) + new * m[:, t]
        out.append(lastgaelam)
    adv = torch.stack(out[::-1], dim=1)
    return adv, adv + values


def _areal_turn_gae(rewards, values, loss_mask, turn_ids, seq_no_eos, discount, lam):
    """AReaL _compute_turn_level_gae (gae.py): per row, turn t's reward = scatter-sum of its tokens'
    rewards (indexed by the turn id itself, ids < L), its value = values at its first token
    (scatter amin of positions); a reversed loop over turn-id slots skips empty slots (carrying
    nextvalues and lastgaelam); nextvalues starts at ``values[:, L-1] * seq_no_eos``; advantages and
    returns (advantage + turn value) gathered back by turn id, advantage * loss_mask."""
    bs, L = rewards.shape
    valid = loss_mask.bool()
    ids = turn_ids.long().clamp(0, L - 1)
    turn_r = torch.zeros_like(rewards).scatter_add_(1, ids, rewards * valid.to(rewards.dtype))
    pos = torch.arange(L).expand(bs, -1)
    first = torch.full_like(ids, L).scatter_reduce_(
        1, ids, torch.where(valid, pos, L), reduce="amin", include_self=True
    )
    has = first < L
    turn_v = values.gather(1, first.clamp(max=L - 1)) * has.to(values.dtype)
    turn_a = torch.zeros(bs, L, dtype=values.dtype)
    lastgaelam = torch.zeros(bs, dtype=values.dtype)
    nextvalues = values[:, L - 1] * seq_no_eos
    for u in reversed(range(L)):
        delta = turn_r[:, u] + discount * nextvalues - turn_v[:, u]
        new = delta + discount * lam * lastgaelam
        turn_a[:, u] = torch.where(has[:, u], new, 0.0)
        nextvalues = torch.where(has[:, u], turn_v[:, u], nextvalues)
        lastgaelam = torch.where(has[:, u], new, lastgaelam)
    adv = turn_a.gather(1, ids) * loss_mask
    returns = (turn_a + turn_v).gather(1, ids)
    return adv, returns


def _to_areal(ep, boot):
    """Our layout -> AReaL's rolled one (actor.py: loss_mask, rewards and turn_ids rolled by -1,
    turn_ids[:, -1] = -1; values[t] = V(h[t]) = our state_value[t + 1]); the bootstrap sits in the
    last column, which never holds a step (column 0 is a prompt or padding token here)."""
    values = torch.cat([ep["value"][:, 1:], boot.unsqueeze(-1)], dim=1)
    turn = ep["turn_id"].roll(-1, dims=-1)
    turn[:, -1] = -1
    return {
        "rewards": ep["reward"].roll(-1, dims=-1),
        "values": values,
        "loss_mask": ep["mask"].roll(-1, dims=-1),
        "turn_ids": turn,
    }


@pytest.mark.parametrize("lam", [0.95, 1.0, 0.3])
@pytest.mark.parametrize("seed", range(3))
def test_peer_verl_carry_forward_across_observation_spans(seed, lam):
    ep = _episodes(seed + 30, batch=10)
    white, returns, raw = _verl_gae(ep["reward"], ep["value"], ep["mask"], 1.0, lam)
    m = ep["mask"]
    adv, tgt = functional.token_gae(ep["reward"], ep["value"], m, gamma=1.0, lmbda=lam)
    assert _maxdiff(adv[m], raw[m]) < 1e-12 and _maxdiff(tgt[m], returns[m]) < 1e-12
    td = _td({k: v.float() if v.is_floating_point() else v for k, v in ep.items()})
    out = TokenGAE(gamma=1.0, lmbda=lam, normalize_advantage=True)(td)
    assert _maxdiff(out["advantage"].squeeze(-1)[m], white[m]) < 1e-5


@pytest.mark.parametrize("normalize", [False, True])
def test_peer_nemo_rl_terminal_reward_placement(normalize):
    """Rows ending with an observation: NeMo-RL puts the scalar reward on the last assistant token,
    as build_trajectory does; its carry-forward GAE equals TokenGAE's."""
    ep = _episodes(41, batch=12)
    m = ep["mask"]
    outcome = torch.tensor([(-1.0) ** b * (b + 1) / 4 for b in range(12)], dtype=torch.float64)
    last = m.shape[1] - 1 - m.fliplr().int().argmax(dim=1)
    ours = torch.zeros_like(ep["reward"])
    ours[torch.arange(12), last] = outcome
    assert bool((ep["attn"].long().cumsum(-1).argmax(-1) > last).any())  # some end on a tool span
    adv, ret = _nemo_gae(outcome, ep["value"], m, 0.99, 0.95, normalize)
    td = _td({**ep, "reward": ours})
    out = TokenGAE(gamma=0.99, lmbda=0.95, normalize_advantage=normalize)(td)
    assert _maxdiff(out["advantage"].squeeze(-1), adv) < 2e-5
    assert _maxdiff(out["value_target"].squeeze(-1)[m], ret[m]) < 2e-5


@pytest.mark.parametrize("timestep", ["token", "turn"])
@pytest.mark.parametrize("lam", [0.95, 1.0, 0.5])
@pytest.mark.parametrize("seed", range(3))
def test_peer_areal_token_and_turn_mode(seed, lam, timestep):
    """AReaL's kernels on the rolled layout (truncated rows: seq_no_eos, bootstrap in the last
    column) equal ours shifted back by one; turn ids with gaps (AReaL: gaps consume no step)."""
    ep = _episodes(seed + 50, batch=10, id_gaps=True)
    boot = _bootstrap_loop(ep)
    a = _to_areal(ep, boot)
    no_eos = ep["truncated"].to(torch.float64)
    if timestep == "token":
        adv_a, ret_a = _areal_token_gae(
            a["rewards"], a["values"], a["loss_mask"], no_eos, 0.97, lam
        )
        adv, tgt = functional.token_gae(
            ep["reward"], ep["value"], ep["mask"], gamma=0.97, lmbda=lam, bootstrap_value=boot
        )
    else:
        adv_a, ret_a = _areal_turn_gae(
            a["rewards"], a["values"], a["loss_mask"], a["turn_ids"], no_eos, 0.97, lam
        )
        adv, tgt = functional.turn_gae(
            ep["reward"],
            ep["value"],
            ep["mask"],
            ep["turn_id"],
            gamma=0.97,
            lmbda=lam,
            bootstrap_value=boot,
        )
    m = ep["mask"]
    adv_a, ret_a = adv_a.roll(1, dims=-1), ret_a.roll(1, dims=-1)  # back to our layout
    assert _maxdiff(adv[m], adv_a[m]) < 1e-12 and _maxdiff(tgt[m], ret_a[m]) < 1e-12


# ----------------------------------------------------------------------------- GRPO / RLOO
@pytest.mark.parametrize("module", ["grpo", "rloo"])
def test_grpo_and_rloo_on_multi_turn_rows_with_per_turn_rewards(module):
    """One advantage per episode (the sum of its outcome and per-turn rewards) on every trained
    token of every turn; 0 on prompt, tool and padding tokens."""
    ep = _episodes(61, batch=8)
    group = torch.arange(8) // 4
    td = _td({k: v.float() if v.is_floating_point() else v for k, v in ep.items()})
    td["prompt_id"] = group.unsqueeze(-1).expand(td.shape).clone()
    per_turn = [(ep["reward"][b] != 0).sum() for b in range(8)]
    assert max(per_turn) >= 2  # some rows carry per-turn rewards besides the outcome
    est = GRPOAdvantage() if module == "grpo" else RLOOAdvantage()
    out = est(td)["advantage"].squeeze(-1)
    seq = ep["reward"].sum(-1)
    if module == "grpo":
        ref = grpo_loop(seq, group)
    else:
        ref = torch.tensor(
            [
                float(seq[i])
                - sum(float(seq[j]) for j in range(8) if j != i and group[j] == group[i]) / 3
                for i in range(8)
            ],
            dtype=torch.float64,
        )
    expected = torch.where(ep["mask"], ref.unsqueeze(-1), 0.0)
    assert _maxdiff(out, expected) < 1e-5
    assert (out[ep["attn"] & ~ep["mask"]] == 0).all()  # tool and prompt tokens


# ----------------------------------------------------------------------------- value alignment
def test_state_value_comes_from_the_state_before_each_token_in_every_turn():
    """LMActorCritic on a multi-turn row: ``state_value[t]`` is the value head on the hidden state
    at ``t - 1``, i.e. of the prefix ``tokens[:t]`` run alone (padding stripped) -- including the
    first token of a turn after a tool span, whose previous position is a tool token. The packed
    (padding-free) forward gives the same values."""
    ac = tiny_actor_critic(seed=2)
    torch.nn.init.normal_(ac.model.value_head.weight, std=0.2)
    torch.nn.init.normal_(ac.model.value_head.bias, std=0.2)
    #        pad pad | prompt (3) | turn 0 (2) | tool (3) | turn 1 (2) | tool (1) | turn 2 (1) | pad
    kinds = ["-", "-", "p", "p", "p", "t", "t", "o", "o", "o", "t", "t", "o", "t", "-"]
    row2 = ["p", "t", "t", "t", "o", "t", "t", "-", "-", "-", "-", "-", "-", "-", "-"]
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, VOCAB, (2, len(kinds)), generator=g)
    attn = torch.tensor([[k != "-" for k in kinds], [k != "-" for k in row2]])
    tokens = torch.where(attn, tokens, 0)
    loss_mask = torch.tensor([[k == "t" for k in kinds], [k == "t" for k in row2]])
    td = TensorDict({"tokens": tokens, "attention_mask": attn}, [2, len(kinds)])
    with torch.no_grad():
        out = ac(td.clone())
        packed = td.clone()
        packed.set_non_tensor(PACKED_KEY, True)
        packed = ac(packed)
    decoder, head = ac.model.get_decoder(), ac.model.value_head
    tool = attn & ~loss_mask & (loss_mask.long().cumsum(-1) > 0)  # real, untrained, after turn 0
    after_tool = loss_mask & torch.nn.functional.pad(tool, (1, 0))[:, :-1]
    assert after_tool.sum() == 3
    checked = 0
    for b in range(2):
        real = attn[b].nonzero().flatten().tolist()
        for t in real[1:]:
            prefix = tokens[b, real[0] : t].unsqueeze(0)
            with torch.no_grad():
                h = decoder(
                    input_ids=prefix,
                    attention_mask=torch.ones_like(prefix),
                    position_ids=torch.arange(prefix.shape[1]).unsqueeze(0),
                    use_cache=False,
                ).last_hidden_state
                v = head(h[0, -1]).squeeze()
            assert math.isclose(float(out["state_value"][b, t]), float(v), abs_tol=2e-5), (b, t)
            assert math.isclose(float(packed["state_value"][b, t]), float(v), abs_tol=2e-5)
            checked += int(loss_mask[b, t])
    assert checked == int(loss_mask.sum())
    # causality at a turn start after a tool span: its own token does not move its value, the tool
    # token before it does
    b, t = (int(i) for i in after_tool.nonzero()[0])
    for pos, moves in ((t, False), (t - 1, True)):
        other = td.clone()
        other["tokens"][b, pos] = 3 + (int(other["tokens"][b, pos]) - 2) % (VOCAB - 3)
        with torch.no_grad():
            v = ac(other)["state_value"][b, t, 0]
        assert (float(v) != float(out["state_value"][b, t, 0])) == moves
