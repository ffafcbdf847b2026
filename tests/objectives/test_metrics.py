"""ar_torchrl.objectives.metrics: each kind's statistics give the metric a plain loop computes over
the whole batch, however the tokens are split into micro-batches or ranks; undefined metrics are
left out, never logged as a huge number."""

from __future__ import annotations

import math

import pytest
import torch
from support.threaded_ranks import ThreadedRanks

from ar_torchrl.functional import masked_mean
from ar_torchrl.objectives import metrics

torch.set_num_threads(1)

EPS = metrics.EV_EPS


def _tokens(seed: int, n: int = 37):
    g = torch.Generator().manual_seed(seed)
    log_ratio = (torch.randn(1, n, generator=g) * 0.4).clamp(-20, 20)
    value = torch.randn(1, n, generator=g)
    target = value + torch.randn(1, n, generator=g) * 0.7 + 0.3
    return log_ratio, value, target


def _statistics(log_ratio, value, target, mask) -> metrics.Statistics:
    stats = metrics.ratio_statistics(log_ratio, mask, clip_low=0.2, clip_high=0.28)
    stats.update(metrics.critic_statistics(value, value * 0.9, target, mask, 0.2))
    return stats


def _loop(log_ratio, value, target) -> dict[str, float]:
    """The definitions of the metrics table, in Python floats over every token."""
    lr, v, r = log_ratio[0].tolist(), value[0].tolist(), target[0].tolist()
    ratio = [math.exp(x) for x in lr]
    n = len(ratio)

    def var(xs):
        m = sum(xs) / len(xs)
        return sum((x - m) ** 2 for x in xs) / len(xs)

    resid = [a - b for a, b in zip(r, v)]
    return {
        "mean_ratio": sum(ratio) / n,
        "max_ratio": max(ratio),
        "min_ratio": min(ratio),
        "ESS": sum(ratio) ** 2 / sum(x * x for x in ratio) / n,
        "kl_approx": -sum(lr) / n,
        "explained_variance": 1 - var(resid) / (var(r) + EPS),
        "explained_variance_finite": 1 - var(resid) / var(r),
    }


def _as_floats(stats: metrics.Statistics) -> dict:
    return {
        (k, n, leaf): float(t) for (k, n), leaves in stats.items() for leaf, t in leaves.items()
    }


def _single_process(parts, keys):
    return metrics.combine(parts, keys, lambda values, op="sum": dict(values))[0]


def _split(seed: int, n: int, pieces: int) -> list[torch.Tensor]:
    """``pieces`` disjoint masks over ``n`` tokens (some possibly empty), covering all of them."""
    owner = torch.randint(0, pieces, (n,), generator=torch.Generator().manual_seed(seed))
    return [(owner == i).unsqueeze(0) for i in range(pieces)]


