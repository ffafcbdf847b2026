"""The explained-variance ceiling (ar_torchrl.functional.ceiling): against plain loops, on a
synthetic policy whose ceilings are known in closed form, its standard error, and its errors."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from support.synthetic_policy import analytic_ceilings, sample_tree

from ar_torchrl.functional import ev_ceiling, ev_ceiling_within_groups, prefix_state_ids


# ----------------------------------------------------------------------------- plain references
def loop_ceiling(returns: list[float], states: list[int]) -> dict:
    """The module docstring's estimator, written out with dicts."""
    groups: dict[int, list[float]] = {}
    for r, s in zip(returns, states):
        groups.setdefault(s, []).append(r)
    mean = sum(returns) / len(returns)
    total = sum((r - mean) ** 2 for r in returns) / (len(returns) - 1)
    weighted, items = 0.0, 0
    for values in groups.values():
        if len(values) < 2:
            continue
        m = sum(values) / len(values)
        var = sum((v - m) ** 2 for v in values) / (len(values) - 1)
        weighted += len(values) * var
        items += len(values)
    within = weighted / items
    return {
        "ceiling": 1 - within / total,
        "total_var": total,
        "within_var": within,
        "states": len(groups),
        "singletons": sum(len(v) == 1 for v in groups.values()),
    }


def loop_prefixes(tokens: torch.Tensor, mask: torch.Tensor) -> list[list[tuple | None]]:
    """Per position: the tuple of attended tokens before it (None where not attended)."""
    out = []
    for row, m in zip(tokens.tolist(), mask.tolist()):
        seen: list[int] = []
        cells = []
        for t, attended in zip(row, m):
            cells.append(tuple(seen) if attended else None)
            if attended:
                seen.append(t)
        out.append(cells)
    return out


# ----------------------------------------------------------------------------- ev_ceiling
@pytest.mark.parametrize("seed", range(5))
def test_ev_ceiling_equals_the_plain_loop(seed):
    g = torch.Generator().manual_seed(seed)
    n = 300
    states = torch.randint(0, 60, (n,), generator=g)  # some states seen once (singletons)
    returns = states.double() / 30 + torch.randn(n, generator=g, dtype=torch.float64)
    est = ev_ceiling(returns.float(), states, bootstrap=0)
    ref = loop_ceiling(returns.float().double().tolist(), states.tolist())
    assert est.ceiling == pytest.approx(ref["ceiling"], rel=1e-9, abs=1e-12)
    assert est.total_var == pytest.approx(ref["total_var"], rel=1e-9)
    assert est.within_var == pytest.approx(ref["within_var"], rel=1e-9)
    assert (est.items, est.states, est.singletons) == (n, ref["states"], ref["singletons"])
    assert ref["singletons"] > 0 and math.isnan(est.stderr) and est.clusters == 0


def test_singletons_are_left_out_of_the_within_variance_and_counted():
    returns = torch.tensor([1.0, -1.0, 1.0, 1.0, 5.0, -7.0])
    est = ev_ceiling(returns, torch.tensor([0, 0, 1, 1, 2, 3]), bootstrap=0)
    # states 0 ({1, -1}: variance 2) and 1 ({1, 1}: 0), two items each; 5 and -7 are singletons
    assert est.within_var == pytest.approx((2 * 2.0 + 2 * 0.0) / 4)
    assert est.singletons == 2 and est.states == 4
    assert est.total_var == pytest.approx(float(returns.double().var()))


def test_undefined_ceilings_are_nan_never_a_huge_number():
    flat = ev_ceiling(torch.ones(6), torch.tensor([0, 0, 1, 1, 2, 2]), bootstrap=0)
    assert math.isnan(flat.ceiling) and flat.total_var == 0.0
    lonely = ev_ceiling(torch.tensor([1.0, -1.0, 1.0]), torch.tensor([0, 1, 2]), bootstrap=0)
    assert math.isnan(lonely.ceiling) and math.isnan(lonely.within_var) and lonely.singletons == 3


def test_a_perfectly_predictable_state_gives_ceiling_one_and_noise_zero():
    states = torch.arange(40) // 4  # 10 states of 4 items
    decided = ev_ceiling(states.float(), states, bootstrap=0)  # R is a function of the state
    assert decided.ceiling == pytest.approx(1.0) and decided.within_var == 0.0
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(40_000, generator=g)
    blind = ev_ceiling(noise, torch.zeros(40_000, dtype=torch.long), bootstrap=0)
    assert blind.ceiling == pytest.approx(0.0, abs=1e-9)  # one state: nothing to explain


