"""The metrics of :class:`~ar_torchrl.objectives.TokenPPOLoss`: what each one measures, the
statistics it is computed from, and how those combine over the micro-batches (and ranks) of a
mini-batch.

**Definitions.** Every metric is reduced over the trained tokens ``T`` (``loss_mask``, and
``policy_mask`` for the policy's metrics when the batch has one; ``n = |T|``) and nothing else. A
name TorchRL's ``ClipPPOLoss`` or verl's ``core_algos.py`` also emits has *their* definition, with
``T`` as the sample batch (so a curve compares like with like); ours have names of their own. With
``lr = clamp(log pi - log pi_old, -20, 20)`` (``pi_old``: ``sample_log_prob``; the clamp is the
loss's, :data:`~ar_torchrl.functional.LOG_RATIO_CLAMP`), ``r = exp(lr)``, ``A`` the advantage,
``eps_low``/``eps_high`` the clip range, ``c`` the ``dual_clip``, ``V``/``V_old``/``R`` the new
value, ``state_value`` and ``value_target``, means over ``T``:

============================= ============================================== =================
name                          definition (over ``T``)                        defined as by
============================= ============================================== =================
``clip_fraction``             fraction with ``r`` outside                    TorchRL
                              ``[1 - eps_low, 1 + eps_high]`` (in log space:
                              ``lr`` outside ``[log1p(-eps_low),
                              log1p(eps_high)]``), whatever the sign of ``A``
``pg_clipfrac``               fraction where the clipped term is the larger  verl (and TRL)
                              loss: ``-A clip(r) > -A r`` (the clip is
                              active: the token's gradient is 0)
``pg_clipfrac_lower``         (``dual_clip`` only) fraction with ``A < 0``   verl
                              and ``max(-A r, -A clip(r)) > -c A`` (the
                              dual clip is active); disjoint from
                              ``pg_clipfrac``
``kl_approx``                 ``mean(-lr)`` (k1 estimate of KL(old || new))  TorchRL (= verl's
                                                                             ``ppo_kl``)
``mean_ratio``, ``max_ratio`` ``mean(r)``, ``max(r)``                        TorchRL
``ESS``                       ``(sum r)^2 / sum r^2 / n``                    TorchRL
                              ``= exp(2 logsumexp(lr) - logsumexp(2 lr)) / n``
``entropy``                   mean per-token entropy of the policy           TorchRL
``value_clip_fraction``       fraction with ``|V - V_old| > clip_value``     TorchRL
                              (0 without ``clip_value``)
``vf_clipfrac``               fraction with ``(clamp(V, V_old - clip_value,  verl (and TRL)
                              V_old + clip_value) - R)^2 > (V - R)^2`` (the
                              clipped value loss is used; 0 without
                              ``clip_value``)
``explained_variance``        ``1 - Var(R - V) / (Var(R) + eps)``,           TorchRL
                              population variances, ``eps`` the float32
                              machine epsilon (huge and negative when ``R``
                              is constant over ``T`` but ``V`` is not: then
                              it is *undefined* for :func:`combine`)
``explained_variance_finite`` ``1 - Var(R - V) / Var(R)``; for a constant    ours (as
                              ``R``: 1 if ``R - V`` is constant too, else 0  scikit-learn's
                              (:func:`~ar_torchrl.functional.                ``force_finite``)
                              explained_variance`), a curve to plot
``approx_kl``                 ``mean((r - 1) - lr)`` (k3, >= 0)              ours (as CleanRL)
``min_ratio``                 ``min(r)``                                     ours
``kl_ref``                    mean k3 KL to ``ref_log_prob``                 ours
``rollout_log_prob_abs_diff`` ``mean(|log pi - rollout_log_prob|)``          ours
``tis_weight_mean``           ``mean(min(w, tis_cap))``,                      ours
                              ``w = exp(sample_log_prob - rollout_log_prob)``
``tis_weight_capped``         fraction of tokens with ``w > tis_cap``        ours
``rollout_masked_tokens``,    (a rejection mask) fraction of trained tokens  ours (as verl's
``rollout_masked_seqs``       rejected; of rows with a rejected token        ``rollout_rs_*``)
``rollout_abs_log_ratio``     ``mean(|log pi_old - rollout_log_prob|)``      ours
``rollout_token_mult_prob_    ``mean(exp(|log pi_old - rollout_log_prob|))`` NeMo-RL
error``
``rollout_seq_ratio``         mean over rows of ``exp(sum(log pi_old -       ours
                              rollout_log_prob))``
``explained_variance_policy_  (with a ``policy_mask``) ``explained_variance``  ours
rows``                        over ``loss_mask & policy_mask``
``rollout_kl``                ``mean(rollout_log_prob - log pi_old)``        verl
                                                                             (``rollout_corr/kl``)
============================= ============================================== =================

With a ``policy_loss`` other than ``clip``, ``pg_clipfrac`` is what that loss reports as the
fraction of trained tokens whose gradient its clip changed (GSPO: the clipped branch is taken,
verl's definition; CISPO: the weight was clamped); every registered policy loss reports its clip
fractions this way (:mod:`ar_torchrl.objectives.policy_loss`), and the ratio metrics still
describe the token ratio ``pi / pi_old``. The tis_* weights are those of ``tis_cap`` or of the
rollout correction's ``is_level`` (``token`` or ``sequence``).

Where TorchRL's definitions are not met exactly: TorchRL does not clamp ``lr``, so its ratio
statistics differ once a trained token has ``|lr| > 20`` (its ``max_ratio`` then overflows to
``inf`` above ``lr = 88.7``; ours stay finite); TorchRL reduces ``ESS`` and
``explained_variance`` over the first batch dimension only (a ``[B, L]`` batch gives ``[L]``
vectors), ours treat the trained tokens as one flat batch; and a batch without trained tokens
gives 1 for the ratio statistics and 0 for the other metrics (TorchRL: ``nan``). ``kl_approx``,
``mean_ratio``, ``max_ratio`` and ``ESS`` describe ``pi / pi_old`` (TorchRL without
``delay_actor``): the ``tis_cap`` weight is not part of them. ``pg_clipfrac`` +
``pg_clipfrac_lower`` is the fraction of tokens with zero policy gradient from the clip.

**Statistics.** A mini-batch's metric is computed over the whole mini-batch (every micro-batch,
every rank), never as an average of per-micro-batch ratios (STYLE.md rule 14). The loss emits, per
metric, detached scalar statistics, grouped by *kind* (:data:`KINDS`) as ``{kind: {name: {leaf:
tensor}}}``:

===============================  =========================================  ==========================
kind                             leaves (over ``T`` of one micro-batch)     the metric of several
===============================  =========================================  ==========================
``mean``                         ``mean``, ``count``                        ``sum_i count_i mean_i /
                                                                            sum_i count_i`` (0 over
                                                                            no element)
``sum``                          ``sum``                                    the sum (the ``loss_*``
                                                                            terms, each normalised by
                                                                            the mini-batch already)
``max`` / ``min``                ``max`` / ``min``, ``count``               the extreme; undefined
                                                                            over no element
``ess``                          ``sum`` (of ``r``), ``sum_sq``, ``count``  ``(sum r)^2 / sum r^2 / n``
``explained_variance``,          ``count``, ``sum_target``,                 from the population
``explained_variance_finite``    ``sum_target_sq``, ``sum_residual``,       variances of ``R`` and
                                 ``sum_residual_sq`` (float64)              ``R - V``
===============================  =========================================  ==========================

A metric is *undefined* over a mini-batch when it has no element (``max``, ``min``, ``ess``,
``explained_variance*``), or, for ``explained_variance``, when the returns do not vary (its
``Var(R)`` is below ``eps`` times ``mean(R^2)``): :func:`combine` leaves it out, and
:func:`~ar_torchrl.training.ppo_update` averages each metric over the mini-batches that define it
(an iteration where none does logs no value for it). The loss called alone on one batch reports
every metric as the table defines it (ratio statistics 1 and the rest 0 over no trained token,
``explained_variance`` TorchRL's number for constant returns).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.utils import NestedKey
from torch import Tensor

from ar_torchrl import functional
from ar_torchrl.objectives._keys import require_key, squeeze_feature

__all__ = [
    "EV_EPS",
    "KINDS",
    "Statistics",
    "CRITIC_HEALTH_KEYS",
    "combine",
    "critic_health",
    "critic_statistics",
    "explained_variance_statistics",
    "finalize",
    "fraction",
    "mean",
    "mismatch_statistics",
    "output_statistics",
    "per_token_statistics",
    "ratio_statistics",
    "to_tensordict",
    "verl_clip_flags",
]

#: ``(kind, name) -> {leaf: detached scalar tensor}``, in the order the metrics are emitted.
Statistics = dict[tuple[str, str], dict[str, Tensor]]

#: TorchRL's ``eps`` in ``explained_variance`` (float32 returns), and the relative size below which
#: a variance counts as zero (:func:`~ar_torchrl.functional.explained_variance`'s rule).
EV_EPS = float(torch.finfo(torch.float32).eps)

#: ``(kind, name, leaf)``: one statistic, flattened.
FlatKey = tuple[str, str, str]
#: ``plan.reduce(values, op)``: the sum (or max, min) of ``values`` over ranks.
Reduce = Callable[..., dict[str, float]]


# --------------------------------------------------------------------------- statistics
def mean(values: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """The ``mean`` statistics of ``values`` over ``mask`` (``[B, L]`` or ``[B]``, same shapes).

    Example:
        >>> m = torch.tensor([[True, False, True]])
        >>> s = mean(torch.tensor([[1.0, 9.0, 2.0]]), m)
        >>> s["mean"].item(), s["count"].item()
        (1.5, 2)
    """
    return {"mean": functional.masked_mean(values.detach(), mask), "count": mask.sum()}


def fraction(flags: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """The ``mean`` statistics of the bool ``flags`` over ``mask``: the fraction of ``mask`` flagged.

    Example:
        >>> fraction(torch.tensor([True, True, False]), torch.tensor([True, False, True]))["mean"].item()
        0.5
    """
    return mean((flags & mask).float(), mask)


def ratio_statistics(
    log_ratio: Tensor, mask: Tensor, *, clip_low: float, clip_high: float
) -> Statistics:
    """TorchRL's ratio metrics (and ours) from the detached, clamped log-ratio ``lr`` ``[B, L]``.

    ``clip_fraction`` tests the band as TorchRL does, ``lr.clamp(log1p(-clip_low),
    log1p(clip_high)) != lr``; ``mean_ratio``, ``max_ratio``, ``min_ratio`` and ``ESS`` are over
    the trained tokens' ratios ``r = exp(lr)``.

    Example:
        >>> lr = torch.log(torch.tensor([[1.0, 2.0, 0.5]])); m = torch.tensor([[True, True, False]])
        >>> s = ratio_statistics(lr, m, clip_low=0.2, clip_high=0.2)
        >>> s[("mean", "clip_fraction")]["mean"].item(), s[("max", "max_ratio")]["max"].item()
        (0.5, 2.0)
    """
    low = torch.tensor(-clip_low, dtype=log_ratio.dtype, device=log_ratio.device).log1p()
    high = torch.tensor(clip_high, dtype=log_ratio.dtype, device=log_ratio.device).log1p()
    count = mask.sum()
    ratio = log_ratio[mask].exp()  # the trained tokens' ratios, in batch order
    some = count > 0
    one = torch.ones((), dtype=ratio.dtype, device=ratio.device)
    wide = ratio.double()
    return {
        ("mean", "clip_fraction"): fraction(log_ratio.clamp(low, high) != log_ratio, mask),
        ("mean", "kl_approx"): mean(-log_ratio, mask),
        ("mean", "mean_ratio"): {"mean": torch.where(some, ratio.mean(), one), "count": count},
        ("max", "max_ratio"): {"max": _extreme(ratio, "max"), "count": count},
        ("ess", "ESS"): {"sum": wide.sum(), "sum_sq": (wide * wide).sum(), "count": count},
        ("mean", "approx_kl"): mean(torch.expm1(log_ratio) - log_ratio, mask),
        ("min", "min_ratio"): {"min": _extreme(ratio, "min"), "count": count},
    }


def _extreme(values: Tensor, op: str) -> Tensor:
    """``values.max()`` / ``.min()`` of a 1-d tensor; over no element, the identity (-inf / inf)."""
    start = float("-inf") if op == "max" else float("inf")
    pad = torch.full((1,), start, dtype=values.dtype, device=values.device)
    return getattr(torch.cat([values, pad]), "amax" if op == "max" else "amin")()


def verl_clip_flags(
    ratio: Tensor,
    advantage: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> dict[str, Tensor]:
    """verl's clip indicators per token, bool ``[B, L]``: ``pg_clipfrac`` (and ``pg_clipfrac_lower``
    with ``dual_clip``); their means over ``mask`` are verl's metrics.

    verl's ``compute_policy_loss_vanilla``: ``pg_losses1 = -A r``, ``pg_losses2 = -A clip(r)``;
    ``pg_clipfrac`` counts ``pg_losses2 > pg_losses1``, ``pg_clipfrac_lower`` counts ``A < 0`` and
    ``max(pg_losses1, pg_losses2) > -c A``. ``ratio``: the loss's (clamped, detached) ratio.

    Example:
        >>> flags = verl_clip_flags(torch.tensor([[1.5, 1.0]]), torch.ones(1, 2),
        ...                         torch.ones(1, 2, dtype=torch.bool), clip_low=0.2, clip_high=0.2,
        ...                         dual_clip=None)
        >>> flags["pg_clipfrac"].tolist()
        [[True, False]]
    """
    adv = torch.where(mask, advantage, torch.zeros((), dtype=ratio.dtype, device=ratio.device))
    losses1 = -adv * ratio
    losses2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    flags = {"pg_clipfrac": (losses2 > losses1) & mask}
    if dual_clip is not None:
        flags["pg_clipfrac_lower"] = (
            (torch.maximum(losses1, losses2) > -adv * dual_clip) & (adv < 0) & mask
        )
    return flags


def per_token_statistics(values: Mapping[str, Tensor], mask: Tensor) -> Statistics:
    """``mean`` statistics over ``mask`` of per-token metrics ``[B, L]`` (bool: a fraction), such as
    a registered policy loss returns."""
    return {
        ("mean", name): fraction(x, mask) if x.dtype == torch.bool else mean(x, mask)
        for name, x in values.items()
    }


def explained_variance_statistics(value: Tensor, target: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """The float64 sums of ``R`` (``target``) and ``R - V`` over ``mask`` (``[B, L]`` each).

    Example:
        >>> s = explained_variance_statistics(torch.tensor([[0.0, 1.0]]), torch.tensor([[1.0, 3.0]]),
        ...                                   torch.ones(1, 2, dtype=torch.bool))
        >>> [s[k].item() for k in ("count", "sum_target", "sum_residual_sq")]
        [2, 4.0, 5.0]
    """
    zero = torch.zeros((), dtype=torch.float64, device=value.device)
    t = torch.where(mask, target.detach().double(), zero)
    resid = torch.where(mask, t - value.detach().double(), zero)
    return {
        "count": mask.sum(),
        "sum_target": t.sum(),
        "sum_target_sq": (t * t).sum(),
        "sum_residual": resid.sum(),
        "sum_residual_sq": (resid * resid).sum(),
    }


def critic_statistics(
    value: Tensor, old_value: Tensor, target: Tensor, mask: Tensor, clip_value: float | None
) -> Statistics:
    """TorchRL's, verl's and our critic metrics over ``mask`` (``[B, L]`` tensors, detached)."""
    zero = torch.zeros((), dtype=value.dtype, device=value.device)
    v, old, tgt = (torch.where(mask, x.detach(), zero) for x in (value, old_value, target))
    ev = explained_variance_statistics(v, tgt, mask)
    if clip_value is None:
        none = torch.zeros_like(mask)
        clip_frac, vf_clip = fraction(none, mask), fraction(none, mask)
    else:
        diff = v - old  # TorchRL's _clip_value_loss: pre_clipped != pre_clipped.clamp(-c, c)
        clip_frac = fraction(diff.clamp(-clip_value, clip_value) != diff, mask)
        v_clip = torch.max(torch.min(v, old + clip_value), old - clip_value)  # verl clip_by_value
        vf_clip = fraction((v_clip - tgt) ** 2 > (v - tgt) ** 2, mask)
    return {
        ("explained_variance_finite", "explained_variance_finite"): ev,
        ("mean", "value_clip_fraction"): clip_frac,
        ("mean", "vf_clipfrac"): vf_clip,
        ("explained_variance", "explained_variance"): dict(ev),
    }


def mismatch_statistics(
    log_prob: Tensor, old_log_prob: Tensor, rollout_log_prob: Tensor, mask: Tensor
) -> Statistics:
    """The drift of the new and the old log-probs from the engine's (``[B, L]`` each):
    ``rollout_log_prob_abs_diff`` and :func:`~ar_torchrl.functional.rollout_mismatch_metrics`."""
    stats: Statistics = {
        ("mean", "rollout_log_prob_abs_diff"): mean(
            (log_prob.detach() - rollout_log_prob).abs(), mask
        )
    }
    found = functional.rollout_mismatch_metrics(old_log_prob, rollout_log_prob, mask)
    return {**stats, **row_or_token_means(found, mask)}


#: Metrics of :mod:`ar_torchrl.functional.rollout_correction` that are means over rows (the rest:
#: over tokens).
ROW_MEANS = frozenset({"rollout_seq_ratio", "rollout_masked_seqs"})


def row_or_token_means(values: Mapping[str, Tensor], mask: Tensor) -> Statistics:
    """``mean`` statistics of metrics already averaged over ``mask``'s tokens, or over its rows with
    a trained token for the names in :data:`ROW_MEANS`."""
    tokens, rows = mask.sum(), mask.any(-1).sum()
    return {
        ("mean", name): {"mean": value.detach(), "count": rows if name in ROW_MEANS else tokens}
        for name, value in values.items()
    }


# --------------------------------------------------------------------------- finalising
def _defined(like: Tensor) -> Tensor:
    return torch.ones((), dtype=torch.bool, device=like.device)


def _mean_value(leaves: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
    return leaves["mean"], _defined(leaves["mean"])


def _sum_value(leaves: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
    return leaves["sum"], _defined(leaves["sum"])


def _extreme_value(op: str) -> Callable[[Mapping[str, Tensor]], tuple[Tensor, Tensor]]:
    def value(leaves: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
        some = leaves["count"] > 0  # over no token the ratio "did not move": 1
        return torch.where(some, leaves[op], torch.ones_like(leaves[op])), some

    return value


def _ess_value(leaves: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
    s, s2, n = leaves["sum"], leaves["sum_sq"], leaves["count"].to(leaves["sum"].dtype)
    some = n > 0
    ess = s * s / torch.where(some, s2, torch.ones_like(s2)) / n.clamp_min(1)
    return torch.where(some, ess, torch.ones_like(ess)), some


def _variances(leaves: Mapping[str, Tensor]) -> tuple[Tensor, ...]:
    """``Var(R)``, ``Var(R - V)`` (population) and whether each is flat (below ``EV_EPS`` times the
    mean square, so rounding in the sums of a constant does not count as spread)."""
    n = leaves["count"].to(leaves["sum_target"].dtype).clamp_min(1)
    sq_t, sq_r = leaves["sum_target_sq"] / n, leaves["sum_residual_sq"] / n
    var_t = (sq_t - (leaves["sum_target"] / n) ** 2).clamp_min(0)
    var_r = (sq_r - (leaves["sum_residual"] / n) ** 2).clamp_min(0)
    return var_t, var_r, var_t <= EV_EPS * sq_t, var_r <= EV_EPS * sq_r


def _torchrl_ev_value(leaves: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
    var_t, var_r, flat_t, _ = _variances(leaves)
    some = leaves["count"] > 0
    value = torch.where(some, 1.0 - var_r / (var_t + EV_EPS), torch.zeros_like(var_t))
    return value, some & ~flat_t


def _finite_ev_value(leaves: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
    var_t, var_r, flat_t, flat_r = _variances(leaves)
    some = leaves["count"] > 0
    ratio = var_r / torch.where(flat_t, torch.ones_like(var_t), var_t)
    value = torch.where(flat_t, flat_r.to(var_t.dtype), 1.0 - ratio)
    return torch.where(some, value, torch.zeros_like(value)), some


#: ``kind -> finaliser``: ``leaves -> (value, defined)``, scalar tensors (any device and dtype).
KINDS: dict[str, Callable[[Mapping[str, Tensor]], tuple[Tensor, Tensor]]] = {
    "mean": _mean_value,
    "sum": _sum_value,
    "max": _extreme_value("max"),
    "min": _extreme_value("min"),
    "ess": _ess_value,
    "explained_variance": _torchrl_ev_value,
    "explained_variance_finite": _finite_ev_value,
}


def finalize(stats: Statistics) -> dict[str, Tensor]:
    """Each metric of one batch from its statistics (on their device, no host read): ``name ->
    scalar``, as the table defines it even where :func:`combine` would call it undefined.

    Example:
        >>> m = torch.tensor([[True, True, False]])
        >>> stats = ratio_statistics(torch.tensor([[0.0, 0.1, 5.0]]), m, clip_low=0.2, clip_high=0.2)
        >>> out = finalize(stats)
        >>> round(out["max_ratio"].item(), 4), out["clip_fraction"].item()
        (1.1052, 0.0)
    """
    return {name: KINDS[kind](leaves)[0] for (kind, name), leaves in stats.items()}


def to_tensordict(stats: Statistics) -> TensorDict:
    """``stats`` as the nested TensorDict ``{kind: {name: {leaf: tensor}}}`` a loss output holds."""
    nested: dict[str, dict[str, dict[str, Tensor]]] = {}
    for (kind, name), leaves in stats.items():
        nested.setdefault(kind, {})[name] = dict(leaves)
    return TensorDict(nested, batch_size=[])


def output_statistics(out: TensorDictBase, count: Tensor) -> dict[FlatKey, Tensor]:
    """The flattened statistics of one loss output: its ``loss_*`` terms as ``sum``, and its own
    ``statistics`` entry, or, for a loss without one, each other scalar as a ``mean`` over
    ``count`` elements (the micro-batch's trained tokens)."""
    flat: dict[FlatKey, Tensor] = {}
    own = out.get("statistics", None)
    for key, value in out.items():
        if not isinstance(key, str) or not isinstance(value, Tensor) or value.numel() != 1:
            continue
        if key.startswith("loss_"):
            flat[("sum", key, "sum")] = value.detach()
        elif own is None:
            flat[("mean", key, "mean")], flat[("mean", key, "count")] = value.detach(), count
    if own is not None:
        for key, value in own.items(include_nested=True, leaves_only=True):
            flat[tuple(key)] = value
    return flat


# --------------------------------------------------------------------------- combining
def _name(key: FlatKey) -> str:
    return "/".join(key)


def _ordered_sum(values: Iterable[float]) -> float:
    total = 0.0
    for value in values:
        total += value
    return total


def combine(
    parts: Sequence[Mapping[FlatKey, float]],
    keys: Sequence[FlatKey],
    reduce: Reduce,
    extra: Mapping[str, float] | None = None,
) -> tuple[dict[str, float], dict[str, float]]:
    """The metrics of a mini-batch from its micro-batches' statistics (read to Python floats).

    Args:
        parts: this rank's micro-batches' statistics (padding passes left out).
        keys: every statistic's key (the same on every rank, also when ``parts`` is empty).
        reduce: ``plan.reduce``: sums (``op="max"``: maxima) over ranks; a single process returns
            its values.
        extra: more values to sum over ranks with the statistics (one collective).

    Returns:
        ``(metrics, extra)``: each *defined* metric (see the module docstring) and the reduced
        ``extra``. A ``mean`` is ``sum_i (count_i / N) mean_i`` over the micro-batches of every
        rank (``N = sum_i count_i``): the whole mini-batch's mean, with the arithmetic (float32
        micro-batch means, count-weighted in float64) of the ``train/`` means logged before
        statistics existed, so they did not change.
    """
    sums, extremes = {}, {}
    for key in keys:
        values = [p[key] for p in parts if key in p]
        kind, _, leaf = key
        if leaf in ("max", "min"):  # min as -max(-x): one collective for both
            sign = 1.0 if leaf == "max" else -1.0
            extremes[_name(key)] = max((sign * v for v in values), default=float("-inf"))
        elif not (kind == "mean" and leaf == "mean"):
            sums[_name(key)] = _ordered_sum(values)
    extra = dict(extra or {})
    summed = reduce({**sums, **{f"extra/{k}": v for k, v in extra.items()}})
    extremes = reduce(extremes, op="max") if extremes else {}
    means = reduce(_weighted_means(parts, keys, summed))
    leaves = _leaves(keys, summed, extremes, means)
    metrics = {}
    for (kind, name), values in leaves.items():
        value, defined = KINDS[kind](
            {k: torch.tensor(v, dtype=torch.float64) for k, v in values.items()}
        )
        if bool(defined):
            metrics[name] = float(value)
    return metrics, {k: summed[f"extra/{k}"] for k in extra}


def _weighted_means(
    parts: Sequence[Mapping[FlatKey, float]], keys: Sequence[FlatKey], summed: Mapping[str, float]
) -> dict[str, float]:
    """This rank's ``sum_i (count_i / N) mean_i`` of each ``mean`` (``N`` over every rank)."""
    out = {}
    for kind, name, leaf in keys:
        if kind != "mean" or leaf != "mean":
            continue
        total = summed[_name((kind, name, "count"))] or 1.0
        weighted = 0.0
        for p in parts:
            count = p.get((kind, name, "count"), 0.0)
            if count:  # an empty micro-batch adds nothing, whatever its mean holds
                weighted += count / total * p[(kind, name, leaf)]
        out[_name((kind, name, leaf))] = weighted
    return out


def _leaves(
    keys: Sequence[FlatKey], *reduced: Mapping[str, float]
) -> dict[tuple[str, str], dict[str, float]]:
    """``(kind, name) -> {leaf: value}`` from the reduced sums, extremes and means."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    for key in keys:
        kind, name, leaf = key
        value = next(r[_name(key)] for r in reduced if _name(key) in r)
        out.setdefault((kind, name), {})[leaf] = -value if leaf == "min" else value
    return out


# --------------------------------------------------------------------------- critic health
def _token_groups(group: Tensor, mask: Tensor, key: NestedKey) -> Tensor:
    """The group id of every trained token: ``group`` ``[B, L]`` (or ``[B, L, 1]``) at ``mask``, or
    a per-row ``[B]`` id repeated over the row's trained tokens."""
    if group.shape == (*mask.shape, 1):
        group = group.squeeze(-1)
    if group.shape == mask.shape:
        return group[mask]
    if group.shape == mask.shape[:1]:
        return group.unsqueeze(-1).expand(mask.shape)[mask]
    raise ValueError(
        f"critic_health: {key!r} must be a group id per row [B] or per token [B, L] "
        f"(loss_mask is {tuple(mask.shape)}), got shape {tuple(group.shape)}"
    )


#: What :func:`critic_health` logs (a key is absent where its value is undefined).
CRITIC_HEALTH_KEYS = (
    "critic/explained_variance",
    "critic/explained_variance_early",
    "critic/explained_variance_middle",
    "critic/explained_variance_late",
    "critic/explained_variance_within_prompt",
    "critic/value_mean",
    "critic/value_std",
    "critic/return_mean",
    "critic/return_std",
)


def critic_health(
    td: TensorDictBase,
    gamma: float,
    *,
    value_key: NestedKey = "state_value",
    reward_key: NestedKey = ("next", "reward"),
    mask_key: NestedKey = "loss_mask",
    group_key: NestedKey | None = "prompt_id",
) -> dict[str, float]:
    """Whether the critic *predicts*: its values of a fresh batch before training on it, against the
    Monte-Carlo return of every trained token of the whole batch (verl's ``critic/vf_explained_var``,
    out of sample; docs/design.md section 9).

    ``td`` is the batch after :func:`~ar_torchrl.training.recompute_old_log_probs_and_values` (its
    ``state_value`` are the anchors: with PopArt in return units, with a separate critic that
    critic's) and before the update. With ``R`` the Monte-Carlo return (``gamma``, ``lambda = 1``,
    along the trained tokens of each row, tool tokens consuming no step:
    :func:`~ar_torchrl.functional.monte_carlo_returns`) and ``V`` the anchors, over the trained
    tokens ``T`` (``loss_mask``, every row: critic-only rows included):

    - ``critic/explained_variance``: ``1 - Var(R - V) / Var(R)`` (population variances), absent
      when the returns do not vary (undefined; :func:`~ar_torchrl.functional.explained_variance_or_nan`);
    - ``critic/explained_variance_early|middle|late``: the same over the first, middle and last
      third of each row's trained tokens (:func:`~ar_torchrl.functional.position_thirds`, the thirds
      of the ceiling tool's ``by_position``);
    - ``critic/explained_variance_within_prompt``: the same after removing each prompt's mean from
      ``V`` and ``R`` (:func:`~ar_torchrl.functional.explained_variance_within_groups`, groups from
      ``group_key``): what the critic knows beyond the prompt. A critic that learned only how hard
      each prompt is scores 0 here however high ``critic/explained_variance`` is; above 0 it reads
      the response. Absent without ``group_key`` in ``td`` or when no prompt's returns vary (one
      sample per prompt with an outcome reward);
    - ``critic/value_mean``, ``critic/value_std``, ``critic/return_mean``, ``critic/return_std``:
      means and population standard deviations of ``V`` and ``R`` over ``T`` (absent over no token).

    Args:
        td: a ``[B, L]`` batch with ``value_key`` (``[B, L, 1]`` or ``[B, L]``), ``reward_key`` and
            ``mask_key`` (bool ``[B, L]``); ``group_key`` (int ``[B, L]`` or ``[B]``) if present.
        gamma: the discount (the recipe's ``algo.gamma``).

    Returns:
        ``{key: float}`` with the defined keys of :data:`CRITIC_HEALTH_KEYS`.

    Example:
        >>> mask = torch.tensor([[True, True], [True, True]])
        >>> td = TensorDict({"loss_mask": mask, "state_value": torch.tensor([[[0.5], [1.0]], [[0.0], [-1.0]]]),
        ...                  "next": {"reward": torch.tensor([[[0.0], [1.0]], [[0.0], [-1.0]]])}}, [2, 2])
        >>> out = critic_health(td, gamma=1.0)
        >>> out["critic/explained_variance"], out["critic/return_mean"]
        (0.703125, 0.0)
    """
    mask = require_key(td, mask_key, "critic_health", "bool [B, L], True on trained tokens")
    if mask.dtype != torch.bool or mask.ndim != 2:
        raise ValueError(
            f"critic_health: {mask_key!r} must be a bool [B, L] tensor, got shape "
            f"{tuple(mask.shape)} and dtype {mask.dtype}"
        )
    shape = mask.shape
    value = squeeze_feature(
        require_key(
            td, value_key, "critic_health", "the anchors (recompute_old_log_probs_and_values)"
        ),
        value_key,
        shape,
        "critic_health",
    )
    reward = squeeze_feature(
        require_key(td, reward_key, "critic_health", "per-token reward"),
        reward_key,
        shape,
        "critic_health",
    )
    returns = functional.monte_carlo_returns(reward, mask, gamma=gamma)
    thirds = functional.position_thirds(mask)
    values = {
        "critic/explained_variance": functional.explained_variance_or_nan(value, returns, mask)
    }
    for i, name in enumerate(("early", "middle", "late")):
        values[f"critic/explained_variance_{name}"] = functional.explained_variance_or_nan(
            value, returns, mask & (thirds == i)
        )
    if group_key is not None and group_key in td.keys(include_nested=True):
        values["critic/explained_variance_within_prompt"] = (
            functional.explained_variance_within_groups(
                value[mask], returns[mask], _token_groups(td.get(group_key), mask, group_key)
            )
        )
    if bool(mask.any()):
        v, r = value.detach().double()[mask], returns.double()[mask]
        values.update(
            {
                "critic/value_mean": v.mean(),
                "critic/value_std": v.std(unbiased=False),
                "critic/return_mean": r.mean(),
                "critic/return_std": r.std(unbiased=False),
            }
        )
    floats = dict(zip(values, torch.stack(list(values.values())).tolist()))  # one host read
    return {k: v for k, v in floats.items() if v == v}  # nan: undefined, not logged
