"""``TokenPPOLoss``: TorchRL's ``ClipPPOLoss`` for token trajectories, masked by ``loss_mask``.

Departures from ``torchrl.objectives.ClipPPOLoss`` (docs/design.md section 8 lists why):

- one backbone forward of an :class:`~ar_torchrl.modules.LMActorCritic` gives new log-probs *and*
  values (the actor and critic are one module);
- every ``loss_*`` term **and every metric** is reduced over ``loss_mask`` only, with the
  aggregation mode of :func:`ar_torchrl.functional.aggregate_loss` and an optional global normaliser
  (``loss(td, normalizer=...)``) so gradient accumulation over micro-batches equals one big batch;
- the value loss is ``0.5 * max((V - R)^2, (V_clip - R)^2)`` anchored at the recomputed
  ``state_value``; optional dual-clip, k3 KL to a reference policy and truncated importance sampling
  against ``rollout_log_prob`` (Yao et al. 2025, "Your efficient RL framework secretly brings you
  off-policy RL training").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.utils import NestedKey
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.utils import ValueEstimators
from torchrl.objectives.value import ValueEstimatorBase

from ar_torchrl import functional as F
from ar_torchrl.functional import AggregationMode
from ar_torchrl.modules import LMActorCritic
from ar_torchrl.objectives._keys import require_key, squeeze_feature
from ar_torchrl.objectives.gae import TokenGAE
from ar_torchrl.utils.checks import check_ppo_loss_args

__all__ = ["TokenPPOLoss"]

_OWNER = "TokenPPOLoss"


class TokenPPOLoss(ClipPPOLoss):
    """Clipped PPO (actor) + clipped value (critic) loss over the trained tokens of a trajectory.

    Args:
        actor_critic: the :class:`~ar_torchrl.modules.LMActorCritic` being trained.
        clip_epsilon: ``eps`` or ``(eps_low, eps_high)`` (DAPO clip-higher).
        dual_clip: dual-clip constant ``c > 1`` for negative advantages (``None``: off).
        clip_value: value-clip range around the anchor values (``None``: unclipped).
        entropy_coeff: weight of the entropy bonus (0 disables it and skips entropy computation).
        critic_coeff: weight of the value loss (``None`` or 0: no critic term).
        kl_coeff: weight of the k3 KL to ``ref_log_prob`` (0: off; the key is then not needed).
        loss_agg_mode: ``token_mean`` | ``seq_mean_token_mean`` | ``seq_mean_token_sum`` |
            ``seq_mean_token_sum_norm``.
        norm_length: the constant length for ``seq_mean_token_sum_norm`` (e.g. max_new_tokens).
        tis_cap: truncated importance sampling cap: per-token policy losses are weighted by
            ``min(exp(sample_log_prob - rollout_log_prob), tis_cap)`` (``None``: off).

    Reads ``sample_log_prob``, ``state_value``, ``advantage`` (computed with the value estimator,
    :class:`TokenGAE` by default, when missing), ``value_target``, ``loss_mask`` and the actor's
    ``tokens``/``attention_mask``; optionally ``ref_log_prob`` and ``rollout_log_prob``. Keys are
    changed with :meth:`set_keys` (TorchRL's mechanism; the value estimator follows).

    Output (every entry listed in :attr:`out_keys`; every metric is reduced over ``loss_mask`` only,
    log-ratios clamped to ``[-20, 20]`` first):

    - ``loss_objective``, ``loss_critic``, ``loss_entropy``, ``loss_kl``: the summed terms;
    - TorchRL's ``ClipPPOLoss`` names, same definitions: ``clip_fraction``, ``kl_approx``
      (``mean(log pi_old - log pi)``, the k1 estimate of KL(old || new)), ``mean_ratio``,
      ``max_ratio``, ``ESS`` (``(sum r)^2 / sum r^2 / n``), ``entropy``, ``value_clip_fraction``,
      ``explained_variance``;
    - ours: ``approx_kl`` (``mean((r - 1) - log r)``, the non-negative k3 estimate, as CleanRL logs it),
      ``min_ratio`` (named as TorchRL's ``max_ratio``), ``kl_ref`` (k3 KL to the reference policy)
      and ``rollout_log_prob_abs_diff`` (only when the batch holds ``rollout_log_prob``). One name
      per metric: there are no aliases.

    ``entropy`` is present only when entropies are computed (``entropy_coeff > 0`` or the actor's
    ``return_entropy``), the critic metrics only with a critic, ``loss_kl``/``kl_ref`` only with
    ``kl_coeff > 0``. A batch without trained tokens gives ratio statistics of 1 and 0 elsewhere.

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
        ...     anchors = ac(td.select("tokens", "attention_mask"))
        >>> td["sample_log_prob"], td["state_value"] = anchors["log_prob"], anchors["state_value"]
        >>> out = TokenPPOLoss(ac, clip_epsilon=(0.2, 0.28), clip_value=0.2)(td)
        >>> out["min_ratio"].item(), out["max_ratio"].item(), out["kl_approx"].item()
        (1.0, 1.0, 0.0)
    """

    @dataclass
    class _AcceptedKeys(ClipPPOLoss._AcceptedKeys):
        """TorchRL's PPO keys plus ``loss_mask``, ``rollout_log_prob`` and ``ref_log_prob``."""

        loss_mask: NestedKey = "loss_mask"
        rollout_log_prob: NestedKey = "rollout_log_prob"
        ref_log_prob: NestedKey = "ref_log_prob"

        def __post_init__(self):
            if self.sample_log_prob is None:
                self.sample_log_prob = "sample_log_prob"

    default_keys = _AcceptedKeys

    def __init__(
        self,
        actor_critic: LMActorCritic,
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
    ) -> None:
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
        )
        _check_actor(actor_critic, a["critic_coeff"])
        if a["entropy_coeff"] and not actor_critic.return_entropy:
            actor_critic.return_entropy = True
            actor_critic._refresh_keys()
        super().__init__(
            actor_critic,
            actor_critic if a["critic_coeff"] else None,
            clip_epsilon=a["clip_epsilon"],
            entropy_bonus=bool(a["entropy_coeff"]),
            entropy_coeff=a["entropy_coeff"],
            critic_coeff=a["critic_coeff"] or None,
            clip_value=a["clip_value"],
            functional=False,
        )
        self.dual_clip = a["dual_clip"]
        self.kl_coeff = a["kl_coeff"]
        self.loss_agg_mode = a["loss_agg_mode"]
        self.norm_length = a["norm_length"]
        self.tis_cap = a["tis_cap"]

    @property
    def actor_critic(self) -> LMActorCritic:
        return self.actor_network

    @property
    def out_keys(self) -> list[NestedKey]:
        """Every key the output may hold for this configuration (see the class docstring)."""
        keys = ["loss_objective"]
        if self._has_critic:
            keys += ["loss_critic", "value_clip_fraction", "explained_variance"]
        if self.entropy_bonus:
            keys += ["loss_entropy"]
        if self.kl_coeff:
            keys += ["loss_kl", "kl_ref"]
        keys += list(_POLICY_METRICS) + ["rollout_log_prob_abs_diff"]
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
            self._value_estimator = TokenGAE(value_network=self.actor_network, **hyperparams)
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
    def global_normalizer(self, tensordicts: TensorDictBase | list[TensorDictBase]) -> torch.Tensor:
        """Sum of the default normalisers of ``tensordicts`` (e.g. all micro-batches of a mini-batch).

        Pass it as ``loss(mb, normalizer=...)`` to every micro-batch so that the accumulated
        gradient equals the gradient of one forward over their union.
        """
        tds = [tensordicts] if isinstance(tensordicts, TensorDictBase) else list(tensordicts)
        key = self.tensor_keys.loss_mask
        return sum(
            F.loss_normalizer(
                require_key(td, key, _OWNER, "bool [B, L]").bool(), self.loss_agg_mode
            )
            for td in tds
        )

    def _agg(self, x: torch.Tensor, mask: torch.Tensor, normalizer) -> torch.Tensor:
        return F.aggregate_loss(
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
        new = self.actor_network(self.actor_network.select_inputs(tensordict))
        out: dict[str, torch.Tensor] = {}
        log_prob = new.get(self.actor_network.log_prob_key)
        self._policy_terms(tensordict, log_prob, mask, normalizer, out)
        if self._has_critic:
            self._critic_terms(
                tensordict, new.get(self.actor_network.value_key).squeeze(-1), mask, normalizer, out
            )
        if self.entropy_bonus or self.actor_network.return_entropy:
            entropy = new.get(self.actor_network.entropy_key)
            out["entropy"] = F.masked_mean(entropy.detach(), mask)
            if self.entropy_bonus:
                out["loss_entropy"] = -self.entropy_coeff * self._agg(entropy, mask, normalizer)
        if self.kl_coeff:
            ref = self._get(
                tensordict,
                k.ref_log_prob,
                "reference log-probs: recompute_anchors(..., ref_actor=...)",
            )
            kl = F.k3_kl(log_prob, ref, mask)
            out["loss_kl"] = self.kl_coeff * self._agg(kl, mask, normalizer)
            out["kl_ref"] = F.masked_mean(kl.detach(), mask)
        return TensorDict(out, batch_size=[])

    def _policy_terms(self, td, log_prob, mask, normalizer, out) -> None:
        k = self.tensor_keys
        old = self._get(
            td, k.sample_log_prob, "PPO anchors: run recompute_anchors(actor_critic, td, plan)"
        )
        adv = self._get(td, k.advantage, "advantage [B, L, 1]")
        low, high = (
            (self.clip_epsilon_low, self.clip_epsilon_high)
            if self._asymmetric_clip
            else (self.clip_epsilon,) * 2
        )
        loss, _, clipped = F.clipped_surrogate(
            log_prob,
            old,
            adv,
            mask,
            clip_low=float(low),
            clip_high=float(high),
            dual_clip=self.dual_clip,
        )
        rollout = td.get(k.rollout_log_prob, None)
        if rollout is not None:
            rollout = squeeze_feature(rollout, k.rollout_log_prob, td.batch_size, _OWNER)
            out["rollout_log_prob_abs_diff"] = F.masked_mean(
                (log_prob.detach() - rollout).abs(), mask
            )
        if self.tis_cap is not None:
            if rollout is None:
                raise KeyError(
                    f"{_OWNER}: tis_cap is set but {k.rollout_log_prob!r} is missing from the batch"
                )
            weight = torch.exp(F.masked_log_ratio(old, rollout, mask)).clamp(max=self.tis_cap)
            loss = loss * weight.detach()
        out["loss_objective"] = self._agg(loss, mask, normalizer)
        out.update(_policy_metrics(F.masked_log_ratio(log_prob.detach(), old, mask), clipped, mask))

    def _critic_terms(self, td, value, mask, normalizer, out) -> None:
        k = self.tensor_keys
        old = self._get(td, k.value, "anchor values: run recompute_anchors(actor_critic, td, plan)")
        target = self._get(
            td,
            k.value_target,
            "the critic's targets: TokenGAE writes them; with GRPO/RLOO advantages use "
            "GRPOAdvantage(critic_targets=True) (or RLOOAdvantage(critic_targets=True)), or train "
            "without a critic: TokenPPOLoss(critic_coeff=0)",
        )
        clip = None if self.clip_value is None else float(self.clip_value)
        loss, clipped = F.clipped_value_loss(value, old, target, mask, clip_value=clip)
        out["loss_critic"] = self.critic_coeff * self._agg(loss, mask, normalizer)
        out["value_clip_fraction"] = F.masked_mean(clipped.float(), mask)
        out["explained_variance"] = F.explained_variance(value.detach(), target, mask)


#: Policy metrics of every call, in ``out_keys`` order (TorchRL's names first, then ours).
_POLICY_METRICS = (
    "clip_fraction",
    "kl_approx",
    "mean_ratio",
    "max_ratio",
    "ESS",
    "approx_kl",
    "min_ratio",
)


def _policy_metrics(
    log_ratio: torch.Tensor, clipped: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Ratio / KL diagnostics over ``mask`` from the (detached, clamped) log-ratio ``[B, L]``."""
    ratio = torch.exp(log_ratio)
    has = bool(mask.any())
    one = torch.ones((), dtype=ratio.dtype, device=ratio.device)
    mean = F.masked_mean(ratio, mask)
    top = ratio[mask].max() if has else one
    sq = F.masked_mean(ratio * ratio, mask)
    return {
        "clip_fraction": F.masked_mean(clipped.float(), mask),
        "kl_approx": F.masked_mean(-log_ratio, mask),
        "mean_ratio": mean if has else one,
        "max_ratio": top,
        "ESS": mean * mean / sq if has else one,
        "approx_kl": F.masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
        "min_ratio": ratio[mask].min() if has else one,
    }


def _check_actor(actor_critic, critic_coeff: float | None) -> None:
    if not isinstance(actor_critic, LMActorCritic):
        raise TypeError(f"{_OWNER} needs an LMActorCritic, got {type(actor_critic).__name__}")
    if critic_coeff and not actor_critic.critic:
        raise ValueError(
            f"{_OWNER}: critic_coeff={critic_coeff} needs an LMActorCritic with a value head "
            "(critic=True); pass critic_coeff=None (or 0) for an actor-only loss such as GRPO"
        )
