"""One PPO update over a rollout batch: epochs x mini-batches x micro-batches, with NaN/inf skipping.

The micro-batches are those of the :class:`~ar_torchrl.data.MicroBatchPlan` that computed the
old log-probs and values, so at unchanged weights the first forward reproduces ``sample_log_prob`` and
``state_value`` exactly (docs/design.md section 4). Each epoch shuffles the micro-batches and groups them
into ``num_minibatches`` mini-batches; a mini-batch accumulates the gradients of its micro-batches,
each loss divided by the mini-batch's *global* normaliser, so the accumulated gradient equals the
gradient of one big batch. A mini-batch whose loss or gradient norm is not finite is skipped (no
optimizer step, gradients dropped) and counted in ``train/skipped_steps``: nothing is silently lost.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey
from torch import nn

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


def _mask_count(td: TensorDictBase, mask_key: NestedKey) -> float:
    return float(td.get(mask_key).sum())


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

    Data-parallel (``plan.spans_ranks``): the normaliser and metric weights are summed over ranks
    (``plan.reduce``), and a non-finite loss does not return early (every rank must run the same
    backward passes): the ranks agree on skipping the step after the last one.
    """
    optimizer.zero_grad(set_to_none=True)
    real = [mb for mb, pad in micro if not pad]
    counts = [0.0 if pad else _mask_count(mb, mask_key) for mb, pad in micro]
    weights = sum(counts)
    if real:
        norm = normalizer(real)
    else:  # only padding passes on this rank: a zero of the normaliser's form (scalar or dict)
        norm = _zero_like(normalizer([mb for mb, _ in micro]))
    sharded = plan.spans_ranks
    if sharded:  # a dict normaliser ({"policy": ..., "critic": ...}) is reduced per entry
        parts = norm if isinstance(norm, dict) else {"": norm}
        total = plan.reduce(
            {**{f"norm/{key}": float(v) for key, v in parts.items()}, "weights": weights}
        )
        reduced = {key: total[f"norm/{key}"] for key in parts}
        norm, weights = reduced if isinstance(norm, dict) else reduced[""], total["weights"]
    weights = weights or 1.0
    sums: dict[str, float] = {}
    finite = True
    for (mb, pad), count in zip(micro, counts):
        out = loss_fn(mb, normalizer=norm)
        loss = total_loss(out, loss_keys)
        if pad:  # a padding pass: FSDP's collectives run, the gradient gets exactly nothing
            loss = loss * 0.0
        if not torch.isfinite(loss):
            finite = False
            if not sharded:
                optimizer.zero_grad(set_to_none=True)
                return {}, False
        loss.backward()
        _accumulate(sums, out, count / weights, padding=pad)
    if sharded:
        sums = plan.reduce({**sums, "_nonfinite": float(not finite)})
        finite = sums.pop("_nonfinite") == 0.0
    if not finite:
        optimizer.zero_grad(set_to_none=True)
        return {}, False
    if trainable is not None:
        for p in (p for group in params.values() for p in group):
            if id(p) not in trainable:
                p.grad = None
    norms = {name: _grad_norm(group, grad_clip) for name, group in params.items()}
    if not all(math.isfinite(norm) for norm in norms.values()):
        optimizer.zero_grad(set_to_none=True)
        return {}, False
    optimizer.step()
    for name, norm in norms.items():
        sums[f"grad_norm_{name}" if name else "grad_norm"] = norm
    return sums, True


def _zero_like(norm: object) -> object:
    if isinstance(norm, dict):
        return {key: 0.0 for key in norm}
    return 0.0


def _accumulate(sums: dict[str, float], out: TensorDictBase, weight: float, padding: bool) -> None:
    """Add a micro-batch's scalars: ``loss_*`` are already normalised by the whole mini-batch (sum
    them), other metrics are averaged with ``weight``; padding passes and empty masks add 0."""
    for key, value in out.items():
        if isinstance(key, str) and value.numel() == 1:
            scale = 1.0 if key.startswith("loss_") else weight
            add = 0.0 if padding or scale == 0.0 else scale * float(value.detach())
            sums[key] = sums.get(key, 0.0) + add


def _grad_norm(params: list[nn.Parameter], grad_clip: float | None) -> float:
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad:
        return 0.0
    max_norm = grad_clip if grad_clip is not None else float("inf")
    # FSDP2 parameters are DTensors: the norm is global (a replicated DTensor) on every rank.
    return float(torch.nn.utils.clip_grad_norm_(with_grad, max_norm))


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
            ``loss_*`` terms and scalar metrics (e.g. :class:`~ar_torchrl.objectives.TokenPPOLoss`).
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
        mask_key: the mask that weights per-micro-batch metrics (default: the loss's own
            ``tensor_keys.loss_mask``, else ``"loss_mask"``).

    Returns:
        ``train/<metric>`` averaged over the mini-batches that stepped, plus ``train/grad_norm``,
        ``train/optimizer_steps`` and ``train/skipped_steps`` (non-finite loss or gradient).

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
    if skipped:
        logger.warning("ppo_update: skipped %d of %d steps (non-finite)", skipped, steps + skipped)
    out = {f"train/{k}": v / max(steps, 1) for k, v in totals.items()}
    out.update({"train/optimizer_steps": float(steps), "train/skipped_steps": float(skipped)})
    return out


def _default_normalizer(loss_fn: Callable) -> Callable[[list[TensorDictBase]], object]:
    if not hasattr(loss_fn, "global_normalizer"):
        raise TypeError(
            f"ppo_update: {type(loss_fn).__name__} has no global_normalizer(); pass normalizer="
        )
    return lambda micro: loss_fn.global_normalizer(micro)
