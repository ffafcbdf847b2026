"""The registry of policy losses (:data:`POLICY_LOSSES`, verl's ``register_policy_loss`` style) and
the torch-free config of the rollout correction (:class:`RolloutCorrection`, its presets).

A policy loss is registered by decorating its options' dataclass (the one shape of
:mod:`ar_torchrl.registry`): ``@register_policy_loss("name", help=...)``.

**The call contract.** The schema's ``build(self)`` is called once, when
:class:`~ar_torchrl.objectives.TokenPPOLoss` is built, on its options (filled and checked). It
returns the loss function, which the PPO loss calls on every forward as

``fn(log_prob, old_log_prob, advantage, mask, *, clip_low, clip_high, dual_clip) -> (loss, metrics)``

- ``log_prob`` (differentiable), ``old_log_prob``, ``advantage``: float ``[B, L]``; ``mask``: bool
  ``[B, L]``, the policy's trained tokens;
- ``clip_low``, ``clip_high``: the loss's clip range *now* (``TokenPPOLoss.clip_epsilon``, which may
  be scheduled); ``dual_clip``: its dual-clip constant or ``None`` (only ``clip`` accepts one:
  :func:`make_policy_loss` refuses it for the others);
- ``loss``: float ``[B, L]``, the per-token loss, 0 (with zero gradient) off ``mask``;
  :class:`~ar_torchrl.objectives.TokenPPOLoss` aggregates it with its ``loss_agg_mode`` and
  weights it with the rollout correction;
- ``metrics``: ``name -> [B, L]`` per-token values (bool flags or floats, detached), each logged as
  its mean over the trained tokens, over the whole mini-batch in
  :func:`~ar_torchrl.training.ppo_update` (:mod:`ar_torchrl.objectives.metrics`). Every built-in
  loss reports ``pg_clipfrac`` here, the fraction of tokens whose gradient its clip changed
  (``clip`` also ``pg_clipfrac_lower`` with a dual clip: verl's definitions).

The functions themselves are the formulas of :mod:`ar_torchrl.functional.policy_losses`. Built in:
``clip`` (PPO's clipped surrogate, the default), ``gspo``, ``gspo_token`` and ``cispo``. Nothing
here imports torch at import time (a recipe checks its config first).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, Optional

from ar_torchrl.registry import Registry
from ar_torchrl.utils.checks import check_choice, check_number

# OmegaConf reads the annotations at run time: they must stay `Optional[...]`, not `X | None`.
# ruff: noqa: UP045

__all__ = [
    "POLICY_LOSSES",
    "ROLLOUT_CORRECTION_PRESETS",
    "CISPOConfig",
    "ClipConfig",
    "GSPOConfig",
    "GSPOTokenConfig",
    "RolloutCorrection",
    "make_policy_loss",
    "policy_loss_names",
    "register_policy_loss",
]

POLICY_LOSSES = Registry(
    "policy loss",
    decorator="register_policy_loss",
    build="build(self) -> fn(log_prob, old_log_prob, advantage, mask, *, clip_low, clip_high, dual_clip)",
)

#: ``@register_policy_loss(name, help=...)`` on the loss's options dataclass, whose ``build(self)``
#: returns the loss function of the call contract above (:meth:`ar_torchrl.registry.Registry.register`
#: of :data:`POLICY_LOSSES`).
register_policy_loss = POLICY_LOSSES.register


def policy_loss_names() -> tuple[str, ...]:
    """The registered policy losses, in registration order.

    Example:
        >>> policy_loss_names()[:4]
        ('clip', 'gspo', 'gspo_token', 'cispo')
    """
    return POLICY_LOSSES.names()


def make_policy_loss(name: str, options: Any = None, *, dual_clip: float | None = None) -> Callable:
    """The loss function of policy loss ``name`` (``options``: a mapping or its schema), checked
    against the PPO loss's ``dual_clip``; call it as the module docstring says.

    Raises:
        ValueError: unknown name or option, a value out of range, or ``dual_clip`` with a loss other
            than ``clip``.

    Example:
        >>> import torch
        >>> fn = make_policy_loss("cispo", {"weight_max": 2.0})
        >>> m = torch.ones(1, 2, dtype=torch.bool)
        >>> loss, metrics = fn(torch.full((1, 2), -0.5), torch.full((1, 2), -1.5), torch.ones(1, 2), m,
        ...                    clip_low=0.2, clip_high=0.2, dual_clip=None)
        >>> loss.tolist(), metrics["pg_clipfrac"].tolist()  # weight e^1 capped at 2: -2 * 1 * -0.5
        ([[1.0, 1.0]], [[True, True]])
    """
    if dual_clip is not None and name != "clip":
        raise ValueError(
            f"dual_clip={dual_clip} is a clause of the clipped surrogate (policy_loss='clip'); "
            f"policy loss {name!r} has none: set dual_clip=None"
        )
    return POLICY_LOSSES.build(name, options)


@register_policy_loss("clip", help="PPO's clipped surrogate (dual-clip optional)")
@dataclass
class ClipConfig:
    """``clip``: PPO's clipped surrogate; its clip range is the loss's ``clip_epsilon``."""

    def check(self, prefix: str) -> None:
        return None

    def build(self) -> Callable:
        return _clip_loss


def _clip_loss(log_prob, old_log_prob, advantage, mask, *, clip_low, clip_high, dual_clip):
    """``clip``: :func:`~ar_torchrl.functional.clipped_surrogate` and verl's clip fractions."""
    from ar_torchrl.functional.policy_losses import clipped_surrogate
    from ar_torchrl.objectives.metrics import verl_clip_flags

    loss, ratio, _ = clipped_surrogate(
        log_prob,
        old_log_prob,
        advantage,
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
    )
    flags = verl_clip_flags(
        ratio.detach(), advantage, mask, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip
    )
    return loss, flags


