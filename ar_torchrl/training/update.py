"""One PPO update over a rollout batch: epochs x mini-batches x micro-batches, with NaN/inf skipping.

The micro-batches are those of the :class:`~ar_torchrl.data.MicroBatchPlan` that computed the
old log-probs and values, so at unchanged weights the first forward reproduces ``sample_log_prob`` and
``state_value`` exactly (docs/design.md section 4). Each epoch shuffles the micro-batches and groups them
into ``num_minibatches`` mini-batches; a mini-batch accumulates the gradients of its micro-batches,
each loss divided by the mini-batch's *global* normaliser, so the accumulated gradient equals the
gradient of one big batch. A mini-batch whose loss or gradient norm is not finite is skipped (no
optimizer step, gradients dropped) and counted in ``train/skipped_steps``: nothing is silently lost.

Metrics are those of each whole mini-batch (STYLE.md rule 14): the loss's statistics
(:mod:`ar_torchrl.objectives.metrics`) stay on the device during the passes, are read to the host
once per optimizer step with the finiteness flags and gradient norms, summed (or maxed) over the
micro-batches and the ranks, and finalised; ``train/<metric>`` is then the mean over the
mini-batches that define the metric.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey
from torch import nn

from ar_torchrl.objectives.metrics import combine, output_statistics
from ar_torchrl.training.micro_batch import Plan
from ar_torchrl.utils.checks import check_ppo_update_args

__all__ = ["lr_schedule_factor", "ppo_update", "total_loss"]

logger = logging.getLogger(__name__)


def total_loss(out: TensorDictBase, loss_keys: Sequence[str] | None = None) -> torch.Tensor:
    """Sum of the ``loss_*`` entries of a loss output (or of ``loss_keys`` only).

    Example:
        >>> from tensordict import TensorDict
        >>> out = TensorDict({"loss_objective": torch.tensor(1.0), "loss_critic": torch.tensor(2.0),
        ...                   "clip_fraction": torch.tensor(0.5)}, [])
        >>> total_loss(out).item(), total_loss(out, ["loss_critic"]).item()
        (3.0, 2.0)
    """
    keys = [k for k in out.keys() if isinstance(k, str) and k.startswith("loss_")]
    if loss_keys is not None:
        missing = sorted(set(loss_keys) - set(keys))
        if missing:
            raise KeyError(f"total_loss: loss output has no {missing}; it has {sorted(keys)}")
        keys = list(loss_keys)
    if not keys:
        raise KeyError(f"total_loss: no 'loss_*' entries in {sorted(out.keys())}")
    return sum(out[k] for k in keys)


def lr_schedule_factor(
    step: int,
    total: int,
    *,
    schedule: str = "constant",
    warmup: int = 0,
    min_ratio: float = 0.0,
) -> float:
    """The learning-rate factor at iteration ``step`` (1-based) of ``total``, a function of the
    step alone (a resumed run continues it exactly).

    Warm-up: ``step / warmup`` for ``step <= warmup``. Then, with ``p`` going from 0 at
    ``step = warmup + 1`` to 1 at ``step = total``: ``constant`` 1, ``linear``
    ``1 - (1 - min_ratio) p``, ``cosine`` ``min_ratio + (1 - min_ratio) (1 + cos(pi p)) / 2``.

    Example:
        >>> [round(lr_schedule_factor(s, 5, schedule="linear", warmup=2), 3) for s in range(1, 6)]
        [0.5, 1.0, 1.0, 0.5, 0.0]
    """
    if schedule not in ("constant", "linear", "cosine"):
        raise ValueError(
            f"lr_schedule_factor: schedule must be constant, linear or cosine, got {schedule!r}"
        )
    if warmup and step <= warmup:
        return step / warmup
    if schedule == "constant":
        return 1.0
    progress = min(max((step - warmup - 1) / max(total - warmup - 1, 1), 0.0), 1.0)
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _minibatch_step(
    loss_fn: Callable,
    optimizer: torch.optim.Optimizer,
    micro: list[tuple[TensorDictBase, bool]],
    *,
    normalizer: Callable[[list[TensorDictBase]], object],
    params: dict[str, list[nn.Parameter]],
    trainable: set[int] | None,
    grad_clip: float | None,
    loss_keys: Sequence[str] | None,
    mask_key: NestedKey,
    plan: Plan,
) -> tuple[dict[str, float], bool]:
    """Accumulate gradients over ``micro`` (``(td, is_padding)`` pairs); step unless not finite.

    Every pass runs, also after a non-finite loss (data parallel: every rank must run the same
    backward passes); the loss's finiteness, the gradient norms and the metrics' statistics are
    read to the host once, after the last pass, and (``plan.reduce``) combined over ranks, so the
    ranks agree on skipping the step and the metrics are those of the whole mini-batch
    (:func:`~ar_torchrl.objectives.metrics.combine`).
    """
    optimizer.zero_grad(set_to_none=True)
    norm = _normalizer(normalizer, micro, plan)
    parts: list[tuple[dict, bool]] = []
    nonfinite: list[torch.Tensor] = []
    for mb, pad in micro:
        out = loss_fn(mb, normalizer=norm)
        loss = total_loss(out, loss_keys)
        if pad:  # a padding pass: FSDP's collectives run, the gradient gets exactly nothing
            loss = loss * 0.0
        nonfinite.append(~torch.isfinite(loss.detach()))
        loss.backward()
        parts.append((output_statistics(out, mb.get(mask_key).sum()), pad))
    if trainable is not None:
        for p in (p for group in params.values() for p in group):
            if id(p) not in trainable:
                p.grad = None
    norms = {name: _grad_norm(group, grad_clip) for name, group in params.items()}
    metrics, bad, norms = _read_and_combine(parts, nonfinite, norms, plan)
    if bad or not all(math.isfinite(norm) for norm in norms.values()):
        optimizer.zero_grad(set_to_none=True)
        return {}, False
    optimizer.step()
    for name, norm in norms.items():
        metrics[f"grad_norm_{name}" if name else "grad_norm"] = norm
    return metrics, True


def _normalizer(
    normalizer: Callable[[list[TensorDictBase]], object],
    micro: list[tuple[TensorDictBase, bool]],
    plan: Plan,
) -> object:
    """The mini-batch's global normaliser (summed over ranks when the plan spans them)."""
    real = [mb for mb, pad in micro if not pad]
    if real:
        norm = normalizer(real)
    else:  # only padding passes on this rank: a zero of the normaliser's form (scalar or dict)
        norm = _zero_like(normalizer([mb for mb, _ in micro]))
    if not plan.spans_ranks:
        return norm
    parts = norm if isinstance(norm, dict) else {"": norm}  # a dict is reduced per entry
    total = plan.reduce({f"norm/{key}": float(v) for key, v in parts.items()})
    reduced = {key: total[f"norm/{key}"] for key in parts}
    return reduced if isinstance(norm, dict) else reduced[""]


