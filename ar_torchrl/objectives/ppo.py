"""``TokenPPOLoss``: clipped PPO for token trajectories, a TorchRL ``LossModule`` masked by
``loss_mask``.

It keeps TorchRL's loss contract (TensorDict in, ``loss_*`` terms out for the caller to sum, keys
in an ``_AcceptedKeys`` dataclass changed with ``set_keys``, ``make_value_estimator``, the actor and
an optional critic passed as ``ClipPPOLoss(actor_network, critic_network)`` takes them) and
composes three parts:

- the **policy loss** registered under ``policy_loss`` (:mod:`ar_torchrl.objectives.policy_loss`;
  ``clip`` by default), called with the clip range of the moment;
- the **value loss** ``0.5 * max((V - R)^2, (V_clip - R)^2)`` centred on the recomputed
  ``state_value`` (:func:`~ar_torchrl.functional.clipped_value_loss`; on the normalised scale
  ``(x - mu) / sigma`` with a :class:`~ar_torchrl.modules.PopArtValueHead`), an entropy bonus and
  a KL penalty to a reference policy (:mod:`ar_torchrl.functional.kl`);
- the **metrics** (:mod:`ar_torchrl.objectives.metrics`: the table of definitions, and the
  statistics :func:`~ar_torchrl.training.ppo_update` combines over a whole mini-batch).

Departures from ``torchrl.objectives.ClipPPOLoss`` (docs/design.md section 8 lists why): one
backbone forward of an :class:`~ar_torchrl.modules.LMActorCritic` gives new log-probs *and* values
(or an actor and a separate :class:`~ar_torchrl.modules.LMCritic`); every ``loss_*`` term **and
every metric** is reduced over ``loss_mask`` only, with the aggregation mode of
:func:`ar_torchrl.functional.aggregate_loss` and an optional global normaliser
(``loss(td, normalizer=...)``) so gradient accumulation over micro-batches equals one big batch;
optional dual-clip, k3 KL to a reference policy, and importance weights / rejection masks against
``rollout_log_prob`` (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy
RL training").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.utils import NestedKey
from torchrl.objectives import LossModule
from torchrl.objectives.utils import ValueEstimators
from torchrl.objectives.value import ValueEstimatorBase

from ar_torchrl import functional
from ar_torchrl.functional import AggregationMode
from ar_torchrl.modules import LMActorCritic, LMCritic, PopArtValueHead
from ar_torchrl.objectives import metrics
from ar_torchrl.objectives._keys import policy_tokens, require_key, squeeze_feature
from ar_torchrl.objectives.gae import TokenGAE
from ar_torchrl.objectives.policy_loss import RolloutCorrection, make_policy_loss
from ar_torchrl.utils.checks import check_clip_epsilon, check_number, check_ppo_loss_args

__all__ = ["UNSUPPORTED_CLIP_PPO_SETTINGS", "TokenPPOLoss"]

_OWNER = "TokenPPOLoss"

#: ``UNSUPPORTED_CLIP_PPO_SETTINGS[name][0]`` where no value describes what TokenPPOLoss does.
_NO_VALUE = object()

_WHITEN = (
    "the advantages are used as the batch holds them; whiten them in the advantage module "
    "(TokenGAE(normalize_advantage=True); GRPOAdvantage scales per group)"
)
_CRITIC = (
    "pass the critic as critic_network (an LMCritic over a separate model), or use actor_critic's "
    "value head (LMActorCritic(critic=True)) and pass only actor_critic"
)

#: ``ClipPPOLoss`` constructor arguments TokenPPOLoss has no setting for, ``name -> (value,
#: hint)``: passing ``value`` (what TokenPPOLoss does, in TorchRL's terms) is accepted, any other
#: value raises a ``TypeError`` with ``hint`` (``_NO_VALUE``: every value raises).
UNSUPPORTED_CLIP_PPO_SETTINGS: dict[str, tuple[Any, str]] = {
    "reduction": (
        _NO_VALUE,
        "every loss term is reduced over loss_mask by loss_agg_mode ('token_mean', "
        "'seq_mean_token_mean', 'seq_mean_token_sum', 'seq_mean_token_sum_norm') and "
        "forward(td, normalizer=...); build TokenPPOLoss(loss_agg_mode=...)",
    ),
    "loss_critic_type": (
        _NO_VALUE,
        "the value loss is 0.5 * max((V - R)^2, (V_clip - R)^2), half of ClipPPOLoss's 'l2' "
        "(there is no 'l1' or 'smooth_l1'); weight it with critic_coeff",
    ),
    "normalize_advantage": (False, _WHITEN),
    "normalize_advantage_exclude_dims": ((), _WHITEN),
    "advantage_norm": (None, _WHITEN),
    "separate_losses": (
        False,
        "with the value head on the policy (one LMActorCritic, one backbone forward) the value "
        "loss trains the shared backbone; for disjoint parameters pass a separate critic "
        "(critic_network=LMCritic(...)); weight the value loss with critic_coeff",
    ),
    "samples_mc_entropy": (
        _NO_VALUE,
        "the entropy is exact over the vocabulary, not a Monte-Carlo estimate; it is computed when "
        "entropy_coeff > 0 or actor_critic.return_entropy",
    ),
    "log_explained_variance": (
        True,
        "explained_variance and explained_variance_finite are always logged with a critic",
    ),
    "delay_actor": (
        False,
        "the proximal policy is sample_log_prob (recompute_old_log_probs_and_values); to correct for the rollout "
        "policy pass rollout_log_prob and tis_cap",
    ),
    "max_importance_ratio": (
        None,
        "use tis_cap: it caps exp(sample_log_prob - rollout_log_prob), the weight of each token's "
        "policy loss",
    ),
    "use_prioritized_weights": (
        False,
        "no priority weights are read; weight tokens through the advantage or loss_mask",
    ),
    "functional": (
        False,
        "actor_critic is called as a module (functional=False), so DDP/FSDP-wrapped models work",
    ),
}

#: ``ClipPPOLoss`` constructor arguments with no counterpart at all: ``name -> hint``.
_CLIP_PPO_ONLY_ARGS: dict[str, str] = {
    "critic": _CRITIC,
    "entropy_bonus": "set entropy_coeff (0 switches the entropy bonus off)",
    "gamma": "the discount is the value estimator's: loss.make_value_estimator(gamma=...), or "
    "compute the advantage before the loss",
    "advantage_key": "use loss.set_keys(advantage=...)",
    "value_target_key": "use loss.set_keys(value_target=...)",
    "value_key": "use loss.set_keys(value=...)",
    "device": "the buffers are created on actor_critic's device; move the loss with .to(device)",
}


def _same(value: Any, honoured: Any) -> bool:
    if honoured is None or isinstance(honoured, bool):
        return value is honoured
    return type(value) is type(honoured) and value == honoured


def _check_clip_ppo_kwargs(kwargs: dict[str, Any]) -> None:
    """Constructor arguments of ``ClipPPOLoss`` TokenPPOLoss does not take (or only as it behaves)."""
    for name, value in kwargs.items():
        if name in UNSUPPORTED_CLIP_PPO_SETTINGS:
            honoured, hint = UNSUPPORTED_CLIP_PPO_SETTINGS[name]
            if honoured is not _NO_VALUE and _same(value, honoured):
                continue
        elif name in _CLIP_PPO_ONLY_ARGS:
            hint = _CLIP_PPO_ONLY_ARGS[name]
        else:
            raise TypeError(f"{_OWNER}.__init__() got an unexpected keyword argument {name!r}")
        raise TypeError(f"{_OWNER}({name}={value!r}) is not supported: {hint}")


class TokenPPOLoss(LossModule):
    """Clipped PPO (actor) + clipped value (critic) loss over the trained tokens of a trajectory.

    Args:
        actor_critic: the :class:`~ar_torchrl.modules.LMActorCritic` being trained: the policy and,
            without ``critic_network``, its value head (one forward gives both).
        critic_network: a separate critic (:class:`~ar_torchrl.modules.LMCritic`: a second model
            with its own value head), as TorchRL's ``ClipPPOLoss(actor_network, critic_network)``;
            ``actor_critic`` is then an actor only (``LMActorCritic(critic=False)``). The value loss
            trains the critic's parameters only, the policy terms the actor's only.
        clip_epsilon: ``eps`` or ``(eps_low, eps_high)`` (DAPO clip-higher).
        dual_clip: dual-clip constant ``c > 1`` for negative advantages (``None``: off).
        clip_value: value-clip range around the old values ``state_value`` (``None``: unclipped).
        entropy_coeff: weight of the entropy bonus (0 disables it and skips entropy computation).
        critic_coeff: weight of the value loss (``None`` or 0: no critic term).
        kl_coeff: weight of the KL penalty to ``ref_log_prob`` (0: off; the key is then not needed).
        kl_estimator: the penalty's estimator, ``"k3"`` (default: its gradient is that of the
            *forward* KL(ref || pi)), ``"k2"`` or ``"k3_unbiased"`` (both the reverse KL(pi || ref);
            ``k3_unbiased`` also off-policy, weighted by ``exp(log_prob - sample_log_prob)``), or
            ``"k1"`` (no gradient as a loss); see :mod:`ar_torchrl.functional.kl`.
        loss_agg_mode: ``token_mean`` | ``seq_mean_token_mean`` | ``seq_mean_token_sum`` |
            ``seq_mean_token_sum_norm``.
        norm_length: the constant length for ``seq_mean_token_sum_norm`` (e.g. max_new_tokens).
        tis_cap: truncated importance sampling cap: per-token policy losses are weighted by
            ``min(exp(sample_log_prob - rollout_log_prob), tis_cap)`` (``None``: off); the
            shorthand of ``rollout_correction=RolloutCorrection(is_level="token", is_cap=tis_cap)``.
        policy_loss: a name of :data:`~ar_torchrl.objectives.POLICY_LOSSES`: ``"clip"`` (PPO's
            clipped surrogate over ``clip_epsilon``, the default), ``"gspo"``, ``"gspo_token"``,
            ``"cispo"`` (:mod:`ar_torchrl.functional.policy_losses`), or one registered with
            :func:`~ar_torchrl.objectives.register_policy_loss`: the loss calls it on every forward
            with the clip range of the moment.
        policy_loss_options: that loss's options (a dict or its schema: ``GSPOConfig``'s
            ``clip_low``/``clip_high``, ``CISPOConfig``'s ``weight_max``/``weight_min``).
        rollout_correction: IS weights and rejection masks of ``sample_log_prob`` vs
            ``rollout_log_prob`` (a :class:`~ar_torchrl.objectives.RolloutCorrection` or a dict of
            its fields, e.g. ``{"preset": "icepop"}``); they multiply the per-token policy loss only
            (the value, entropy and KL terms are neither weighted nor masked).

    Reads ``sample_log_prob``, ``state_value``, ``advantage`` (computed with the value estimator,
    :class:`TokenGAE` by default, when missing), ``value_target``, ``loss_mask`` and the actor's
    ``tokens``/``attention_mask``; optionally ``ref_log_prob``, ``rollout_log_prob`` and
    ``policy_mask`` (bool ``[B, L]``: with it the policy terms and their metrics are reduced over
    ``loss_mask & policy_mask`` and the value loss over ``loss_mask``, so rows kept for the critic
    only, such as dynamic sampling's zero-spread groups, teach the critic and not the policy). Keys are
    changed with :meth:`set_keys` (TorchRL's mechanism; the value estimator follows).

    Output: the terms ``loss_objective``, ``loss_critic``, ``loss_entropy``, ``loss_kl`` (to be
    summed) and detached scalar metrics, every one reduced over the trained tokens and defined in
    the table of :mod:`ar_torchrl.objectives.metrics`; :attr:`out_keys` lists them for this
    configuration. ``entropy`` is present only when entropies are computed (``entropy_coeff > 0``
    or the actor's ``return_entropy``), the critic metrics only with a critic,
    ``pg_clipfrac_lower`` only with ``dual_clip``, ``loss_kl``/``kl_ref`` only with ``kl_coeff >
    0``, ``rollout_log_prob_abs_diff`` and the ``rollout_*`` mismatch metrics only when the batch
    holds ``rollout_log_prob``, the ``tis_*`` ones only with an IS weight, ``rollout_masked_*``
    only with a rejection mask, ``explained_variance_policy_rows`` only with a ``policy_mask``.
    With a ``normalizer`` (the batch is one micro-batch of a larger one) or ``statistics=True`` the
    output also holds ``statistics``, the metrics' sufficient statistics, from which
    :func:`~ar_torchrl.training.ppo_update` computes each metric over the whole mini-batch
    (:func:`ar_torchrl.objectives.metrics.combine`).

    Settings that may change between calls (schedules): ``clip_epsilon`` (or the buffers
    ``clip_epsilon_low``/``clip_epsilon_high``), ``clip_value``, ``entropy_coeff`` and
    ``critic_coeff`` (checked when set), ``kl_coeff``. ``ClipPPOLoss`` constructor arguments the
    loss does not honour (``reduction``, ``loss_critic_type``, ``normalize_advantage``, ... see
    :data:`UNSUPPORTED_CLIP_PPO_SETTINGS`) raise a ``TypeError`` naming what to use instead;
    ``loss_mask_key`` is ``tensor_keys.loss_mask`` (setting it renames the key).

    Example:
        >>> from tensordict import TensorDict
        >>> from ar_torchrl.models.tiny import build_tiny_qwen3
        >>> from ar_torchrl.modules import LMActorCritic, attach_value_head
        >>> ac = LMActorCritic(attach_value_head(build_tiny_qwen3(99)))
        >>> mask = torch.tensor([[False, False, True, True]])
        >>> td = TensorDict({"tokens": torch.tensor([[5, 6, 7, 2]]), "attention_mask": torch.ones(1, 4, dtype=torch.bool),
        ...     "loss_mask": mask, "next": {"reward": torch.tensor([[[0.], [0.], [0.], [1.]]]),
        ...     "done": torch.tensor([[[False], [False], [False], [True]]]),
        ...     "terminated": torch.tensor([[[False], [False], [False], [True]]])}}, [1, 4])
        >>> with torch.no_grad():
        ...     old = ac(td.select("tokens", "attention_mask"))
        >>> td["sample_log_prob"], td["state_value"] = old["log_prob"], old["state_value"]
        >>> loss = TokenPPOLoss(ac, clip_epsilon=(0.2, 0.28), clip_value=0.2)
        >>> out = loss(td)
        >>> out["min_ratio"].item(), out["max_ratio"].item(), out["kl_approx"].item()
        (1.0, 1.0, 0.0)
        >>> loss.clip_epsilon = 0.1  # a schedule: the policy loss gets the new range next call
        >>> round(loss.clip_epsilon, 6), loss.clip_epsilon_low.item() == loss.clip_epsilon_high.item()
        (0.1, True)
    """

    @dataclass
    class _AcceptedKeys:
        """TorchRL's PPO keys (``ClipPPOLoss._AcceptedKeys``; ``action`` is not read: the actions
        are the actor's tokens) plus ``loss_mask``, ``rollout_log_prob``, ``ref_log_prob`` and
        ``policy_mask`` (optional: rows whose tokens train the critic only)."""

        advantage: NestedKey = "advantage"
        value_target: NestedKey = "value_target"
        value: NestedKey = "state_value"
        sample_log_prob: NestedKey = "sample_log_prob"
        action: NestedKey = "action"
        reward: NestedKey = "reward"
        done: NestedKey = "done"
        terminated: NestedKey = "terminated"
        loss_mask: NestedKey = "loss_mask"
        rollout_log_prob: NestedKey = "rollout_log_prob"
        ref_log_prob: NestedKey = "ref_log_prob"
        policy_mask: NestedKey = "policy_mask"

    default_keys = _AcceptedKeys
    default_value_estimator = ValueEstimators.GAE
    #: ``loss.clip_epsilon_low = 0.1`` copies into the buffer (TorchRL's LossModule does it).
    _schedulable_buffers = frozenset({"clip_epsilon_low", "clip_epsilon_high"})
    #: What TorchRL's ``LossModule`` reads: no priority weights (``use_prioritized_weights``).
    use_prioritized_weights = False

    def __init__(
        self,
        actor_critic: LMActorCritic,
        critic_network: LMCritic | None = None,
        *,
        clip_epsilon: float | tuple[float, float] = 0.2,
        dual_clip: float | None = None,
        clip_value: float | None = 0.2,
        entropy_coeff: float = 0.0,
        critic_coeff: float | None = 1.0,
        kl_coeff: float = 0.0,
        loss_agg_mode: AggregationMode = "token_mean",
        norm_length: int | None = None,
        tis_cap: float | None = None,
        kl_estimator: str = "k3",
        policy_loss: str = "clip",
        policy_loss_options: Any = None,
        rollout_correction: RolloutCorrection | dict | None = None,
        **clip_ppo_kwargs: Any,
    ) -> None:
        _check_clip_ppo_kwargs(clip_ppo_kwargs)
        a = check_ppo_loss_args(
            _OWNER,
            clip_epsilon=clip_epsilon,
            dual_clip=dual_clip,
            clip_value=clip_value,
            entropy_coeff=entropy_coeff,
            critic_coeff=critic_coeff,
            kl_coeff=kl_coeff,
            loss_agg_mode=loss_agg_mode,
            norm_length=norm_length,
            tis_cap=tis_cap,
            kl_estimator=kl_estimator,
        )
        _check_actor(actor_critic, a["critic_coeff"], critic_network)
        super().__init__()
        if a["entropy_coeff"] and not actor_critic.return_entropy:
            actor_critic.return_entropy = True  # the entropy bonus needs the actor's entropies
        self.actor_network = actor_critic
        self._has_critic = bool(a["critic_coeff"])
        if critic_network is None and self._has_critic:
            critic_network = actor_critic  # the value head on the policy: one forward
        self.critic_network = critic_network
        self._register_clip_epsilon(a["clip_epsilon"], actor_critic)
        self._critic_coeff = a["critic_coeff"] if self._has_critic else None
        self._entropy_coeff, self._entropy_bonus = a["entropy_coeff"], bool(a["entropy_coeff"])
        self.clip_value = a["clip_value"]
        self.dual_clip = a["dual_clip"]
        self.kl_coeff = a["kl_coeff"]
        self.kl_estimator = a["kl_estimator"]
        self.loss_agg_mode = a["loss_agg_mode"]
        self.norm_length = a["norm_length"]
        self.tis_cap = a["tis_cap"]
        self.policy_loss = policy_loss
        self._policy_loss_fn = make_policy_loss(
            policy_loss, policy_loss_options, dual_clip=self.dual_clip
        )
        self.rollout_correction = _rollout_correction(rollout_correction, self.tis_cap)

    def _register_clip_epsilon(self, clip_epsilon, actor_critic: LMActorCritic) -> None:
        low, high = clip_epsilon if isinstance(clip_epsilon, tuple) else (clip_epsilon,) * 2
        device = next(actor_critic.parameters()).device
        self.register_buffer("clip_epsilon_low", torch.tensor(low, device=device))
        self.register_buffer("clip_epsilon_high", torch.tensor(high, device=device))

    # ------------------------------------------------------------------ settings
    @property
    def clip_epsilon(self) -> float | tuple[float, float]:
        """The clip range: ``eps`` (a float) when ``eps_low == eps_high``, else ``(eps_low,
        eps_high)``; setting it (either form, checked) updates ``clip_epsilon_low`` and
        ``clip_epsilon_high``, which the policy loss reads on every call."""
        low, high = self._clip_range()
        return low if low == high else (low, high)

    @clip_epsilon.setter
    def clip_epsilon(self, value: float | tuple[float, float]) -> None:
        value = check_clip_epsilon(_OWNER, value)
        low, high = value if isinstance(value, tuple) else (value, value)
        self.clip_epsilon_low, self.clip_epsilon_high = low, high

    def _clip_range(self) -> tuple[float, float]:
        return float(self.clip_epsilon_low), float(self.clip_epsilon_high)

    @property
    def clip_value(self) -> float | None:
        """Value-clip range around ``state_value`` (``None``: unclipped); checked when set."""
        return self._clip_value

    @clip_value.setter
    def clip_value(self, value: float | None) -> None:
        if isinstance(value, bool):
            raise TypeError(
                f"{_OWNER}.clip_value = {value!r} is not supported (ClipPPOLoss reads True as "
                "'clip at clip_epsilon'): pass the value clip range as a float, or None to disable "
                "value clipping"
            )
        check_number(
            _OWNER, "clip_value", value, gt=0, allow_none=True, hint="None disables value clipping"
        )
        self._clip_value = None if value is None else float(value)

    @property
    def critic_coeff(self) -> float | None:
        """Weight of the value loss (``None``: a loss built without a critic term); may be set
        (scheduled) to any value ``>= 0`` on a loss built with one."""
        return self._critic_coeff

    @critic_coeff.setter
    def critic_coeff(self, value: float) -> None:
        if not self._has_critic:
            raise ValueError(
                f"{_OWNER}.critic_coeff = {value!r} has no effect on a loss built without a critic "
                "term: build TokenPPOLoss(critic_coeff=...) with a positive value (it may be "
                "scheduled to 0 later)"
            )
        if value is None:
            raise ValueError(
                f"{_OWNER}.critic_coeff = None is not supported once built: set 0 to switch the "
                "critic term off"
            )
        self._critic_coeff = float(check_number(_OWNER, "critic_coeff", value, ge=0))

    @property
    def entropy_coeff(self) -> float:
        """Weight of the entropy bonus; may be set (scheduled) on a loss built with a positive one."""
        return self._entropy_coeff

    @entropy_coeff.setter
    def entropy_coeff(self, value: float) -> None:
        value = float(check_number(_OWNER, "entropy_coeff", value, ge=0))
        if value and not self._entropy_bonus:
            raise ValueError(
                f"{_OWNER}.entropy_coeff = {value!r} has no effect on a loss built with "
                "entropy_coeff=0 (no entropy term, entropies not computed): build "
                "TokenPPOLoss(entropy_coeff=...) with a positive value (it may be scheduled "
                "to 0 later)"
            )
        self._entropy_coeff = value

    @property
    def entropy_bonus(self) -> bool:
        """Whether the output has ``loss_entropy`` (a loss built with ``entropy_coeff > 0``)."""
        return self._entropy_bonus

    @entropy_bonus.setter
    def entropy_bonus(self, value: bool) -> None:
        if value and not self.actor_network.return_entropy:
            raise ValueError(
                f"{_OWNER}.entropy_bonus = {value!r} needs entropies: build "
                "TokenPPOLoss(entropy_coeff=...) with a positive value instead"
            )
        self._entropy_bonus = bool(value)

    @property
    def functional(self) -> bool:
        """``False``: the networks are called as modules (TorchRL's non-functional losses)."""
        return False

    @property
    def loss_mask_key(self) -> NestedKey:
        """The bool ``[B, L]`` entry every term and metric is reduced over (``tensor_keys.loss_mask``).

        Setting it is ``set_keys(loss_mask=...)``. TorchRL's ``"auto"`` (its padding masks) and
        ``None`` (no mask) are not supported: an all-True ``loss_mask`` trains every position.
        """
        return self.tensor_keys.loss_mask

    @loss_mask_key.setter
    def loss_mask_key(self, value: NestedKey) -> None:
        if value is None or value == "auto" or not isinstance(value, (str, tuple)):
            raise ValueError(
                f"{_OWNER}.loss_mask_key = {value!r} is not supported: every term and metric is "
                f"reduced over the bool [B, L] entry {self.tensor_keys.loss_mask!r} "
                "(TorchRL's 'auto' masks are not read; for no masking make loss_mask all True); "
                "a key renames that entry, as set_keys(loss_mask=...) does"
            )
        self.set_keys(loss_mask=value)

    def set_keys(self, **kwargs) -> None:
        """TorchRL's ``set_keys``; ``action`` is not read (the actions are the actor's tokens)."""
        if "action" in kwargs:
            raise ValueError(
                f"{_OWNER}.set_keys(action=...) is not supported: the actions are the tokens "
                "actor_critic reads; rename them with actor_critic.set_keys(tokens=...)"
            )
        super().set_keys(**kwargs)

    @property
    def actor_critic(self) -> LMActorCritic:
        return self.actor_network

    @property
    def separate_critic(self) -> bool:
        """Whether the values come from a separate critic model (``critic_network``)."""
        critic = self.critic_network
        return self._has_critic and critic is not None and critic is not self.actor_network

    @property
    def in_keys(self) -> list[NestedKey]:
        """The entries :meth:`forward` reads (the optional ones aside)."""
        k = self.tensor_keys
        keys = [*self.actor_network.in_keys, k.sample_log_prob, k.value, k.loss_mask, k.advantage]
        return keys + [k.value_target] if self._has_critic else keys

    @property
    def out_keys(self) -> list[NestedKey]:
        """Every term and metric the output may hold for this configuration (the class docstring
        says when each is present), besides ``statistics`` and any metric of its own a registered
        policy loss reports."""
        keys = ["loss_objective"]
        if self._has_critic:
            keys += ["loss_critic", *_CRITIC_METRICS, "explained_variance_policy_rows"]
        if self.entropy_bonus:
            keys += ["loss_entropy"]
        if self.kl_coeff:
            keys += ["loss_kl", "kl_ref"]
        keys += list(_POLICY_METRICS)
        if self.dual_clip is not None:
            keys += ["pg_clipfrac_lower"]
        keys += ["rollout_log_prob_abs_diff", *_MISMATCH_METRICS]
        rc = self.rollout_correction
        if rc is not None and rc.is_level is not None:
            keys += ["tis_weight_mean", "tis_weight_capped"]
        if rc is not None and rc.mask_mode is not None:
            keys += ["rollout_masked_tokens", "rollout_masked_seqs"]
        return keys + ["entropy"] if self.actor_network.return_entropy else keys

    # ------------------------------------------------------------------ value estimator
    def make_value_estimator(self, value_type=None, **hyperparams) -> TokenPPOLoss:
        """Build the advantage module used when a batch has no ``advantage`` (a :class:`TokenGAE`).

        ``value_type`` may be ``None``/``ValueEstimators.GAE``/``TokenGAE`` (hyper-parameters go to
        ``TokenGAE``, default ``gamma=1.0, lmbda=0.95``) or a ready ``ValueEstimatorBase`` instance.
        The estimator computes missing ``state_value`` with the critic the loss holds now (after
        replacing ``critic_network``, call this again). For GRPO, run :class:`GRPOAdvantage` on the
        batch before the loss instead.
        """
        if isinstance(value_type, ValueEstimatorBase):
            self._value_estimator = value_type
        elif value_type in (None, ValueEstimators.GAE, TokenGAE):
            network = self.critic_network if self._has_critic else self.actor_network
            self._value_estimator = TokenGAE(value_network=network, **hyperparams)
        else:
            raise ValueError(
                f"{_OWNER}.make_value_estimator: unsupported value_type {value_type!r}; use TokenGAE "
                "(the default) or pass an instance, and compute GRPO advantages with GRPOAdvantage"
            )
        self.value_type = type(self._value_estimator)
        self._forward_value_estimator_keys()
        return self

    def _forward_value_estimator_keys(self, **kwargs) -> None:
        est = getattr(self, "_value_estimator", None)
        if isinstance(est, TokenGAE):
            k = self.tensor_keys
            est.set_keys(
                advantage=k.advantage,
                value_target=k.value_target,
                value=k.value,
                reward=k.reward,
                done=k.done,
                terminated=k.terminated,
                loss_mask=k.loss_mask,
            )

    # ------------------------------------------------------------------ normalisers
    def global_normalizer(
        self, tensordicts: TensorDictBase | list[TensorDictBase]
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Sum of the default normalisers of ``tensordicts`` (e.g. all micro-batches of a mini-batch).

        Pass it as ``loss(mb, normalizer=...)`` to every micro-batch so that the accumulated
        gradient equals the gradient of one forward over their union. When a batch has a
        ``policy_mask`` (rows for the critic only), it is ``{"policy": n_policy, "critic":
        n_critic}``: the policy terms are normalised over ``loss_mask & policy_mask``, the value
        loss over ``loss_mask``.
        """
        tds = [tensordicts] if isinstance(tensordicts, TensorDictBase) else list(tensordicts)
        k = self.tensor_keys
        masks = [require_key(td, k.loss_mask, _OWNER, "bool [B, L]").bool() for td in tds]
        critic = sum(functional.loss_normalizer(m, self.loss_agg_mode) for m in masks)
        if not any(td.get(k.policy_mask, None) is not None for td in tds):
            return critic
        policy = sum(
            functional.loss_normalizer(self._policy_mask(td, m), self.loss_agg_mode)
            for td, m in zip(tds, masks)
        )
        return {"policy": policy, "critic": critic}

    def _policy_mask(self, td: TensorDictBase, mask: torch.Tensor) -> torch.Tensor:
        return policy_tokens(td, self.tensor_keys.policy_mask, mask, _OWNER)

    def _split_normalizer(self, normalizer, has_policy_mask: bool):
        if isinstance(normalizer, dict):
            return normalizer["policy"], normalizer["critic"]
        if has_policy_mask and normalizer is not None:
            raise ValueError(
                f"{_OWNER}: the batch has {self.tensor_keys.policy_mask!r} (rows for the critic "
                "only), so the policy and the value terms have different normalisers: pass "
                "normalizer=loss.global_normalizer(micro_batches) (a dict 'policy', 'critic'), "
                f"got {normalizer!r}"
            )
        return normalizer, normalizer

    def _agg(self, x: torch.Tensor, mask: torch.Tensor, normalizer) -> torch.Tensor:
        return functional.aggregate_loss(
            x, mask, self.loss_agg_mode, normalizer, norm_length=self.norm_length
        )

    def _get(self, td: TensorDictBase, key: NestedKey, hint: str) -> torch.Tensor:
        return squeeze_feature(require_key(td, key, _OWNER, hint), key, td.batch_size, _OWNER)

    # ------------------------------------------------------------------ loss
    def forward(
        self,
        tensordict: TensorDictBase,
        normalizer: torch.Tensor | float | dict | None = None,
        *,
        statistics: bool | None = None,
    ) -> TensorDict:
        """The loss terms and metrics of ``tensordict`` (``[B, L]``).

        Args:
            tensordict: the batch (or one micro-batch of it).
            normalizer: the global normaliser of a micro-batch (:meth:`global_normalizer`).
            statistics: also return the metrics' ``statistics`` (default: with a ``normalizer``).
        """
        self._check_networks()
        mask = self._loss_mask(tensordict)
        if tensordict.get(self.tensor_keys.advantage, None) is None:
            self.value_estimator(tensordict)
        policy_mask = self._policy_mask(tensordict, mask)
        has_policy_mask = tensordict.get(self.tensor_keys.policy_mask, None) is not None
        norm, critic_norm = self._split_normalizer(normalizer, has_policy_mask)
        new = self.actor_network(self.actor_network.select_inputs(tensordict))
        log_prob = new.get(self.actor_network.log_prob_key)
        terms: dict[str, torch.Tensor] = {}
        stats: metrics.Statistics = {}
        self._policy_terms(tensordict, log_prob, policy_mask, norm, terms, stats)
        if self._has_critic:
            rows = policy_mask if has_policy_mask else None
            self._critic_terms(tensordict, new, mask, rows, critic_norm, terms, stats)
        self._entropy_terms(new, policy_mask, norm, terms, stats)
        if self.kl_coeff:
            self._kl_terms(tensordict, log_prob, policy_mask, norm, terms, stats)
        out = {**terms, **{k: v.float() for k, v in metrics.finalize(stats).items()}}
        if statistics or (statistics is None and normalizer is not None):
            out["statistics"] = metrics.to_tensordict(stats)
        return TensorDict(out, batch_size=[])

    def _loss_mask(self, td: TensorDictBase) -> torch.Tensor:
        k = self.tensor_keys
        if td.batch_dims != 2:
            raise ValueError(
                f"{_OWNER} expects a [B, L] token trajectory, got batch_size {tuple(td.batch_size)}"
            )
        mask = self._get(td, k.loss_mask, "bool [B, L], True on generated tokens")
        if mask.dtype != torch.bool:
            raise TypeError(f"{_OWNER}: {k.loss_mask!r} must be bool, got {mask.dtype}")
        return mask

    def _check_networks(self) -> None:
        """The networks as they are now (``critic_network`` may have been replaced) still fit."""
        critic = self.critic_network
        if self._has_critic and critic is None:
            raise ValueError(
                f"{_OWNER}: critic_network is None but the loss was built with a critic term; "
                "build TokenPPOLoss(critic_coeff=None) for an actor-only loss"
            )
        if critic is self.actor_network:
            _check_actor(self.actor_network, self._critic_coeff, None)
        elif critic is not None:
            _check_pair(self.actor_network, critic)

    def _policy_terms(self, td, log_prob, mask, normalizer, terms, stats) -> None:
        k = self.tensor_keys
        old = self._get(
            td,
            k.sample_log_prob,
            "PPO anchors: run recompute_old_log_probs_and_values(actor_critic, td, plan)",
        )
        adv = self._get(td, k.advantage, "advantage [B, L, 1]")
        low, high = self._clip_range()  # read now: the clip range may be scheduled
        loss, per_token = self._policy_loss_fn(
            log_prob, old, adv, mask, clip_low=low, clip_high=high, dual_clip=self.dual_clip
        )
        rollout = td.get(k.rollout_log_prob, None)
        if rollout is not None:
            rollout = squeeze_feature(rollout, k.rollout_log_prob, td.batch_size, _OWNER)
            stats.update(metrics.mismatch_statistics(log_prob, old, rollout, mask))
        loss = self._corrected(loss, old, rollout, mask, stats)
        terms["loss_objective"] = self._agg(loss, mask, normalizer)
        log_ratio = functional.masked_log_ratio(log_prob.detach(), old, mask)
        stats.update(metrics.ratio_statistics(log_ratio, mask, clip_low=low, clip_high=high))
        stats.update(metrics.per_token_statistics(per_token, mask))

    def _corrected(self, loss, old, rollout, mask, stats) -> torch.Tensor:
        """The per-token policy loss times the rollout correction's weight and keep-mask."""
        rc = self.rollout_correction
        if rc is None:
            return loss
        if rollout is None:
            raise KeyError(
                f"{_OWNER}: the rollout correction ({_describe_rc(rc)}) needs "
                f"{self.tensor_keys.rollout_log_prob!r} (the engine's log-probs of the sampled "
                "tokens), missing from the batch"
            )
        weight, keep, found = functional.rollout_correction(old, rollout, mask, **rc.arguments())
        stats.update(metrics.row_or_token_means(found, mask))
        return torch.where(keep, loss * weight, torch.zeros((), dtype=loss.dtype))

    def _critic_terms(self, td, new, mask, policy_rows, normalizer, terms, stats) -> None:
        k, critic = self.tensor_keys, self.critic_network
        values = critic(critic.select_inputs(td)) if self.separate_critic else new
        value = values.get(critic.value_key).squeeze(-1)
        old = self._get(
            td,
            k.value,
            "anchor values: run recompute_old_log_probs_and_values(actor_critic, td, plan)",
        )
        target = self._get(
            td,
            k.value_target,
            "the critic's targets: TokenGAE writes them; with GRPO/RLOO advantages use "
            "GRPOAdvantage(critic_targets=True) (or RLOOAdvantage(critic_targets=True)), or train "
            "without a critic: TokenPPOLoss(critic_coeff=0)",
        )
        head = getattr(critic.model, "value_head", None)
        if isinstance(head, PopArtValueHead):  # the loss (and its clip) in the layer's own scale
            value, old, target = (head.normalize(x) for x in (value, old, target))
        loss, _ = functional.clipped_value_loss(
            value, old, target, mask, clip_value=self.clip_value
        )
        terms["loss_critic"] = self.critic_coeff * self._agg(loss, mask, normalizer)
        stats.update(metrics.critic_statistics(value, old, target, mask, self.clip_value))
        if policy_rows is not None:  # the policy's rows alone
            ev = metrics.explained_variance_statistics(value, target, policy_rows)
            stats[("explained_variance", "explained_variance_policy_rows")] = ev

    def _entropy_terms(self, new, mask, normalizer, terms, stats) -> None:
        if not (self.entropy_bonus or self.actor_network.return_entropy):
            return
        entropy = new.get(self.actor_network.entropy_key)
        stats[("mean", "entropy")] = metrics.mean(entropy, mask)
        if self.entropy_bonus:
            terms["loss_entropy"] = -self.entropy_coeff * self._agg(entropy, mask, normalizer)

    def _kl_terms(self, td, log_prob, mask, normalizer, terms, stats) -> None:
        k = self.tensor_keys
        ref = self._get(
            td,
            k.ref_log_prob,
            "reference log-probs: recompute_old_log_probs_and_values(..., ref_actor=...)",
        )
        old = td.get(k.sample_log_prob) if self.kl_estimator == "k3_unbiased" else None
        kl = functional.kl_penalty(
            log_prob, ref, mask, estimator=self.kl_estimator, old_log_prob=old
        )
        terms["loss_kl"] = self.kl_coeff * self._agg(kl, mask, normalizer)
        k3 = kl if self.kl_estimator == "k3" else functional.k3_kl(log_prob.detach(), ref, mask)
        stats[("mean", "kl_ref")] = metrics.mean(k3, mask)  # the k3 estimate, any estimator


#: Policy metrics of every call, in ``out_keys`` order (TorchRL's names, verl's, then ours);
#: ``pg_clipfrac_lower`` (verl) follows with ``dual_clip``.
_POLICY_METRICS = (
    "clip_fraction",
    "kl_approx",
    "mean_ratio",
    "max_ratio",
    "ESS",
    "pg_clipfrac",
    "approx_kl",
    "min_ratio",
)

#: ``pi_old`` vs ``pi_rollout`` (:func:`~ar_torchrl.functional.rollout_mismatch_metrics`), logged
#: whenever the batch holds ``rollout_log_prob``.
_MISMATCH_METRICS = (
    "rollout_abs_log_ratio",
    "rollout_token_mult_prob_error",
    "rollout_seq_ratio",
    "rollout_kl",
)

#: Critic metrics (with a critic), in ``out_keys`` order (TorchRL's, verl's, then ours).
_CRITIC_METRICS = (
    "value_clip_fraction",
    "explained_variance",
    "vf_clipfrac",
    "explained_variance_finite",
)


def _rollout_correction(
    value: RolloutCorrection | dict | None, tis_cap: float | None
) -> RolloutCorrection | None:
    """The resolved correction of ``TokenPPOLoss(rollout_correction=..., tis_cap=...)`` (``None``:
    off); ``tis_cap`` is the token-level IS weight ``RolloutCorrection(is_level="token", is_cap=...)``."""
    if value is None:
        rc = RolloutCorrection()
    elif isinstance(value, RolloutCorrection):
        rc = value
    elif isinstance(value, dict):
        rc = RolloutCorrection(**value)
    else:
        raise TypeError(
            f"{_OWNER}(rollout_correction=...) takes a RolloutCorrection or a dict of its fields, "
            f"got {type(value).__name__}"
        )
    rc.check(f"{_OWNER}: rollout_correction.")
    rc = rc.resolved()
    if tis_cap is not None:
        if rc.is_level is not None:
            raise ValueError(
                f"{_OWNER}: tis_cap={tis_cap} and rollout_correction (is_level={rc.is_level!r}) "
                "both set an importance weight: use one (tis_cap is "
                "RolloutCorrection(is_level='token', is_cap=tis_cap))"
            )
        rc = dataclasses.replace(rc, is_level="token", is_cap=tis_cap)
    return rc if rc.active else None


def _describe_rc(rc: RolloutCorrection) -> str:
    return ", ".join(
        f"{f.name}={getattr(rc, f.name)!r}"
        for f in dataclasses.fields(rc)
        if getattr(rc, f.name) is not None and not (f.name == "preset" and rc.preset == "none")
    )


def _check_pair(actor_critic: LMActorCritic, critic_network: Any) -> None:
    """A separate critic: an :class:`LMCritic` beside an actor without a value head."""
    if not isinstance(critic_network, LMCritic):
        raise TypeError(
            f"{_OWNER}(critic_network=...) takes an LMCritic (a separate model with a value "
            f"head), got {type(critic_network).__name__}"
        )
    if actor_critic.critic:
        raise ValueError(
            f"{_OWNER}: critic_network was given but actor_critic computes values too (its "
            "value head); with a separate critic pass the actor as LMActorCritic(model, "
            "critic=False)"
        )


def _check_actor(actor_critic, critic_coeff: float | None, critic_network) -> None:
    if not isinstance(actor_critic, LMActorCritic):
        raise TypeError(f"{_OWNER} needs an LMActorCritic, got {type(actor_critic).__name__}")
    if critic_network is not None:
        _check_pair(actor_critic, critic_network)
        if not critic_coeff:
            raise ValueError(
                f"{_OWNER}: critic_network was given with critic_coeff={critic_coeff}: the critic "
                "would never be trained; set critic_coeff > 0 or drop critic_network"
            )
        return
    if critic_coeff and not actor_critic.critic:
        raise ValueError(
            f"{_OWNER}: critic_coeff={critic_coeff} needs a critic: an LMActorCritic with a value "
            "head (critic=True) or a separate critic_network=LMCritic(...); pass critic_coeff=None "
            "(or 0) for an actor-only loss such as GRPO"
        )
