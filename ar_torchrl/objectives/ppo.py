"""``TokenPPOLoss``: TorchRL's ``ClipPPOLoss`` for token trajectories, masked by ``loss_mask``.

Departures from ``torchrl.objectives.ClipPPOLoss`` (docs/design.md section 8 lists why):

- one backbone forward of an :class:`~ar_torchrl.modules.LMActorCritic` gives new log-probs *and*
  values (the actor and critic are one module, the value head on the policy), or, as TorchRL's
  ``ClipPPOLoss(actor_network, critic_network)``, an actor and a separate
  :class:`~ar_torchrl.modules.LMCritic` (a second model: its own forward, disjoint parameters);
- every ``loss_*`` term **and every metric** is reduced over ``loss_mask`` only, with the
  aggregation mode of :func:`ar_torchrl.functional.aggregate_loss` and an optional global normaliser
  (``loss(td, normalizer=...)``) so gradient accumulation over micro-batches equals one big batch;
- the value loss is ``0.5 * max((V - R)^2, (V_clip - R)^2)`` centred on the recomputed
  ``state_value`` (on the normalised scale ``(x - mu) / sigma`` with a
  :class:`~ar_torchrl.modules.PopArtValueHead`); optional dual-clip, k3 KL to a reference policy and truncated importance sampling
  against ``rollout_log_prob`` (Yao et al. 2025, "Your efficient RL framework secretly brings you
  off-policy RL training").
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.utils import NestedKey
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.utils import ValueEstimators
from torchrl.objectives.value import ValueEstimatorBase

from ar_torchrl import functional
from ar_torchrl.functional import AggregationMode
from ar_torchrl.modules import LMActorCritic, LMCritic, PopArtValueHead
from ar_torchrl.objectives._keys import policy_tokens, require_key, squeeze_feature
from ar_torchrl.objectives.gae import TokenGAE
from ar_torchrl.objectives.policy_loss import RolloutCorrection, make_policy_loss
from ar_torchrl.utils.checks import check_number, check_ppo_loss_args

__all__ = ["UNSUPPORTED_CLIP_PPO_SETTINGS", "TokenPPOLoss"]

_OWNER = "TokenPPOLoss"

#: No value of a ``ClipPPOLoss`` setting describes TokenPPOLoss: reading the setting raises.
_NO_VALUE = object()

_WHITEN = (
    "the advantages are used as the batch holds them; whiten them in the advantage module "
    "(TokenGAE(normalize_advantage=True); GRPOAdvantage scales per group)"
)
_CRITIC = (
    "pass the critic as critic_network (an LMCritic over a separate model), or use actor_critic's "
    "value head (LMActorCritic(critic=True)) and pass only actor_critic"
)

#: ``ClipPPOLoss``/``PPOLoss`` settings TokenPPOLoss does not have, ``name -> (value, hint)``:
#: ``value`` is the TorchRL value that describes what TokenPPOLoss does (the attribute reads it;
#: passing or setting it is accepted), ``_NO_VALUE`` where none does (reading raises); any other
#: value raises, with ``hint`` saying what to use instead.
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

#: ``ClipPPOLoss`` constructor arguments that are not settings of TokenPPOLoss: ``name -> hint``.
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


def _no_value_message(name: str) -> str:
    return f"{_OWNER} has no {name}: {UNSUPPORTED_CLIP_PPO_SETTINGS[name][1]}"


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


class TokenPPOLoss(ClipPPOLoss):
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
            :func:`~ar_torchrl.objectives.register_policy_loss`.
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

    Output (every entry listed in :attr:`out_keys`): the summed terms ``loss_objective``,
    ``loss_critic``, ``loss_entropy``, ``loss_kl``, and detached metrics. **Every metric is reduced
    over the trained tokens** ``T`` (``loss_mask``; ``n = |T|``) and nothing else. A name TorchRL's
    ``ClipPPOLoss`` or verl's ``core_algos.py`` also emits has *their* definition, with ``T`` as
    the sample batch (so a curve compares like with like); ours have names of their own. With
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
    ``ESS``                       ``exp(2 logsumexp(lr) - logsumexp(2 lr)) / n`` TorchRL
                                  ``= (sum r)^2 / sum r^2 / n``
    ``entropy``                   mean per-token entropy of the policy           TorchRL
    ``value_clip_fraction``       fraction with ``|V - V_old| > clip_value``     TorchRL
                                  (0 without ``clip_value``)
    ``vf_clipfrac``               fraction with ``(clamp(V, V_old - clip_value,  verl (and TRL)
                                  V_old + clip_value) - R)^2 > (V - R)^2`` (the
                                  clipped value loss is used; 0 without
                                  ``clip_value``)
    ``explained_variance``        ``1 - Var(R - V) / (Var(R) + eps)``,           TorchRL
                                  population variances, ``eps`` the dtype's
                                  machine epsilon (huge and negative when ``R``
                                  is constant over ``T`` but ``V`` is not)
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

    With a ``policy_loss`` other than ``clip``, ``pg_clipfrac`` is the fraction of trained tokens
    whose gradient the loss's clip changed (GSPO: the clipped branch is taken, verl's definition;
    CISPO: the weight was clamped), and the ratio metrics still describe the token ratio
    ``pi / pi_old``. The tis_* weights are those of ``tis_cap`` or of the rollout correction's
    ``is_level`` (``token`` or ``sequence``).

    Where TorchRL's definitions are not met exactly: TorchRL does not clamp ``lr``, so its ratio
    statistics differ once a trained token has ``|lr| > 20`` (its ``max_ratio`` then overflows to
    ``inf`` above ``lr = 88.7``; ours stay finite); TorchRL reduces ``ESS`` and
    ``explained_variance`` over the first batch dimension only (a ``[B, L]`` batch gives ``[L]``
    vectors), ours treat the trained tokens as one flat batch; and a batch without trained tokens
    gives 1 for the ratio statistics and 0 for the other metrics (TorchRL: ``nan``). ``kl_approx``,
    ``mean_ratio``, ``max_ratio`` and ``ESS`` describe ``pi / pi_old`` (TorchRL without
    ``delay_actor``): the ``tis_cap`` weight is not part of them. ``pg_clipfrac`` +
    ``pg_clipfrac_lower`` is the fraction of tokens with zero policy gradient from the clip.

    ``entropy`` is present only when entropies are computed (``entropy_coeff > 0`` or the actor's
    ``return_entropy``), the critic metrics only with a critic, ``pg_clipfrac_lower`` only with
    ``dual_clip``, ``loss_kl``/``kl_ref`` only with ``kl_coeff > 0``,
    ``rollout_log_prob_abs_diff`` and the ``rollout_*`` mismatch metrics only when the batch holds
    ``rollout_log_prob``, the ``tis_*`` ones only with an IS weight, ``rollout_masked_*`` only with
    a rejection mask. One name per
    metric: there are no aliases.

    Inherited ``ClipPPOLoss`` settings TokenPPOLoss does not honour (``reduction``,
    ``loss_critic_type``, ``normalize_advantage``, ``separate_losses``, ``samples_mc_entropy``,
    ``delay_actor``, ``max_importance_ratio``, ... see :data:`UNSUPPORTED_CLIP_PPO_SETTINGS`) raise
    when passed or set to anything but the behaviour TokenPPOLoss has, naming what to use instead;
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
        >>> out = TokenPPOLoss(ac, clip_epsilon=(0.2, 0.28), clip_value=0.2)(td)
        >>> out["min_ratio"].item(), out["max_ratio"].item(), out["kl_approx"].item()
        (1.0, 1.0, 0.0)
    """

    @dataclass
    class _AcceptedKeys(ClipPPOLoss._AcceptedKeys):
        """TorchRL's PPO keys plus ``loss_mask``, ``rollout_log_prob``, ``ref_log_prob`` and
        ``policy_mask`` (optional: rows whose tokens train the critic only)."""

        loss_mask: NestedKey = "loss_mask"
        rollout_log_prob: NestedKey = "rollout_log_prob"
        ref_log_prob: NestedKey = "ref_log_prob"
        policy_mask: NestedKey = "policy_mask"

        def __post_init__(self):
            if self.sample_log_prob is None:
                self.sample_log_prob = "sample_log_prob"

    default_keys = _AcceptedKeys

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
        if a["entropy_coeff"] and not actor_critic.return_entropy:
            actor_critic.return_entropy = True
            actor_critic._refresh_keys()
        if critic_network is None and a["critic_coeff"]:
            critic_network = actor_critic  # the value head on the policy: one forward
        super().__init__(
            actor_critic,
            critic_network,
            clip_epsilon=a["clip_epsilon"],
            entropy_bonus=bool(a["entropy_coeff"]),
            entropy_coeff=a["entropy_coeff"],
            critic_coeff=a["critic_coeff"] or None,
            clip_value=a["clip_value"],
            functional=False,
        )
        self.dual_clip = a["dual_clip"]
        self.kl_coeff = a["kl_coeff"]
        self.kl_estimator = a["kl_estimator"]
        self.loss_agg_mode = a["loss_agg_mode"]
        self.norm_length = a["norm_length"]
        self.tis_cap = a["tis_cap"]
        self.policy_loss = policy_loss
        low, high = (
            (float(self.clip_epsilon_low), float(self.clip_epsilon_high))
            if self._asymmetric_clip
            else (float(self.clip_epsilon),) * 2
        )
        self._policy_loss_fn = make_policy_loss(
            policy_loss, policy_loss_options, clip_low=low, clip_high=high, dual_clip=self.dual_clip
        )
        self.rollout_correction = _rollout_correction(rollout_correction, self.tis_cap)
        self._settings_frozen = True  # from here on, __setattr__ guards ClipPPOLoss's settings

    # ------------------------------------------------------------------ inherited settings
    def __setattr__(self, name: str, value: Any) -> None:
        if not self.__dict__.get("_settings_frozen", False):
            if name in UNSUPPORTED_CLIP_PPO_SETTINGS:
                return  # ClipPPOLoss.__init__ writing its defaults: TokenPPOLoss has none of them
            super().__setattr__(name, value)
            return
        if name in UNSUPPORTED_CLIP_PPO_SETTINGS:
            honoured, hint = UNSUPPORTED_CLIP_PPO_SETTINGS[name]
            if honoured is _NO_VALUE or not _same(value, honoured):
                raise ValueError(f"{_OWNER}.{name} = {value!r} is not supported: {hint}")
            return
        self._check_setting(name, value)
        super().__setattr__(name, value)

    def __getattr__(self, name: str) -> Any:
        if name in UNSUPPORTED_CLIP_PPO_SETTINGS:  # a property below raised: keep its message
            raise AttributeError(_no_value_message(name))
        return super().__getattr__(name)

    def _check_setting(self, name: str, value: Any) -> None:
        """Assignments ClipPPOLoss would accept but TokenPPOLoss would silently not honour."""
        number = isinstance(value, numbers.Real)  # bool included: check_number rejects it
        if name == "critic_network" and value is not self.critic_network:
            raise ValueError(
                f"{_OWNER}.critic_network cannot be replaced (the old values, the value estimator and "
                "the optimizer were built for it): build a new TokenPPOLoss(actor_critic, "
                "critic_network=...)"
            )
        if name == "critic_coeff" and not self._has_critic:
            raise ValueError(
                f"{_OWNER}.critic_coeff = {value!r} has no effect on a loss built without a critic "
                "term: build TokenPPOLoss(critic_coeff=...) with a positive value (it may be "
                "scheduled to 0 later)"
            )
        if name == "critic_coeff" and value is None:
            raise ValueError(
                f"{_OWNER}.critic_coeff = None is not supported once built: set 0 to switch the "
                "critic term off"
            )
        if name == "entropy_coeff" and number and not isinstance(value, bool) and value:
            if not self.entropy_bonus:
                raise ValueError(
                    f"{_OWNER}.entropy_coeff = {value!r} has no effect on a loss built with "
                    "entropy_coeff=0 (no entropy term, entropies not computed): build "
                    "TokenPPOLoss(entropy_coeff=...) with a positive value (it may be scheduled "
                    "to 0 later)"
                )
        if name == "entropy_bonus" and value and not self.actor_network.return_entropy:
            raise ValueError(
                f"{_OWNER}.entropy_bonus = {value!r} needs entropies: build "
                "TokenPPOLoss(entropy_coeff=...) with a positive value instead"
            )
        if name in ("entropy_coeff", "critic_coeff") and number:
            check_number(_OWNER, name, value, ge=0)
        if name == "clip_value" and isinstance(value, bool):
            raise TypeError(
                f"{_OWNER}.clip_value = {value!r} is not supported (ClipPPOLoss reads True as "
                "'clip at clip_epsilon'): pass the value clip range as a float, or None to disable "
                "value clipping"
            )
        if name == "clip_value" and number:
            check_number(_OWNER, name, value, gt=0, hint="None disables value clipping")

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
        if "action" in kwargs and self.__dict__.get("_settings_frozen", False):
            raise ValueError(
                f"{_OWNER}.set_keys(action=...) is not supported: the actions are the tokens "
                "actor_critic reads; rename them with actor_critic.set_keys(tokens=...)"
            )
        super().set_keys(**kwargs)

    def loss_critic(self, tensordict: TensorDictBase) -> None:
        """Not available: TorchRL's (unmasked, ``loss_critic_type``) critic loss is not this loss's."""
        raise NotImplementedError(
            f"{_OWNER}.loss_critic(td) is ClipPPOLoss's unmasked critic loss and is not "
            "available: read forward(td)['loss_critic'] (masked by loss_mask, aggregated by "
            "loss_agg_mode)"
        )

    @property
    def actor_critic(self) -> LMActorCritic:
        return self.actor_network

    @property
    def separate_critic(self) -> bool:
        """Whether the values come from a separate critic model (``critic_network``)."""
        return self._has_critic and self.critic_network is not self.actor_network

    @property
    def out_keys(self) -> list[NestedKey]:
        """Every key the output may hold for this configuration (see the class docstring)."""
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

    @out_keys.setter
    def out_keys(self, values) -> None:
        self._out_keys = values

    # ------------------------------------------------------------------ value estimator
    def make_value_estimator(self, value_type=None, **hyperparams) -> TokenPPOLoss:
        """Build the advantage module used when a batch has no ``advantage`` (a :class:`TokenGAE`).

        ``value_type`` may be ``None``/``ValueEstimators.GAE``/``TokenGAE`` (hyper-parameters go to
        ``TokenGAE``, default ``gamma=1.0, lmbda=0.95``) or a ready ``ValueEstimatorBase`` instance.
        For GRPO, run :class:`GRPOAdvantage` on the batch before the loss instead.
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
        self._set_in_keys()

    def _set_in_keys(self) -> None:
        k = self.tensor_keys
        keys = [*self.actor_network.in_keys, k.sample_log_prob, k.value, k.loss_mask, k.advantage]
        self._in_keys = keys + [k.value_target] if self._has_critic else keys

    # ------------------------------------------------------------------ loss
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

    def forward(
        self, tensordict: TensorDictBase, normalizer: torch.Tensor | float | None = None
    ) -> TensorDict:
        k = self.tensor_keys
        if tensordict.batch_dims != 2:
            raise ValueError(
                f"{_OWNER} expects a [B, L] token trajectory, got batch_size {tuple(tensordict.batch_size)}"
            )
        mask = self._get(tensordict, k.loss_mask, "bool [B, L], True on generated tokens")
        if mask.dtype != torch.bool:
            raise TypeError(f"{_OWNER}: {k.loss_mask!r} must be bool, got {mask.dtype}")
        if tensordict.get(k.advantage, None) is None:
            self.value_estimator(tensordict)
        critic_mask = mask
        mask = self._policy_mask(tensordict, critic_mask)  # the policy's tokens
        has_policy_mask = tensordict.get(k.policy_mask, None) is not None
        normalizer, critic_normalizer = self._split_normalizer(normalizer, has_policy_mask)
        new = self.actor_network(self.actor_network.select_inputs(tensordict))
        out: dict[str, torch.Tensor] = {}
        log_prob = new.get(self.actor_network.log_prob_key)
        self._policy_terms(tensordict, log_prob, mask, normalizer, out)
        if self._has_critic:
            critic = self.critic_network
            values = critic(critic.select_inputs(tensordict)) if self.separate_critic else new
            value = values.get(critic.value_key).squeeze(-1)
            self._critic_terms(tensordict, value, critic_mask, critic_normalizer, out)
            if has_policy_mask:  # the policy's rows alone
                target = self._get(tensordict, k.value_target, "value_target [B, L, 1]")
                out["explained_variance_policy_rows"] = _torchrl_explained_variance(
                    value.detach(), target, mask
                )
        if self.entropy_bonus or self.actor_network.return_entropy:
            entropy = new.get(self.actor_network.entropy_key)
            out["entropy"] = functional.masked_mean(entropy.detach(), mask)
            if self.entropy_bonus:
                out["loss_entropy"] = -self.entropy_coeff * self._agg(entropy, mask, normalizer)
        if self.kl_coeff:
            ref = self._get(
                tensordict,
                k.ref_log_prob,
                "reference log-probs: recompute_old_log_probs_and_values(..., ref_actor=...)",
            )
            old = tensordict.get(k.sample_log_prob) if self.kl_estimator == "k3_unbiased" else None
            kl = functional.kl_penalty(
                log_prob, ref, mask, estimator=self.kl_estimator, old_log_prob=old
            )
            out["loss_kl"] = self.kl_coeff * self._agg(kl, mask, normalizer)
            k3 = kl if self.kl_estimator == "k3" else functional.k3_kl(log_prob.detach(), ref, mask)
            out["kl_ref"] = functional.masked_mean(
                k3.detach(), mask
            )  # the k3 estimate, any estimator
        return TensorDict(out, batch_size=[])

    def _policy_terms(self, td, log_prob, mask, normalizer, out) -> None:
        k = self.tensor_keys
        old = self._get(
            td,
            k.sample_log_prob,
            "PPO anchors: run recompute_old_log_probs_and_values(actor_critic, td, plan)",
        )
        adv = self._get(td, k.advantage, "advantage [B, L, 1]")
        low, high = (
            (self.clip_epsilon_low, self.clip_epsilon_high)
            if self._asymmetric_clip
            else (self.clip_epsilon,) * 2
        )
        if self.policy_loss == "clip":  # the clip range read now: it may be scheduled
            loss, ratio, clipped = functional.clipped_surrogate(
                log_prob,
                old,
                adv,
                mask,
                clip_low=float(low),
                clip_high=float(high),
                dual_clip=self.dual_clip,
            )
        else:
            loss, ratio, clipped = self._policy_loss_fn(log_prob, old, adv, mask)
        rollout = td.get(k.rollout_log_prob, None)
        if rollout is not None:
            rollout = squeeze_feature(rollout, k.rollout_log_prob, td.batch_size, _OWNER)
            out["rollout_log_prob_abs_diff"] = functional.masked_mean(
                (log_prob.detach() - rollout).abs(), mask
            )
            out.update(functional.rollout_mismatch_metrics(old, rollout, mask))
        rc = self.rollout_correction
        if rc is not None:
            if rollout is None:
                raise KeyError(
                    f"{_OWNER}: the rollout correction ({_describe_rc(rc)}) needs "
                    f"{k.rollout_log_prob!r} (the engine's log-probs of the sampled tokens), "
                    "missing from the batch"
                )
            weight, keep, metrics = functional.rollout_correction(
                old, rollout, mask, **rc.arguments()
            )
            loss = torch.where(keep, loss * weight, torch.zeros((), dtype=loss.dtype))
            out.update(metrics)
        out["loss_objective"] = self._agg(loss, mask, normalizer)
        log_ratio = functional.masked_log_ratio(log_prob.detach(), old, mask)
        out.update(_ratio_metrics(log_ratio, mask, self._clip_bounds))
        if self.policy_loss == "clip":
            out.update(
                _verl_policy_clip_fractions(
                    ratio.detach(), adv, mask, float(low), float(high), self.dual_clip
                )
            )
        else:
            out["pg_clipfrac"] = _fraction(clipped, mask)

    def _critic_terms(self, td, value, mask, normalizer, out) -> None:
        k = self.tensor_keys
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
        clip = None if self.clip_value is None else float(self.clip_value)
        head = getattr(self.critic_network.model, "value_head", None)
        if isinstance(head, PopArtValueHead):  # the loss (and its clip) in the layer's own scale
            value, old, target = (head.normalize(x) for x in (value, old, target))
        loss, _ = functional.clipped_value_loss(value, old, target, mask, clip_value=clip)
        out["loss_critic"] = self.critic_coeff * self._agg(loss, mask, normalizer)
        out.update(_critic_metrics(value.detach(), old, target, mask, clip))


def _read_setting(name: str) -> property:
    honoured = UNSUPPORTED_CLIP_PPO_SETTINGS[name][0]

    def get(self) -> Any:
        if honoured is _NO_VALUE:
            raise AttributeError(_no_value_message(name))
        return honoured

    return property(get, doc=f"ClipPPOLoss's ``{name}``: {UNSUPPORTED_CLIP_PPO_SETTINGS[name][1]}.")


for _name in UNSUPPORTED_CLIP_PPO_SETTINGS:
    setattr(TokenPPOLoss, _name, _read_setting(_name))
del _name

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


#: Critic metrics (with a critic), in ``out_keys`` order (TorchRL's, verl's, then ours).
_CRITIC_METRICS = (
    "value_clip_fraction",
    "explained_variance",
    "vf_clipfrac",
    "explained_variance_finite",
)


def _fraction(flags: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return functional.masked_mean((flags & mask).float(), mask)


def _ratio_metrics(
    log_ratio: torch.Tensor, mask: torch.Tensor, clip_bounds: tuple[torch.Tensor, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """TorchRL's ratio diagnostics (and ours) over ``mask`` from the detached log-ratio ``[B, L]``.

    ``clip_bounds``: ``ClipPPOLoss._clip_bounds``, ``(log1p(-eps_low), log1p(eps_high))``; the
    band test is TorchRL's ``log_weight.clamp(*bounds) != log_weight``.
    """
    one = torch.ones((), dtype=log_ratio.dtype, device=log_ratio.device)
    low, high = (bound.to(log_ratio.device) for bound in clip_bounds)
    outside = log_ratio.clamp(low, high) != log_ratio
    out = {
        "clip_fraction": _fraction(outside, mask),
        "kl_approx": functional.masked_mean(-log_ratio, mask),
        "approx_kl": functional.masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
    }
    if not bool(mask.any()):
        return {**out, "mean_ratio": one, "max_ratio": one, "min_ratio": one, "ESS": one}
    lw = log_ratio[mask]
    ratio = lw.exp()
    ess = (2 * lw.logsumexp(0) - (2 * lw).logsumexp(0)).exp()
    return {
        **out,
        "mean_ratio": ratio.mean(),
        "max_ratio": ratio.max(),
        "min_ratio": ratio.min(),
        "ESS": ess / lw.numel(),
    }


def _verl_policy_clip_fractions(
    ratio: torch.Tensor,
    advantage: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> dict[str, torch.Tensor]:
    """verl's ``pg_clipfrac`` (and ``pg_clipfrac_lower`` with ``dual_clip``) over ``mask``.

    verl's ``compute_policy_loss_vanilla``: ``pg_losses1 = -A r``, ``pg_losses2 = -A clip(r)``;
    ``pg_clipfrac`` counts ``pg_losses2 > pg_losses1``, ``pg_clipfrac_lower`` counts ``A < 0`` and
    ``max(pg_losses1, pg_losses2) > -c A``. ``ratio``: the loss's (clamped) ``[B, L]`` ratio.
    """
    adv = torch.where(mask, advantage, torch.zeros((), dtype=ratio.dtype, device=ratio.device))
    losses1 = -adv * ratio
    losses2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    out = {"pg_clipfrac": _fraction(losses2 > losses1, mask)}
    if dual_clip is not None:
        lower = (torch.maximum(losses1, losses2) > -adv * dual_clip) & (adv < 0)
        out["pg_clipfrac_lower"] = _fraction(lower, mask)
    return out


def _critic_metrics(
    value: torch.Tensor,
    old_value: torch.Tensor,
    target: torch.Tensor,
    mask: torch.Tensor,
    clip_value: float | None,
) -> dict[str, torch.Tensor]:
    """TorchRL's, verl's and our critic diagnostics over ``mask`` (``[B, L]`` tensors, detached)."""
    zero = torch.zeros((), dtype=value.dtype, device=value.device)
    v, old, tgt = (torch.where(mask, x, zero) for x in (value, old_value, target))
    out = {"explained_variance_finite": functional.explained_variance(value, target, mask)}
    if clip_value is None:
        out["value_clip_fraction"], out["vf_clipfrac"] = zero.clone(), zero.clone()
    else:
        diff = v - old  # TorchRL's _clip_value_loss: pre_clipped != pre_clipped.clamp(-c, c)
        out["value_clip_fraction"] = _fraction(diff.clamp(-clip_value, clip_value) != diff, mask)
        v_clip = torch.max(torch.min(v, old + clip_value), old - clip_value)  # verl clip_by_value
        out["vf_clipfrac"] = _fraction((v_clip - tgt) ** 2 > (v - tgt) ** 2, mask)
    out["explained_variance"] = _torchrl_explained_variance(v, tgt, mask)
    return out


def _torchrl_explained_variance(
    value: torch.Tensor, target: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """TorchRL's ``1 - Var(R - V) / (Var(R) + eps)`` (population variances) over the tokens of
    ``mask`` as one batch; 0 without any."""
    if not bool(mask.any()):
        return torch.zeros((), dtype=value.dtype, device=value.device)
    tgt, pred = target[mask], value[mask]
    eps = torch.finfo(tgt.dtype).eps
    resid = torch.var(tgt - pred, correction=0)
    return 1.0 - resid / (torch.var(tgt, correction=0) + eps)


def _check_actor(actor_critic, critic_coeff: float | None, critic_network) -> None:
    if not isinstance(actor_critic, LMActorCritic):
        raise TypeError(f"{_OWNER} needs an LMActorCritic, got {type(actor_critic).__name__}")
    if critic_network is not None:
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