def _zero_like(norm: object) -> object:
    if isinstance(norm, dict):
        return {key: 0.0 for key in norm}
    return 0.0


def _read_and_combine(
    parts: list[tuple[dict, bool]],
    nonfinite: list[torch.Tensor],
    norms: dict[str, object],
    plan: Plan,
) -> tuple[dict[str, float], bool, dict[str, float]]:
    """One host read of every statistic (``(statistics, is_padding)`` per pass), loss flag and
    gradient norm: the mini-batch's metrics, whether a pass was not finite (on any rank), and the
    norms as floats. A padding pass's statistics are not read; its keys count (a rank may have
    only padding passes, and every rank reduces the same keys)."""
    keys = list(dict.fromkeys(k for stats, _ in parts for k in stats))
    real = [stats for stats, pad in parts if not pad]
    flat = [p[k] for p in real for k in keys if k in p]
    values = iter(_to_floats([*flat, *nonfinite, *norms.values()]))
    floats = [{k: next(values) for k in keys if k in p} for p in real]
    bad = sum(next(values) for _ in nonfinite)
    norms = {name: next(values) for name in norms}
    metrics, extra = combine(floats, keys, plan.reduce, {"nonfinite": bad})
    return metrics, extra["nonfinite"] > 0, norms


def _to_floats(values: list) -> list[float]:
    """Scalars (tensors on any device, or numbers) as Python floats: one transfer per device."""
    out: list = list(values)
    by_device: dict[torch.device, list[int]] = {}
    for i, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            local = value.full_tensor() if hasattr(value, "full_tensor") else value  # a DTensor
            out[i] = local.detach().reshape(()).to(torch.float64)
            by_device.setdefault(out[i].device, []).append(i)
    for idx in by_device.values():
        for i, value in zip(idx, torch.stack([out[i] for i in idx]).tolist()):
            out[i] = value
    return [float(v) for v in out]