# ----------------------------------------------------------------------------- the synthetic policy
@pytest.mark.parametrize("seed", [0, 1])
def test_recovers_the_closed_form_ceilings_of_a_bernoulli_tree(seed):
    """Token and prompt level within 3 bootstrap standard errors of the closed form."""
    truth = analytic_ceilings()
    assert truth["token"] == pytest.approx(0.6261, abs=1e-4)  # worked out in support/
    assert truth["prompt"] == pytest.approx(0.2972, abs=1e-4)
    g = torch.Generator().manual_seed(seed)
    s = sample_tree(128, 32, g)
    token = ev_ceiling(s["returns"], s["states"], s["clusters"], generator=g)
    prompt = ev_ceiling(s["sample_returns"], s["sample_prompts"], s["sample_prompts"], generator=g)
    assert token.clusters == prompt.clusters == 128 and token.items == 128 * 32 * 3
    assert 0 < token.stderr < 0.05 and 0 < prompt.stderr < 0.08
    assert abs(token.ceiling - truth["token"]) < 3 * token.stderr
    assert abs(prompt.ceiling - truth["prompt"]) < 3 * prompt.stderr


def test_the_bootstrap_standard_error_matches_the_spread_over_independent_draws():
    """Over 60 independent draws (40 prompts x 16 samples): the estimates centre on the closed
    form (bias < 0.02: singletons are few) and the bootstrap's standard error is the spread of the
    estimates within a factor 0.7-1.5 (the bootstrap also resamples the type mix, which the draws
    keep fixed, so it errs on the large side)."""
    truth = analytic_ceilings()
    g = torch.Generator().manual_seed(7)
    tokens, prompts, token_se, prompt_se = [], [], [], []
    for _ in range(60):
        s = sample_tree(40, 16, g)
        t = ev_ceiling(s["returns"], s["states"], s["clusters"], bootstrap=100, generator=g)
        p = ev_ceiling(s["sample_returns"], s["sample_prompts"], s["sample_prompts"], generator=g)
        tokens.append(t.ceiling)
        prompts.append(p.ceiling)
        token_se.append(t.stderr)
        prompt_se.append(p.stderr)
    for est, se, key in ((tokens, token_se, "token"), (prompts, prompt_se, "prompt")):
        spread = statistics.stdev(est)
        assert abs(statistics.mean(est) - truth[key]) < 0.02
        assert 0.7 < statistics.mean(se) / spread < 1.5, (key, statistics.mean(se), spread)


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("returns", "states", "clusters", "message"),
    [
        (torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.long), None, r"1-D float tensor \[N\]"),
        (torch.ones(3), torch.zeros(3), None, "states must be an integer tensor"),
        (torch.ones(3), torch.zeros(4, dtype=torch.long), None, r"got shape \(4,\)"),
        (torch.ones(1), torch.zeros(1, dtype=torch.long), None, "need at least 2 items, got 1"),
        (
            torch.tensor([1.0, float("nan")]),
            torch.zeros(2, dtype=torch.long),
            None,
            r"returns\[1\] = nan is not finite",
        ),
        (
            torch.tensor([1.0, -1.0, 1.0]),
            torch.tensor([0, 0, 1]),
            torch.tensor([0, 1, 1]),
            "a state spans several clusters",
        ),
    ],
)
def test_bad_input_names_what_was_received(returns, states, clusters, message):
    with pytest.raises(ValueError, match=message):
        ev_ceiling(returns, states, clusters)


# ----------------------------------------------------------------------------- prefix_state_ids
@pytest.mark.parametrize("seed", range(4))
def test_prefix_state_ids_equal_exactly_when_the_prefixes_are_equal(seed):
    g = torch.Generator().manual_seed(seed)
    rows, width = 24, 9
    tokens = torch.randint(3, 6, (rows, width), generator=g)  # 3 symbols: many shared prefixes
    start = torch.randint(0, 3, (rows, 1), generator=g)  # left padding
    stop = torch.randint(5, width + 1, (rows, 1), generator=g)  # right padding
    pos = torch.arange(width)
    mask = (pos >= start) & (pos < stop)
    tokens = torch.where(mask, tokens, torch.zeros_like(tokens))
    ids = prefix_state_ids(tokens, mask)
    prefixes = loop_prefixes(tokens, mask)
    cells = [(b, t) for b in range(rows) for t in range(width)]
    for b, t in cells:
        assert (ids[b, t] == -1) == (prefixes[b][t] is None)
    attended = [(b, t) for b, t in cells if prefixes[b][t] is not None]
    by_prefix: dict[tuple, int] = {}
    for b, t in attended:
        assert by_prefix.setdefault(prefixes[b][t], int(ids[b, t])) == int(ids[b, t])
    assert len(set(by_prefix.values())) == len(by_prefix)  # distinct prefixes, distinct ids