@register_policy_loss("gspo", help="GSPO: the clipped length-normalised sequence ratio")
@dataclass
class GSPOConfig:
    """``gspo`` / ``gspo_token``: the band of the length-normalised sequence ratio."""

    clip_low: float = 3.0e-4  # the ratio's band is [1 - clip_low, 1 + clip_high] (GSPO paper)
    clip_high: float = 4.0e-4

    #: ``gspo_token``: the sequence ratio with each token's own gradient (GSPO-token)
    token_level: ClassVar[bool] = False

    def check(self, prefix: str) -> None:
        check_number(prefix, "clip_low", self.clip_low, ge=0, lt=1)
        check_number(prefix, "clip_high", self.clip_high, ge=0)

    def build(self) -> Callable:
        return partial(_gspo_loss, options=self, token_level=self.token_level)


def _gspo_loss(
    log_prob, old_log_prob, advantage, mask, *, clip_low, clip_high, dual_clip, options, token_level
):
    """``gspo`` / ``gspo_token``: the band is GSPO's own (``options``), not the PPO clip range."""
    from ar_torchrl.functional.policy_losses import gspo_surrogate

    loss, _, clipped = gspo_surrogate(
        log_prob,
        old_log_prob,
        advantage,
        mask,
        clip_low=options.clip_low,
        clip_high=options.clip_high,
        token_level=token_level,
    )
    return loss, {"pg_clipfrac": clipped}


@register_policy_loss("gspo_token", help="GSPO-token: GSPO's ratio, per-token gradients")
@dataclass
class GSPOTokenConfig(GSPOConfig):
    """``gspo_token``: :class:`GSPOConfig`'s band, per-token gradients."""

    token_level: ClassVar[bool] = True


@register_policy_loss("cispo", help="CISPO: the clipped, detached importance weight")
@dataclass
class CISPOConfig:
    """``cispo``: the bounds of the detached importance weight."""

    weight_max: float = 5.0  # cap of pi / pi_old (TRL's epsilon_high for cispo; ScaleRL: 4-5)
    weight_min: Optional[float] = None  # floor (None: none, as MiniMax-M1)

    def check(self, prefix: str) -> None:
        check_number(prefix, "weight_max", self.weight_max, gt=0)
        check_number(prefix, "weight_min", self.weight_min, ge=0, allow_none=True)
        if self.weight_min is not None and self.weight_min > self.weight_max:
            raise ValueError(
                f"{prefix}weight_min={self.weight_min} is above weight_max={self.weight_max}"
            )

    def build(self) -> Callable:
        return partial(_cispo_loss, weight_max=self.weight_max, weight_min=self.weight_min)


def _cispo_loss(
    log_prob,
    old_log_prob,
    advantage,
    mask,
    *,
    clip_low,
    clip_high,
    dual_clip,
    weight_max,
    weight_min,
):
    """``cispo``: the weight's bounds are CISPO's own, not the PPO clip range."""
    from ar_torchrl.functional.policy_losses import cispo_surrogate

    loss, _, clipped = cispo_surrogate(
        log_prob, old_log_prob, advantage, mask, weight_max=weight_max, weight_min=weight_min
    )
    return loss, {"pg_clipfrac": clipped}


# --------------------------------------------------------------------------- rollout correction
#: ``name -> fields`` of :class:`RolloutCorrection` (verl's ``RolloutCorrectionConfig`` presets,
#: ``verl/trainer/config/algorithm.py``, and IcePop's band).
ROLLOUT_CORRECTION_PRESETS: dict[str, dict[str, Any]] = {
    "none": {},
    "token_is": {"is_level": "token", "is_cap": 2.0},  # verl decoupled_token_is
    "seq_is": {"is_level": "sequence", "is_cap": 2.0},  # verl decoupled_seq_is
    "token_mask": {"mask_mode": "token", "mask_high": 2.0},  # reject tokens with ratio > 2
    "icepop": {"mask_mode": "token", "mask_low": 0.5, "mask_high": 5.0},  # IcePop's [alpha, beta]
    "mis": {"mask_mode": "sequence", "mask_low": 0.5, "mask_high": 2.0},  # sequence mask
    "seq_is_mis": {  # verl decoupled_seq_is_rs
        "is_level": "sequence",
        "is_cap": 2.0,
        "mask_mode": "sequence",
        "mask_low": 0.5,
        "mask_high": 2.0,
    },
    "geo_mask": {
        "mask_mode": "geometric",
        "mask_low": 0.999,
        "mask_high": 1.001,
    },  # decoupled_geo_rs
    "geo_mask_token_is": {  # verl decoupled_geo_rs_token_tis
        "is_level": "token",
        "is_cap": 2.0,
        "mask_mode": "geometric",
        "mask_low": 0.999,
        "mask_high": 1.001,
    },
}