def _grad_norm(params: list[nn.Parameter], grad_clip: float | None) -> torch.Tensor | float:
    """The pre-clip global gradient norm (clipping the gradients in place), not read yet."""
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad:
        return 0.0
    max_norm = grad_clip if grad_clip is not None else float("inf")
    # FSDP2 parameters are DTensors: the norm is global (a replicated DTensor) on every rank.
    return torch.nn.utils.clip_grad_norm_(with_grad, max_norm)


def ppo_update(
    loss_fn: Callable,
    optimizer: torch.optim.Optimizer,
    td: TensorDictBase,
    plan: Plan,
    *,
    epochs: int = 1,
    num_minibatches: int = 1,
    grad_clip: float | None = 1.0,
    normalizer: Callable[[list[TensorDictBase]], object] | None = None,
    loss_keys: Sequence[str] | None = None,
    trainable: Iterable[nn.Parameter] | None = None,
    generator: torch.Generator | None = None,
    mask_key: NestedKey | None = None,
) -> dict[str, float]:
    """Run ``epochs`` passes of clipped-PPO mini-batch updates over ``micro_batches``.

    Args:
        loss_fn: called as ``loss_fn(micro_batch, normalizer=norm)``, returns a TensorDict of
            ``loss_*`` terms and scalar metrics, and optionally their ``statistics``
            (:class:`~ar_torchrl.objectives.TokenPPOLoss` does: then every metric is computed over
            the whole mini-batch; a loss without them has each scalar averaged over the
            micro-batches weighted by their trained tokens, which is exact for means only).
        optimizer: steps once per mini-batch.
        td: the ``[B, L]`` rollout batch carrying old log-probs, values and advantages.
        plan: the micro-batch plan the old log-probs and values were computed with: any
            :class:`~ar_torchrl.training.micro_batch.Plan`, e.g. a :class:`~ar_torchrl.data.MicroBatchPlan`
            or, in data-parallel training, this rank's :class:`~ar_torchrl.distributed.ShardedPlan`
            (each rank trains on the micro-batches it owns; normalisers and metrics are summed over
            ranks).
        epochs: passes over the data (PPO epochs).
        num_minibatches: optimizer steps per epoch (:meth:`MicroBatchPlan.minibatches`: the
            micro-batches are shuffled, then dealt into groups).
        grad_clip: max global gradient norm (``None``: no clipping, the norm is still reported).
            Parameter groups of ``optimizer`` with a ``"clip_group"`` name are clipped on their
            own (e.g. a separate critic, as verl clips actor and critic apart), reported as
            ``train/grad_norm_<name>``; the others together as ``train/grad_norm``.
        normalizer: maps a mini-batch's micro-batches to the ``normalizer`` argument of
            ``loss_fn`` (default: ``loss_fn.global_normalizer`` of the concatenated mini-batch).
        loss_keys: which ``loss_*`` terms to optimise (default all; ``("loss_critic",)`` together
            with ``trainable=value_head.parameters()`` is a critic-only warm-up step).
        trainable: only these parameters are updated (others' gradients are dropped).
        generator: RNG of the shuffles (seed it for reproducible runs).
        mask_key: the mask that weights the scalar metrics of a loss without ``statistics``
            (default: the loss's own ``tensor_keys.loss_mask``, else ``"loss_mask"``).

    Returns:
        ``train/<metric>`` averaged over the mini-batches that stepped and define it (a metric no
        mini-batch defines, such as ``explained_variance`` when no return varies, is absent), plus
        ``train/grad_norm``, ``train/optimizer_steps`` and ``train/skipped_steps`` (non-finite
        loss or gradient).

    Example:
        >>> from tensordict import TensorDict
        >>> w = nn.Parameter(torch.tensor([1.0]))
        >>> def loss_fn(td, normalizer):
        ...     return TensorDict({"loss_objective": (w * td["x"]).sum() / normalizer}, [])
        >>> from ar_torchrl.training import plan_micro_batches
        >>> td = TensorDict({"x": torch.ones(4, 3), "attention_mask": torch.ones(4, 3, dtype=torch.bool),
        ...                  "loss_mask": torch.ones(4, 3, dtype=torch.bool)}, [4, 3])
        >>> plan = plan_micro_batches(td, token_budget=6)  # 2 micro-batches of 2 rows
        >>> out = ppo_update(loss_fn, torch.optim.SGD([w], lr=0.1), td, plan, epochs=2,
        ...                  normalizer=lambda m: sum(float(t["loss_mask"].sum()) for t in m))
        >>> out["train/optimizer_steps"], out["train/skipped_steps"], round(w.item(), 2)
        (2.0, 0.0, 0.8)
    """
    args = check_ppo_update_args(
        "ppo_update", epochs=epochs, num_minibatches=num_minibatches, grad_clip=grad_clip
    )
    epochs, num_minibatches, grad_clip = args["epochs"], args["num_minibatches"], args["grad_clip"]
    if mask_key is None:
        keys = getattr(loss_fn, "tensor_keys", None)
        mask_key = getattr(keys, "loss_mask", "loss_mask")
    if tuple(td.batch_size[:2]) != plan.batch_size:
        raise ValueError(
            f"ppo_update: plan was made for batch size {plan.batch_size}, got {tuple(td.batch_size)}"
        )
    normalizer = normalizer or _default_normalizer(loss_fn)
    params: dict[str, list[nn.Parameter]] = {}
    for group in optimizer.param_groups:
        params.setdefault(group.get("clip_group", ""), []).extend(group["params"])
    keep = None if trainable is None else {id(p) for p in trainable}
    totals: dict[str, float] = {}
    defined: dict[str, int] = {}  # mini-batches that define each metric
    steps = skipped = 0
    for _ in range(epochs):
        for group in plan.minibatches(num_minibatches, generator):
            metrics, ok = _minibatch_step(
                loss_fn,
                optimizer,
                [(plan.crop(td, mb), mb.padding) for mb in group],
                normalizer=normalizer,
                params=params,
                trainable=keep,
                grad_clip=grad_clip,
                loss_keys=loss_keys,
                mask_key=mask_key,
                plan=plan,
            )
            steps, skipped = steps + ok, skipped + (not ok)
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + value
                defined[key] = defined.get(key, 0) + 1
    if skipped:
        logger.warning("ppo_update: skipped %d of %d steps (non-finite)", skipped, steps + skipped)
    out = {f"train/{k}": v / defined[k] for k, v in totals.items()}
    out.update({"train/optimizer_steps": float(steps), "train/skipped_steps": float(skipped)})
    return out


def _default_normalizer(loss_fn: Callable) -> Callable[[list[TensorDictBase]], object]:
    if not hasattr(loss_fn, "global_normalizer"):
        raise TypeError(
            f"ppo_update: {type(loss_fn).__name__} has no global_normalizer(); pass normalizer="
        )
    return lambda micro: loss_fn.global_normalizer(micro)