@pytest.mark.parametrize("seed", range(4))
def test_finalize_is_the_table_over_one_batch(seed):
    log_ratio, value, target = _tokens(seed)
    mask = torch.ones_like(log_ratio, dtype=torch.bool)
    got = metrics.finalize(_statistics(log_ratio, value, target, mask))
    for key, want in _loop(log_ratio, value, target).items():
        assert got[key].item() == pytest.approx(want, rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("pieces", [1, 2, 5, 9])
def test_combine_over_any_split_is_the_whole_batch(seed, pieces):
    """Max/min, ESS and both explained variances from sums: independent of the split."""
    log_ratio, value, target = _tokens(seed)
    masks = _split(seed, log_ratio.shape[1], pieces)
    parts = [_as_floats(_statistics(log_ratio, value, target, m)) for m in masks]
    got = _single_process(parts, list(parts[0]))
    for key, want in _loop(log_ratio, value, target).items():
        assert got[key] == pytest.approx(want, rel=1e-5, abs=1e-6), key
    whole = torch.ones_like(masks[0])
    exact = _single_process(
        [_as_floats(_statistics(log_ratio, value, target, whole))], list(parts[0])
    )
    for key in ("max_ratio", "min_ratio"):
        assert got[key] == exact[key], key  # an extreme is exact
    for key in ("ESS", "explained_variance", "explained_variance_finite"):
        assert got[key] == pytest.approx(exact[key], rel=1e-12, abs=1e-12), key


def test_a_mean_is_the_count_weighted_mean_of_the_micro_batch_means():
    """``sum_i (n_i / N) m_i`` with float32 means ``m_i``: the arithmetic of the means logged
    before statistics existed, bit for bit."""
    log_ratio, value, target = _tokens(3)
    masks = _split(3, log_ratio.shape[1], 4)
    parts = [_as_floats(_statistics(log_ratio, value, target, m)) for m in masks]
    got = _single_process(parts, list(parts[0]))
    total = sum(float(m.sum()) for m in masks)
    want = 0.0
    for m in masks:
        if m.any():
            want += float(m.sum()) / total * float(masked_mean(-log_ratio, m))
    assert got["kl_approx"] == want


def test_constant_returns_leave_explained_variance_undefined_and_finite_variant_zero():
    """lambda = 1, every row failed: R = -1 everywhere. TorchRL's formula over that batch alone is
    -Var(V) / eps; whole-batch statistics say undefined (left out), the finite variant 0."""
    _, value, _ = _tokens(0)
    target = torch.full_like(value, -1.0)
    mask = torch.ones_like(value, dtype=torch.bool)
    stats = metrics.critic_statistics(value, value, target, mask, None)
    alone = metrics.finalize(stats)["explained_variance"].item()
    resid = (target - value)[0].double()
    assert (
        alone == pytest.approx(1 - resid.var(correction=0).item() / EPS, rel=1e-6) and alone < -1e5
    )
    got = _single_process([_as_floats(stats)], list(_as_floats(stats)))
    assert "explained_variance" not in got and got["explained_variance_finite"] == 0.0


def test_a_failed_micro_batch_does_not_drag_the_whole_batch():
    """The all-failed micro-batch's own EV is hugely negative; the mini-batch's is finite and is
    the whole batch's."""
    _, value, target = _tokens(5)
    n = value.shape[1]
    failed = torch.zeros(1, n, dtype=torch.bool)
    failed[0, :10] = True
    target = torch.where(failed, torch.full_like(target, -1.0), target)
    masks = [failed, ~failed]
    parts = [_as_floats(metrics.critic_statistics(value, value, target, m, None)) for m in masks]
    own = metrics.finalize(metrics.critic_statistics(value, value, target, failed, None))
    assert own["explained_variance"].item() < -1e4
    got = _single_process(parts, list(parts[0]))
    r, v = target[0].tolist(), value[0].tolist()
    mean_r = sum(r) / n
    var_r = sum((x - mean_r) ** 2 for x in r) / n
    e = [a - b for a, b in zip(r, v)]
    var_e = sum((x - sum(e) / n) ** 2 for x in e) / n
    assert got["explained_variance"] == pytest.approx(1 - var_e / (var_r + EPS), abs=1e-9)
    assert -1 < got["explained_variance"] < 1


def test_no_trained_token_defines_only_the_means():
    log_ratio, value, target = _tokens(1)
    empty = torch.zeros_like(log_ratio, dtype=torch.bool)
    stats = _statistics(log_ratio, value, target, empty)
    alone = metrics.finalize(stats)  # the loss alone: ratio statistics 1, the rest 0
    assert alone["max_ratio"].item() == alone["ESS"].item() == alone["mean_ratio"].item() == 1.0
    assert alone["explained_variance"].item() == alone["clip_fraction"].item() == 0.0
    got = _single_process([_as_floats(stats)], list(_as_floats(stats)))
    assert set(got) == {k for (kind, k) in stats if kind == "mean"}


@pytest.mark.parametrize("seed", range(3))
def test_ranks_combine_to_the_single_process_metrics(seed):
    log_ratio, value, target = _tokens(seed)
    masks = _split(seed, log_ratio.shape[1], 5)
    parts = [_as_floats(_statistics(log_ratio, value, target, m)) for m in masks]
    keys = list(parts[0])
    want = _single_process(parts, keys)
    ranks = ThreadedRanks(2)
    mine = [parts[:3], parts[3:]]
    results = ranks.run(lambda rank: metrics.combine(mine[rank], keys, ranks.reduce)[0])
    assert results[0] == results[1]
    assert set(results[0]) == set(want)
    for key, value_ in want.items():
        assert results[0][key] == pytest.approx(value_, rel=1e-12, abs=1e-12), key


# ----------------------------------------------------------------------------- critic health
def _critic_batch(seed: int, gamma_rewards: bool = True):
    """A [B, L] batch: prompts, responses with tool-token gaps, per-token shaping and outcomes."""
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed)
    rows, width = 7, 12
    mask = torch.zeros(rows, width, dtype=torch.bool)
    for b in range(rows):
        start, stop = 2 + b % 3, width - b % 4
        mask[b, start:stop] = torch.rand(stop - start, generator=g) < 0.8
    reward = torch.where(mask, 0.1 * torch.randn(rows, width, generator=g), 0.0)
    last = torch.where(mask, torch.arange(width), -1).amax(-1)
    outcome = torch.randint(0, 2, (rows,), generator=g).float() * 2 - 1
    for b in range(rows):
        reward[b, last[b]] += outcome[b]
    value = torch.randn(rows, width, 1, generator=g) * 0.5
    prompt_id = (torch.arange(rows) // 3).unsqueeze(-1).expand(rows, width)  # groups of 3, 3, 1
    td = TensorDict(
        {
            "loss_mask": mask,
            "state_value": value,
            "prompt_id": prompt_id,
            "next": {"reward": reward.unsqueeze(-1)},
        },
        [rows, width],
    )
    return td


def _health_loop(td, gamma):
    """critic_health's definitions, in Python floats."""
    mask, reward = td["loss_mask"], td["next", "reward"].squeeze(-1)
    value = td["state_value"].squeeze(-1)
    items = []  # (third, value, return, prompt) per trained token
    for b in range(mask.shape[0]):
        trained = [t for t in range(mask.shape[1]) if mask[b, t]]
        ret, returns = 0.0, {}
        for t in reversed(trained):
            ret = float(reward[b, t]) + gamma * ret
            returns[t] = ret
        for i, t in enumerate(trained):
            items.append(
                (3 * i // len(trained), float(value[b, t]), returns[t], int(td["prompt_id"][b, t]))
            )

    def stats(sel):
        v, r = [x[1] for x in sel], [x[2] for x in sel]
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        var = lambda xs: mean([(x - mean(xs)) ** 2 for x in xs])  # noqa: E731
        return v, r, 1 - var([a - b for a, b in zip(r, v)]) / var(r), var

    v, r, ev, var = stats(items)
    out = {
        "critic/explained_variance": ev,
        "critic/value_mean": sum(v) / len(v),
        "critic/value_std": math.sqrt(var(v)),
        "critic/return_mean": sum(r) / len(r),
        "critic/return_std": math.sqrt(var(r)),
    }
    for i, name in enumerate(("early", "middle", "late")):
        out[f"critic/explained_variance_{name}"] = stats([x for x in items if x[0] == i])[2]
    centred = []  # each prompt's token-mean of V and R removed
    for p in {x[3] for x in items}:
        group = [x for x in items if x[3] == p]
        mv, mr = (sum(x[k] for x in group) / len(group) for k in (1, 2))
        centred += [(x[0], x[1] - mv, x[2] - mr) for x in group]
    out["critic/explained_variance_within_prompt"] = stats(centred)[2]
    return out


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("gamma", [1.0, 0.95])
def test_critic_health_is_a_plain_loop_over_anchors_and_monte_carlo_returns(seed, gamma):
    td = _critic_batch(seed)
    got = metrics.critic_health(td, gamma)
    want = _health_loop(td, gamma)
    assert set(got) == set(metrics.CRITIC_HEALTH_KEYS) == set(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=1e-6), key


def test_critic_health_leaves_out_what_is_undefined_and_names_a_missing_key():
    td = _critic_batch(0)
    mask = td["loss_mask"]
    flat = td.clone()
    last = torch.where(mask, torch.arange(mask.shape[1]), -1).amax(-1)
    reward = torch.zeros(mask.shape)
    reward[torch.arange(mask.shape[0]), last] = -1.0  # every row failed: the returns do not vary
    flat["next", "reward"] = reward.unsqueeze(-1)
    got = metrics.critic_health(flat, 1.0)
    assert not any(k.startswith("critic/explained_variance") for k in got)
    assert got["critic/return_mean"] == -1.0 and got["critic/return_std"] == 0.0
    none = td.clone()
    none["loss_mask"] = torch.zeros_like(mask)
    none["next", "reward"] = torch.zeros_like(td["next", "reward"])
    assert metrics.critic_health(none, 1.0) == {}
    with pytest.raises(KeyError, match=r"critic_health: missing key 'state_value' \(the anchors"):
        metrics.critic_health(td.exclude("state_value"), 1.0)
    with pytest.raises(ValueError, match=r"'loss_mask' must be a bool \[B, L\] tensor"):
        metrics.critic_health(td.set("loss_mask", mask.float()), 1.0)


def test_critic_health_within_prompt_takes_a_row_id_and_is_absent_without_one():
    from tensordict import TensorDict

    td = _critic_batch(1)
    key = "critic/explained_variance_within_prompt"
    full = metrics.critic_health(td, 1.0)
    assert full[key] == pytest.approx(_health_loop(td, 1.0)[key], abs=1e-6)
    rows = td.batch_size[0]
    per_row = TensorDict(  # batch [B]: one prompt id per row
        {**td.exclude("prompt_id").to_dict(), "prompt_id": td["prompt_id"][:, 0]}, [rows]
    )
    assert metrics.critic_health(per_row, 1.0)[key] == pytest.approx(full[key], abs=1e-12)
    assert key not in metrics.critic_health(td.exclude("prompt_id"), 1.0)
    assert key not in metrics.critic_health(td, 1.0, group_key=None)
    bad = td.clone().set("prompt_id", torch.zeros(*td.batch_size, 3, dtype=torch.long))
    with pytest.raises(
        ValueError, match=r"'prompt_id' must be a group id per row \[B\] or per token"
    ):
        metrics.critic_health(bad, 1.0)
