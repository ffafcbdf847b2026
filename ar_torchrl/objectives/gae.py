"""``TokenGAE``: TorchRL value estimator computing GAE over ``loss_mask`` tokens, one step per token
or, for multi-turn trajectories, one step per turn."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey
from torchrl.objectives.value import ValueEstimatorBase

from ar_torchrl.functional import (
    check_finite_reward,
    count_turns,
    length_adaptive_lmbda,
    masked_whiten,
    token_gae,
    turn_gae,
)
from ar_torchrl.objectives._keys import (
    MissingKeyError,
    policy_tokens,
    require_key,
    squeeze_feature,
)
from ar_torchrl.utils.checks import GAETimestep, check_gae_args

__all__ = ["MissingKeyError", "TokenGAE"]


class TokenGAE(ValueEstimatorBase):
    """GAE over the ``loss_mask`` tokens of a ``[B, L]`` token trajectory, per token or per turn.

    A thin wrapper around :func:`ar_torchrl.functional.token_gae` (``timestep="token"``, the
    default) or :func:`ar_torchrl.functional.turn_gae` (``timestep="turn"``); see them for the
    equations. Reads ``("next", "reward")``, ``state_value`` (the old values from
    :func:`~ar_torchrl.objectives.recompute_old_log_probs_and_values`) and ``loss_mask`` (and ``turn_id`` per turn);
    writes ``advantage`` and ``value_target`` ``[B, L, 1]``. Keys follow TorchRL and are changed
    with :meth:`set_keys` (``loss_mask``, ``turn_id`` and ``attention_mask`` are ours).

    Multi-turn trajectories (docs/design.md section 1b): at token level tool/observation tokens
    consume no step and values and advantages carry across them; at turn level each turn is one
    step whose value is ``state_value`` at its first trained token and whose reward is the sum of
    its rewards, and the turn's advantage and value target go to all its trained tokens. Either
    way rewards sit on trained tokens only (the outcome on the last one, per-turn rewards on each
    turn's last one) and ``normalize_advantage`` whitens over all trained tokens.

    Call contract (shared with :class:`GRPOAdvantage`, as TorchRL's value estimators): every call
    ``td = module(td)`` recomputes and overwrites ``advantage``/``value_target``. A NaN/inf reward is
    an error naming its row and position.

    Args:
        gamma: discount (1.0 for LLMs).
        lmbda: GAE lambda for the advantage.
        critic_lmbda: lambda for ``value_target`` (VAPO's decoupled GAE uses 1.0); default ``lmbda``.
        adaptive_lmbda_alpha: if set, the advantage lambda of each row is VAPO's
            ``1 - 1 / (alpha * length)`` (``lmbda`` is then ignored).
        normalize_advantage: whiten the advantage over all trained tokens of the batch (over
            ``loss_mask & policy_mask`` when the batch has a ``policy_mask``: rows kept for the
            critic only do not shift the policy's advantages).
        bootstrap_truncated: for rows whose episode was cut (``("next", "terminated")`` False at
            the last trained token: by length, ``max_turns`` or ``max_total_tokens``), the step
            after the last one (token or turn) is valued at ``("next", "state_value")`` of the
            row's last real token (``attention_mask``): ``V`` of the state after everything the
            episode holds, the value the next turn's first token would have had. That is the last
            trained token itself unless a tool output follows it (always so for single-turn
            rows). Off (the default): every row ends with ``V = 0`` (terminal).

            **This default differs from TorchRL's** ``GAE``, which bootstraps every step that is
            done but not terminated with ``V`` of the next state: on a row cut by length the last
            token's advantage is ``r - V`` here and ``r + gamma * V_next - V`` there, and the
            difference ``gamma * lmbda^k * V_next`` reaches the ``k``-th token before the cut (up to
            0.685 in advantage measured with a trained critic, issue 30;
            ``tests/objectives/test_gae.py`` pins the two against each other). Why off: the
            cut response is never continued (the next batch starts from new prompts), so no return
            ever follows its last state; its reward (the verifier's score of the cut answer, plus
            any overlong penalty) is its whole return, as DAPO and verl score truncated answers.
            Bootstrapping credits it with the critic's value of finishing, which it never gets.
            Set ``bootstrap_truncated=True`` for TorchRL's behaviour.
        timestep: ``"token"`` (one GAE step per trained token) or ``"turn"`` (one per turn of a
            multi-turn episode, read from ``turn_id``: AReaL's ``gae_timestep_unit: turn``;
            ``adaptive_lmbda_alpha`` then counts turns, not tokens).
        value_network: optional; if given and ``state_value`` is missing it is computed (no grad)
            on the whole batch. Prefer :func:`recompute_old_log_probs_and_values` with a micro-batch plan.

    Example:
        >>> from tensordict import TensorDict
        >>> mask = torch.tensor([[False, True, True]])
        >>> td = TensorDict({"loss_mask": mask, "state_value": torch.zeros(1, 3, 1),
        ...     "next": {"reward": torch.tensor([[[0.0], [0.0], [1.0]]]),
        ...              "done": mask.unsqueeze(-1) & torch.tensor([[[False], [False], [True]]]),
        ...              "terminated": torch.tensor([[[False], [False], [True]]])}}, [1, 3])
        >>> TokenGAE(gamma=1.0, lmbda=0.95)(td)["advantage"].squeeze(-1).tolist()
        [[0.0, 0.949999988079071, 1.0]]
    """

    @dataclass
    class _AcceptedKeys(ValueEstimatorBase._AcceptedKeys):
        """TorchRL's value-estimator keys plus ``loss_mask`` (bool ``[B, L]``), ``turn_id`` (int64
        ``[B, L]``, read with ``timestep="turn"``) and ``attention_mask`` (bool ``[B, L]``, read
        with ``bootstrap_truncated``).

        TorchRL 0.14.1 workaround: ``ValueEstimatorBase.set_keys`` checks names against
        ``_AcceptedKeys.__dict__``, which for a dataclass subclass only lists the fields declared in
        the subclass itself, so the inherited keys are re-declared here (pinned by
        ``tests/objectives/test_objectives.py::test_token_gae_set_keys_accepts_inherited_names``).
        """

        advantage: NestedKey = "advantage"
        value_target: NestedKey = "value_target"
        value: NestedKey = "state_value"
        reward: NestedKey = "reward"
        done: NestedKey = "done"
        terminated: NestedKey = "terminated"
        steps_to_next_obs: NestedKey = "steps_to_next_obs"
        sample_log_prob: NestedKey | None = None
        loss_mask: NestedKey = "loss_mask"
        turn_id: NestedKey = "turn_id"
        attention_mask: NestedKey = "attention_mask"
        policy_mask: NestedKey = "policy_mask"

    default_keys = _AcceptedKeys

    def __init__(
        self,
        *,
        gamma: float = 1.0,
        lmbda: float = 0.95,
        critic_lmbda: float | None = None,
        adaptive_lmbda_alpha: float | None = None,
        normalize_advantage: bool = False,
        bootstrap_truncated: bool = False,
        timestep: GAETimestep = "token",
        value_network=None,
        **kwargs,
    ) -> None:
        args = check_gae_args(
            "TokenGAE",
            gamma=gamma,
            lmbda=lmbda,
            critic_lmbda=critic_lmbda,
            adaptive_lmbda_alpha=adaptive_lmbda_alpha,
            normalize_advantage=normalize_advantage,
            bootstrap_truncated=bootstrap_truncated,
            timestep=timestep,
        )
        super().__init__(value_network=value_network, **kwargs)
        self.gamma, self.lmbda = args["gamma"], args["lmbda"]
        self.critic_lmbda = args["critic_lmbda"]
        self.adaptive_lmbda_alpha = args["adaptive_lmbda_alpha"]
        self.normalize_advantage = args["normalize_advantage"]
        self.bootstrap_truncated = args["bootstrap_truncated"]
        self.timestep = args["timestep"]

    @property
    def in_keys(self) -> list[NestedKey]:
        keys = [
            ("next", self.tensor_keys.reward),
            ("next", self.tensor_keys.done),
            ("next", self.tensor_keys.terminated),
            self.tensor_keys.value,
            self.tensor_keys.loss_mask,
        ]
        if self.bootstrap_truncated:
            keys += [("next", self.tensor_keys.value), self.tensor_keys.attention_mask]
        if self.timestep == "turn":
            keys.append(self.tensor_keys.turn_id)
        return keys

    def _values(self, td: TensorDictBase) -> torch.Tensor:
        key = self.tensor_keys.value
        if td.get(key, None) is None and self.value_network is not None:
            warnings.warn(
                "TokenGAE: no 'state_value' in the batch, computing it with value_network in one "
                "pass over the whole batch, without the micro-batch plan: these values differ (in "
                "the last bits) from what the training forward computes, so value clipping is not "
                "centred on the values the loss sees and the first update's ratio is not exactly "
                "1; run recompute_old_log_probs_and_values(actor_critic, td, plan) with the plan ppo_update uses",
                UserWarning,
                stacklevel=3,
            )
            with torch.no_grad():
                self.value_network(td)
        return require_key(
            td,
            key,
            "TokenGAE",
            "the anchor values: run recompute_old_log_probs_and_values(actor_critic, td, plan)",
        )

    def _bootstrap(self, td: TensorDictBase, mask: torch.Tensor) -> torch.Tensor | None:
        if not self.bootstrap_truncated:
            return None
        shape = mask.shape
        terminated = squeeze_feature(
            require_key(td, ("next", self.tensor_keys.terminated), "TokenGAE", "terminal flags"),
            ("next", self.tensor_keys.terminated),
            shape,
            "TokenGAE",
        ).bool()
        next_key = ("next", self.tensor_keys.value)
        next_value = squeeze_feature(
            require_key(
                td, next_key, "TokenGAE", "bootstrap_truncated needs V after the last token"
            ),
            next_key,
            shape,
            "TokenGAE",
        )
        attn_key = self.tensor_keys.attention_mask
        real = squeeze_feature(
            require_key(
                td,
                attn_key,
                "TokenGAE",
                "bool [B, L], True on real tokens: bootstrap_truncated values the state after "
                "each row's last real token",
            ),
            attn_key,
            shape,
            "TokenGAE",
        ).bool()
        pos = torch.arange(shape[-1], device=mask.device)
        last = torch.where(mask, pos, -1).max(-1).values.clamp_min(0)
        # the state after the episode: after the last real token (a tool output may follow the
        # last trained token in multi-turn rows; single-turn rows end on their last trained token)
        end = torch.where(real | mask, pos, -1).max(-1).values.clamp_min(0)
        rows = torch.arange(shape[0], device=mask.device)
        truncated = mask.any(-1) & ~terminated[rows, last]
        return torch.where(
            truncated, next_value[rows, end], torch.zeros_like(next_value[rows, end])
        )

    def _turn_id(self, td: TensorDictBase, shape: torch.Size) -> torch.Tensor:
        key = self.tensor_keys.turn_id
        turn_id = require_key(
            td,
            key,
            "TokenGAE(timestep='turn')",
            "int64 [B, L]: the turn index on trained tokens, -1 elsewhere; the multi-turn env "
            "writes it (build_trajectory does when segments carry a turn); single-turn batches "
            "use timestep='token'",
        )
        return squeeze_feature(turn_id, key, shape, "TokenGAE")

    def forward(
        self, tensordict: TensorDictBase, *, params=None, target_params=None
    ) -> TensorDictBase:
        keys = self.tensor_keys
        if tensordict.batch_dims != 2:
            raise ValueError(
                f"TokenGAE expects a [B, L] token trajectory (time = last batch dim), got batch_size "
                f"{tuple(tensordict.batch_size)}"
            )
        shape = tensordict.batch_size
        mask = require_key(
            tensordict, keys.loss_mask, "TokenGAE", "bool [B, L], True on generated tokens"
        )
        if mask.dtype != torch.bool:
            raise TypeError(f"TokenGAE: {keys.loss_mask!r} must be bool, got {mask.dtype}")
        reward_key = ("next", keys.reward)
        reward = squeeze_feature(
            require_key(tensordict, reward_key, "TokenGAE", "per-token reward"),
            reward_key,
            shape,
            "TokenGAE",
        )
        check_finite_reward(reward, "TokenGAE", f"reward {reward_key!r}")
        value = squeeze_feature(self._values(tensordict), keys.value, shape, "TokenGAE")
        turn_id = self._turn_id(tensordict, shape) if self.timestep == "turn" else None
        lmbda = self.lmbda
        if self.adaptive_lmbda_alpha is not None:
            steps = mask.sum(-1) if turn_id is None else count_turns(mask, turn_id)
            lmbda = length_adaptive_lmbda(steps, self.adaptive_lmbda_alpha)
        hyper = {
            "gamma": self.gamma,
            "lmbda": lmbda,
            "critic_lmbda": self.critic_lmbda,
            "bootstrap_value": self._bootstrap(tensordict, mask),
        }
        if turn_id is None:
            adv, target = token_gae(reward, value.detach(), mask, **hyper)
        else:
            adv, target = turn_gae(reward, value.detach(), mask, turn_id, **hyper)
        if self.normalize_advantage:  # over the policy's tokens (critic-only rows excluded)
            adv = masked_whiten(adv, policy_tokens(tensordict, keys.policy_mask, mask, "TokenGAE"))
        tensordict.set(keys.advantage, adv.unsqueeze(-1))
        tensordict.set(keys.value_target, target.unsqueeze(-1))
        return tensordict

    def value_estimate(
        self, tensordict: TensorDictBase, target_params=None, next_value=None, **kwargs
    ):
        """``value_target`` ``[B, L, 1]`` (TorchRL's ``value_estimate`` contract)."""
        return self.forward(tensordict.copy()).get(self.tensor_keys.value_target)