def test_prefix_state_ids_ignore_padding_and_see_tool_tokens():
    # rows 0 and 1: the same prompt under different left padding; row 2 differs in a tool token
    tokens = torch.tensor([[0, 0, 7, 8, 9, 4], [0, 7, 8, 9, 4, 5], [0, 7, 8, 6, 4, 5]])
    mask = tokens != 0
    ids = prefix_state_ids(tokens, mask)
    assert ids[0, 5] == ids[1, 4]  # 7 8 9 before both
    assert ids[1, 5] != ids[2, 5]  # 7 8 9 4 vs 7 8 6 4
    assert ids[0, 2].item() == ids[1, 1].item() == 0  # the empty prefix


def test_prefix_state_ids_bad_input():
    with pytest.raises(ValueError, match=r"both be \[B, L\], got \(2, 3\) and \(2, 4\)"):
        prefix_state_ids(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="attention_mask must be bool, got torch.int64"):
        prefix_state_ids(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long))


# ----------------------------------------------------------------------------- within groups
def loop_within_ceiling(returns, states, groups, samples) -> float:
    """ev_ceiling_within_groups' estimator with dicts: the state part as loop_ceiling, the group
    part from each group's squared deviations times K_g / (K_g - 1)."""
    within = loop_ceiling(returns, states)["within_var"]
    by_group: dict[int, list[tuple[float, int]]] = {}
    for r, g, s in zip(returns, groups, samples):
        by_group.setdefault(g, []).append((r, s))
    ss_total, items = 0.0, 0
    for members in by_group.values():
        k = len({s for _, s in members})
        if k < 2:
            continue
        mean = sum(r for r, _ in members) / len(members)
        ss_total += sum((r - mean) ** 2 for r, _ in members) * k / (k - 1)
        items += len(members)
    return 1 - within / (ss_total / items)


@pytest.mark.parametrize("seed", range(4))
def test_ev_ceiling_within_groups_equals_the_plain_loop(seed):
    g = torch.Generator().manual_seed(seed)
    rows, tokens = 24, 4
    group = torch.arange(rows) // 4 + 10 * (seed % 2)  # 6 prompts x 4 samples, ids shifted
    group[-1] = 99  # a prompt with one sample: left out of E[Var(R | g)]
    first = torch.randint(0, 2, (rows,), generator=g)  # the first step, shared within a prompt
    outcome = torch.where(torch.rand(rows, generator=g) < 0.3 + 0.4 * first, 1.0, -1.0)
    returns = outcome[:, None].expand(rows, tokens).reshape(-1)
    # states: prompt; prompt + first step; then unique (singletons) after the outcome is written
    depth = torch.arange(tokens).expand(rows, tokens)
    states = torch.where(
        depth == 0,
        group[:, None] * 1000,
        torch.where(
            depth == 1,
            group[:, None] * 1000 + 1 + first[:, None],
            10**6 + torch.arange(rows * tokens).view(rows, tokens),
        ),
    ).reshape(-1)
    groups = group[:, None].expand(rows, tokens).reshape(-1)
    samples = torch.arange(rows)[:, None].expand(rows, tokens).reshape(-1)
    est = ev_ceiling_within_groups(returns, states, groups, samples, generator=g)
    want = loop_within_ceiling(returns.tolist(), states.tolist(), groups.tolist(), samples.tolist())
    assert est.ceiling == pytest.approx(want, abs=1e-9)
    assert est.clusters == 7 and 0 < est.stderr < 1


def test_ev_ceiling_within_groups_bad_input():
    r = torch.zeros(4)
    ids = torch.arange(4)
    with pytest.raises(
        ValueError, match=r"ev_ceiling_within_groups: a state spans several clusters"
    ):
        ev_ceiling_within_groups(r, torch.zeros(4, dtype=torch.long), ids % 2, ids, bootstrap=0)
    with pytest.raises(
        ValueError, match=r"samples must have the shape of returns \(4,\), got \(3,\)"
    ):
        ev_ceiling_within_groups(
            r,
            torch.zeros(4, dtype=torch.long),
            torch.zeros(4, dtype=torch.long),
            torch.zeros(3, dtype=torch.long),
        )
