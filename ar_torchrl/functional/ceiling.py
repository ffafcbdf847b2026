"""The explained-variance ceiling: how much of the return's variance a perfect critic could explain.

A critic ``V(s)`` that knew ``E[R | s]`` for every state ``s`` it is asked about reaches the
explained variance ``1 - E[(R - E[R | s])^2] / Var(R) = 1 - E[Var(R | s)] / Var(R)`` (the law of
total variance), and no critic of the same states can do better. Estimated from samples of a
frozen policy: group the items (trained tokens, or whole samples) by their state (the prompt plus
the response prefix, or the prompt alone), estimate ``Var(R | s)`` inside each group, and compare
with ``Var(R)``. A critic at EV 0 under a ceiling of 0.02 is optimal; under 0.5 it is broken.

Estimator (:func:`ev_ceiling`), over ``N`` items with returns ``R_i`` and states ``s_i``:

- ``Var(R) = sum_i (R_i - mean R)^2 / (N - 1)``;
- per state with ``n_s >= 2`` items, the unbiased within-state variance
  ``v_s = sum_{i in s} (R_i - mean_s R)^2 / (n_s - 1)``: the items of one state are independent
  draws of what follows it (each sample passes through a state at most once), so
  ``E[v_s] = Var(R | s)`` exactly;
- ``E[Var(R | s)] = sum_{n_s >= 2} n_s v_s / sum_{n_s >= 2} n_s`` (item-weighted, as a critic's
  explained variance weighs every trained token alike).

**Singletons.** A state seen once has no within-state variance estimate (its own mean fits it
exactly; counting it as 0 would credit the estimate with memorising the sample). Its items are
excluded from the within-state estimate and counted (``singletons``); ``Var(R)`` keeps every item.
The estimate is then unbiased for the tokens whose state was seen at least twice, and its bias is
the difference between the singletons' mean ``Var(R | s)`` and that of the other states. Singletons
are rare prefixes, mostly deep in a response after an unlikely token, where the outcome is usually
decided already (small ``Var(R | s)``): excluding them then overstates ``E[Var(R | s)]`` and the
reported ceiling is a lower estimate. More samples per prompt shrink the singleton share; quote it.

**Error.** Items are not independent (the tokens of one response share its outcome; the samples of
one prompt share its difficulty), so the standard error is a bootstrap over ``clusters`` (prompts:
the independent units), resampling whole clusters with their states. States must nest in clusters.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

__all__ = ["CeilingEstimate", "ev_ceiling", "ev_ceiling_within_groups", "prefix_state_ids"]


@dataclass(frozen=True)
class CeilingEstimate:
    """What :func:`ev_ceiling` found (see the module docstring for the definitions).

    Attributes:
        ceiling: ``1 - within_var / total_var`` (``nan`` when undefined: the returns do not vary,
            or no state was seen twice).
        stderr: bootstrap standard error over clusters (``nan`` without clusters or bootstraps).
        total_var: ``Var(R)`` over all items (Bessel-corrected).
        within_var: the item-weighted mean unbiased within-state variance (states seen >= 2 times).
        items: items (tokens or samples).
        states: distinct states.
        singletons: items whose state was seen once (left out of ``within_var``).
        clusters: distinct clusters (0 without clusters).
    """

    ceiling: float
    stderr: float
    total_var: float
    within_var: float
    items: int
    states: int
    singletons: int
    clusters: int

    def as_dict(self) -> dict:
        return asdict(self)


def _check_items(returns: Tensor, states: Tensor, clusters: Tensor | None) -> None:
    if returns.ndim != 1 or not returns.is_floating_point():
        raise ValueError(
            f"ev_ceiling: returns must be a 1-D float tensor [N], got shape {tuple(returns.shape)} "
            f"and dtype {returns.dtype}; flatten the trained tokens first (returns[loss_mask])"
        )
    for name, ids in (("states", states), ("clusters", clusters)):
        if ids is None:
            continue
        if ids.shape != returns.shape or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"ev_ceiling: {name} must be an integer tensor of the returns' shape "
                f"{tuple(returns.shape)}, got shape {tuple(ids.shape)} and dtype {ids.dtype}"
            )
    if returns.numel() < 2:
        raise ValueError(f"ev_ceiling: need at least 2 items, got {returns.numel()}")
    if not bool(torch.isfinite(returns).all()):
        bad = int((~torch.isfinite(returns)).nonzero()[0])
        raise ValueError(f"ev_ceiling: returns[{bad}] = {returns[bad].item()} is not finite")


def _state_stats(r: Tensor, inverse: Tensor, num: int) -> tuple[Tensor, Tensor]:
    """Per state: item count ``n_s`` and ``n_s * v_s`` (0 for singletons)."""
    n = torch.bincount(inverse, minlength=num).to(r.dtype)
    mean = torch.zeros(num, dtype=r.dtype).index_add_(0, inverse, r) / n
    ss = torch.zeros(num, dtype=r.dtype).index_add_(0, inverse, (r - mean[inverse]) ** 2)
    return n, torch.where(n >= 2, n * ss / (n - 1).clamp_min(1), torch.zeros_like(ss))


def ev_ceiling(
    returns: Tensor,
    states: Tensor,
    clusters: Tensor | None = None,
    *,
    bootstrap: int = 200,
    generator: torch.Generator | None = None,
) -> CeilingEstimate:
    """The explained-variance ceiling ``1 - E[Var(R | s)] / Var(R)`` of items grouped by state.

    Args:
        returns: ``[N]`` float, the Monte-Carlo return of each item (a trained token's return-to-go,
            or a sample's total reward).
        states: ``[N]`` int, the state of each item (equal ids = the same state), e.g.
            :func:`prefix_state_ids` at the trained tokens, or a prompt id per sample.
        clusters: ``[N]`` int, the independent unit of each item (the prompt) for the bootstrap
            standard error; every state must lie in one cluster. ``None``: no standard error.
        bootstrap: bootstrap replicates (0: no standard error).
        generator: RNG of the bootstrap.

    Returns:
        a :class:`CeilingEstimate` (float64 arithmetic; singletons as the module docstring says).

    Example:
        >>> r = torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0, -1.0])
        >>> est = ev_ceiling(r, torch.tensor([0, 0, 1, 1, 2, 2]), bootstrap=0)
        >>> round(est.ceiling, 3), round(est.within_var, 3), round(est.total_var, 3)
        (0.444, 0.667, 1.2)
        >>> ev_ceiling(r, torch.tensor([0, 1, 2, 3, 4, 4]), bootstrap=0).singletons
        4
    """
    _check_items(returns, states, clusters)
    r = returns.detach().to(torch.float64).cpu()
    uniq, inverse = torch.unique(states.cpu(), return_inverse=True)
    n, nv = _state_stats(r, inverse, len(uniq))
    shared = n >= 2
    within = float(nv.sum() / n[shared].sum()) if bool(shared.any()) else math.nan
    total = float(((r - r.mean()) ** 2).sum() / (len(r) - 1))
    spread = total > torch.finfo(torch.float64).eps * float((r * r).mean())
    ceiling = 1.0 - within / total if spread else math.nan
    stderr, num_clusters = math.nan, 0
    if clusters is not None:
        num_clusters = int(torch.unique(clusters).numel())
        if bootstrap > 0:
            stderr = _bootstrap_stderr(
                r, inverse, n, nv, clusters.cpu(), bootstrap=bootstrap, generator=generator
            )
    return CeilingEstimate(
        ceiling=ceiling,
        stderr=stderr,
        total_var=total,
        within_var=within,
        items=len(r),
        states=len(uniq),
        singletons=int((n == 1).sum()),
        clusters=num_clusters,
    )


def _state_clusters(inverse: Tensor, n: Tensor, cl_inverse: Tensor, owner: str) -> Tensor:
    """The cluster of each state (``inverse``: the state of each item, ``n``: items per state,
    ``cl_inverse``: the cluster of each item), checking that no state spans two clusters."""
    state_cluster = torch.full((len(n),), -1, dtype=torch.long)
    state_cluster[inverse] = cl_inverse
    spans = torch.zeros(len(n), dtype=torch.long).index_add_(0, inverse, cl_inverse)
    if not bool((spans == n.long() * state_cluster).all()):
        raise ValueError(
            f"{owner}: a state spans several clusters; clusters must group whole states "
            "(e.g. the prompt of each item, when states are prompt + response prefixes)"
        )
    return state_cluster


def _bootstrap_spread(c: int, bootstrap: int, generator, ceiling_of) -> float:
    """Standard deviation of ``ceiling_of(weights)`` over ``bootstrap`` resamplings of the ``c``
    clusters with replacement (``weights`` ``[bootstrap, c]``: how often each was drawn)."""
    draws = torch.randint(c, (bootstrap, c), generator=generator)
    weights = torch.zeros(bootstrap, c, dtype=torch.float64).scatter_add_(
        1, draws, torch.ones(bootstrap, c, dtype=torch.float64)
    )
    ceilings = ceiling_of(weights)
    ceilings = ceilings[torch.isfinite(ceilings)]
    return float(ceilings.std()) if len(ceilings) > 1 else math.nan


def _bootstrap_stderr(r, inverse, n, nv, clusters, *, bootstrap, generator) -> float:
    """Standard deviation of the ceiling over ``bootstrap`` resamplings of whole clusters."""
    cl_uniq, cl_inverse = torch.unique(clusters, return_inverse=True)
    c = len(cl_uniq)
    state_cluster = _state_clusters(inverse, n, cl_inverse, "ev_ceiling")
    shared = (n >= 2).to(r.dtype)

    def per_cluster(x: Tensor, index: Tensor) -> Tensor:
        return torch.zeros(c, dtype=r.dtype).index_add_(0, index, x)

    stats = torch.stack(
        [
            per_cluster(nv, state_cluster),  # n_s * v_s
            per_cluster(n * shared, state_cluster),  # their items
            per_cluster(torch.ones_like(r), cl_inverse),  # items
            per_cluster(r, cl_inverse),
            per_cluster(r * r, cl_inverse),
        ]
    )  # [5, C]

    def ceiling_of(weights: Tensor) -> Tensor:
        nv_w, n_w, count, s1, s2 = (weights @ stats.T).unbind(-1)
        total = (s2 - s1 * s1 / count) / (count - 1)
        return 1.0 - (nv_w / n_w) / total

    return _bootstrap_spread(c, bootstrap, generator, ceiling_of)


def ev_ceiling_within_groups(
    returns: Tensor,
    states: Tensor,
    groups: Tensor,
    samples: Tensor,
    *,
    bootstrap: int = 200,
    generator: torch.Generator | None = None,
) -> CeilingEstimate:
    """The ceiling of the explained variance *within* groups (prompts): ``1 - E[Var(R | s)] /
    E[Var(R | g)]``, the bound of :func:`~ar_torchrl.functional.explained_variance_within_groups`
    (what a critic can know beyond the prompt; states nest in groups).

    ``E[Var(R | s)]`` is :func:`ev_ceiling`'s (item-weighted, unbiased, singletons left out).
    ``E[Var(R | g)]`` (item-weighted) is estimated from each group's squared deviations from its own
    item mean, ``SS_g``, corrected for that mean having been estimated from its ``K_g`` independent
    samples: ``sum_g SS_g K_g / (K_g - 1) / sum_g N_g`` over the groups with ``K_g >= 2`` (exact in
    expectation when a group's samples have equal lengths and one return along each sample, the
    outcome-reward case; else approximate). The standard error is a bootstrap over groups.

    Args:
        returns: ``[N]`` float, the Monte-Carlo return of each item (trained token).
        states: ``[N]`` int, the state of each item (prompt + response prefix).
        groups: ``[N]`` int, the group (prompt) of each item; every state lies in one group
            (``ValueError`` otherwise).
        samples: ``[N]`` int, the sample (row) of each item: ``K_g`` counts distinct ones.
        bootstrap: bootstrap replicates (0: no standard error).
        generator: RNG of the bootstrap.

    Returns:
        a :class:`CeilingEstimate` whose ``total_var`` is ``E[Var(R | g)]``, ``clusters`` the groups.

    Example:
        >>> r = torch.tensor([1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0])  # 4 samples x 2 tokens
        >>> states = torch.tensor([0, 1, 0, 1, 0, 2, 0, 2])  # the second token reveals the outcome
        >>> groups, samples = torch.zeros(8, dtype=torch.long), torch.arange(8) // 2
        >>> est = ev_ceiling_within_groups(r, states, groups, samples, bootstrap=0)
        >>> round(est.ceiling, 3), round(est.within_var, 3), round(est.total_var, 3)
        (0.5, 0.667, 1.333)
    """
    _check_items(returns, states, groups)
    if samples.shape != returns.shape:
        raise ValueError(
            f"ev_ceiling_within_groups: samples must have the shape of returns "
            f"{tuple(returns.shape)}, got {tuple(samples.shape)}"
        )
    r = returns.detach().to(torch.float64).cpu()
    _, inverse = torch.unique(states.cpu(), return_inverse=True)
    n, nv = _state_stats(r, inverse, int(inverse.max()) + 1 if len(r) else 0)
    g_uniq, g_inv = torch.unique(groups.cpu(), return_inverse=True)
    c = len(g_uniq)

    def per_group(x: Tensor, index: Tensor) -> Tensor:
        return torch.zeros(c, dtype=torch.float64).index_add_(0, index, x)

    state_group = _state_clusters(inverse, n, g_inv, "ev_ceiling_within_groups")
    items = per_group(torch.ones_like(r), g_inv)
    mean = per_group(r, g_inv) / items
    ss = per_group((r - mean[g_inv]) ** 2, g_inv)
    pairs = torch.unique(torch.stack([g_inv, samples.cpu().long()]), dim=1)
    k = torch.bincount(pairs[0], minlength=c).to(torch.float64)
    usable = (k >= 2).to(torch.float64)
    stats = torch.stack(
        [
            per_group(nv, state_group),  # n_s v_s
            per_group(n * (n >= 2).to(torch.float64), state_group),  # their items
            usable * ss * k / (k - 1).clamp_min(1),  # SS_g K_g / (K_g - 1)
            usable * items,  # N_g
        ]
    )  # [4, C]

    def ratio(w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        nv_w, n_w, ss_w, items_w = (w @ stats.T).unbind(-1)
        within, total = nv_w / n_w, ss_w / items_w
        return 1.0 - within / total, within, total

    ceiling, within, total = (float(x) for x in ratio(torch.ones(1, c, dtype=torch.float64)))
    if not total > torch.finfo(torch.float64).eps * float((r * r).mean() if len(r) else 0.0):
        ceiling = math.nan
    stderr = math.nan
    if bootstrap > 0 and c > 1:
        stderr = _bootstrap_spread(c, bootstrap, generator, lambda w: ratio(w)[0])
    return CeilingEstimate(
        ceiling=ceiling,
        stderr=stderr,
        total_var=total,
        within_var=within,
        items=len(r),
        states=len(n),
        singletons=int((n == 1).sum()),
        clusters=c,
    )


def prefix_state_ids(tokens: Tensor, attention_mask: Tensor) -> Tensor:
    """An id for the state before each token: the attended tokens that precede it in its row.

    Two positions get the same id exactly when the sequences of attended tokens before them are
    equal (whatever the padding in front: rows are compared from their first attended token), so
    the trained tokens of different samples of one prompt share a state until their responses
    differ. A trie built one depth at a time (``torch.unique`` over ``(parent id, token)`` pairs).

    Args:
        tokens: ``[B, L]`` int64 token ids.
        attention_mask: ``[B, L]`` bool, the real tokens (prompt, response, tool tokens).

    Returns:
        ``[B, L]`` int64: the state id at attended positions (0 = the empty prefix), ``-1`` elsewhere.

    Example:
        >>> tokens = torch.tensor([[0, 5, 6, 7], [5, 6, 8, 0], [0, 5, 7, 7]])
        >>> mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0], [0, 1, 1, 1]]).bool()
        >>> ids = prefix_state_ids(tokens, mask)
        >>> ids[0, 3] == ids[1, 2], ids[0, 3] == ids[2, 3], ids[0, 0].item()
        (tensor(True), tensor(False), -1)
    """
    if tokens.ndim != 2 or attention_mask.shape != tokens.shape:
        raise ValueError(
            f"prefix_state_ids: tokens and attention_mask must both be [B, L], got "
            f"{tuple(tokens.shape)} and {tuple(attention_mask.shape)}"
        )
    if attention_mask.dtype != torch.bool:
        raise TypeError(
            f"prefix_state_ids: attention_mask must be bool, got {attention_mask.dtype}"
        )
    rows, width = tokens.shape
    depth = attention_mask.long().cumsum(-1) - 1  # index of each attended token in its sequence
    lengths = attention_mask.sum(-1)
    longest = int(lengths.max()) if rows else 0
    packed = torch.zeros(rows, longest, dtype=torch.long)
    r_idx, t_idx = attention_mask.nonzero(as_tuple=True)
    packed[r_idx, depth[r_idx, t_idx]] = tokens[r_idx, t_idx].long()
    node = torch.zeros(rows, longest + 1, dtype=torch.long)  # node[:, j]: the first j tokens
    next_id = 1
    for j in range(longest):
        live = lengths > j
        pairs = torch.stack([node[live, j], packed[live, j]], dim=1)
        uniq, inverse = torch.unique(pairs, dim=0, return_inverse=True)
        node[live, j + 1] = inverse + next_id
        next_id += len(uniq)
    out = torch.full((rows, width), -1, dtype=torch.long)
    out[r_idx, t_idx] = node[r_idx, depth[r_idx, t_idx]]
    return out