@dataclass
class RolloutCorrection:
    """Importance weights and rejection masks of ``pi_old / pi_rollout`` on the policy loss.

    ``preset`` fills the fields left ``None`` (:data:`ROLLOUT_CORRECTION_PRESETS`); the semantics
    are :func:`ar_torchrl.functional.rollout_correction.rollout_correction`'s. The weight and the
    mask multiply the per-token **policy** loss only: the value loss is neither weighted nor masked
    (the critic regresses the returns of the tokens the batch holds, whichever policy sampled them),
    nor are the entropy and KL terms.

    Example:
        >>> rc = RolloutCorrection(preset="icepop").resolved()
        >>> rc.mask_mode, rc.mask_low, rc.mask_high, rc.is_level
        ('token', 0.5, 5.0, None)
        >>> RolloutCorrection(preset="seq_is", is_cap=3.0).resolved().is_cap
        3.0
    """

    preset: str = "none"  # a name of ROLLOUT_CORRECTION_PRESETS; explicit fields override it
    is_level: Optional[str] = None  # IS weight: token | sequence (None: no weight)
    is_cap: Optional[float] = None  # truncation of the IS weight (default 2.0)
    mask_mode: Optional[str] = None  # rejection: token | sequence | geometric (None: none)
    mask_low: Optional[float] = None  # the band of the mask's ratio (None: unbounded below)
    mask_high: Optional[float] = None  # (None: unbounded above)

    def resolved(self) -> RolloutCorrection:
        """The preset's values under the explicit fields (``preset`` kept for the record)."""
        if self.preset not in ROLLOUT_CORRECTION_PRESETS:
            check_choice("RolloutCorrection", "preset", self.preset, ROLLOUT_CORRECTION_PRESETS)
        base = ROLLOUT_CORRECTION_PRESETS[self.preset]
        values = {
            f.name: getattr(self, f.name) if getattr(self, f.name) is not None else base.get(f.name)
            for f in dataclasses.fields(self)
            if f.name != "preset"
        }
        if values["is_level"] is not None and values["is_cap"] is None:
            values["is_cap"] = 2.0
        return RolloutCorrection(preset=self.preset, **values)

    def arguments(self) -> dict[str, Any]:
        """The resolved fields as the keyword arguments of
        :func:`ar_torchrl.functional.rollout_correction.rollout_correction`.

        Example:
            >>> RolloutCorrection(preset="mis").arguments()["mask_mode"]
            'sequence'
        """
        r = self.resolved()
        return {
            "is_level": r.is_level,
            "is_cap": 2.0 if r.is_cap is None else r.is_cap,
            "mask_mode": r.mask_mode,
            "mask_low": r.mask_low,
            "mask_high": r.mask_high,
        }

    @property
    def active(self) -> bool:
        r = self.resolved()
        return r.is_level is not None or r.mask_mode is not None

    def check(self, prefix: str = "RolloutCorrection.") -> None:
        check_choice(prefix, "preset", self.preset, tuple(ROLLOUT_CORRECTION_PRESETS))
        r = self.resolved()
        check_choice(prefix, "is_level", r.is_level, ("token", "sequence", None))
        check_choice(prefix, "mask_mode", r.mask_mode, ("token", "sequence", "geometric", None))
        check_number(prefix, "is_cap", r.is_cap, gt=0, allow_none=True)
        check_number(prefix, "mask_low", r.mask_low, ge=0, allow_none=True)
        check_number(prefix, "mask_high", r.mask_high, gt=0, allow_none=True)
        if r.mask_mode is not None and r.mask_low is None and r.mask_high is None:
            raise ValueError(f"{prefix}mask_mode={r.mask_mode!r} needs mask_low and/or mask_high")
        if r.mask_low is not None and r.mask_high is not None and r.mask_low > r.mask_high:
            raise ValueError(f"{prefix}mask_low={r.mask_low} is above mask_high={r.mask_high}")
        if r.mask_mode is None and (self.mask_low is not None or self.mask_high is not None):
            raise ValueError(
                f"{prefix}mask_low/mask_high are set but no mask_mode (token | sequence | geometric)"
            )
        if r.is_level is None and self.is_cap is not None:
            raise ValueError(
                f"{prefix}is_cap={self.is_cap} is set but no is_level (token | sequence)"
            )
