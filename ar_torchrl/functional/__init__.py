"""Pure tensor math for token-level PPO/GRPO on language models.

Every function here works on plain tensors (no TensorDict), documents its shapes, and treats a
boolean ``mask`` with ``True`` = "this token is trained on" (generated tokens only, docs/design.md
section 1). Masked positions never influence a result, a reduction or a gradient: inputs there are
replaced with zeros through :func:`torch.where` before any arithmetic, so even ``inf``/``nan``
garbage at masked positions is harmless.

References:
    GAE: Schulman et al. 2015, https://arxiv.org/abs/1506.02438
    Turn-level GAE: AReaL's ``gae_timestep_unit: turn`` (areal/trainer/ppo/gae.py)
    PPO: Schulman et al. 2017, https://arxiv.org/abs/1707.06347
    GRPO: Shao et al. 2024, https://arxiv.org/abs/2402.03300
    REINFORCE++: Hu et al. 2025, https://arxiv.org/abs/2501.03262
    DAPO (clip-higher, token-mean, dynamic sampling): Yu et al. 2025, https://arxiv.org/abs/2503.14476
    Dr.GRPO (no std scaling, constant length normaliser): Liu et al. 2025, https://arxiv.org/abs/2503.20783
    VAPO (decoupled / length-adaptive lambda): Yue et al. 2025, https://arxiv.org/abs/2504.05118
    Dual-clip PPO: Ye et al. 2020, https://arxiv.org/abs/1912.09729
    GSPO: Zheng et al. 2025, https://arxiv.org/abs/2507.18071
    CISPO: MiniMax-M1, 2025, https://arxiv.org/abs/2506.13585
    Rollout correction: verl's docs/algo/rollout_corr.md; IcePop (Ring-1T, 2025)
    PopArt: van Hasselt et al. 2016, https://arxiv.org/abs/1602.07714 (functional/popart.py)
    EV ceiling: the law of total variance over states of a frozen policy (functional/ceiling.py)
    Critic health (out-of-sample EV): verl's critic/vf_explained_var (functional/critic_health.py)
"""

from __future__ import annotations

from ar_torchrl.functional._shapes import check_finite_reward
from ar_torchrl.functional.ceiling import (
    CeilingEstimate,
    ev_ceiling,
    ev_ceiling_within_groups,
    prefix_state_ids,
)
from ar_torchrl.functional.confidence import CONFIDENCE_FEATURES, sampled_log_prob_features
from ar_torchrl.functional.critic_health import (
    explained_variance_or_nan,
    explained_variance_within_groups,
    monte_carlo_returns,
    position_thirds,
)
from ar_torchrl.functional.gae import (
    check_gae_inputs,
    length_adaptive_lmbda,
    token_gae,
)
from ar_torchrl.functional.grpo import grpo_advantage, rloo_advantage
from ar_torchrl.functional.kl import KL_ESTIMATORS, k3_kl, kl_penalty
from ar_torchrl.functional.losses import aggregate_loss, clipped_value_loss, loss_normalizer
from ar_torchrl.functional.policy_losses import (
    LOG_RATIO_CLAMP,
    cispo_surrogate,
    clipped_surrogate,
    gspo_surrogate,
    masked_log_ratio,
)
from ar_torchrl.functional.reductions import explained_variance, masked_mean, masked_whiten
from ar_torchrl.functional.reinforce import reinforce_pp_advantage
from ar_torchrl.functional.rollout_correction import (
    ROLLOUT_IS_LEVELS,
    ROLLOUT_MASK_MODES,
    rollout_correction,
    rollout_mismatch_metrics,
)
from ar_torchrl.functional.turns import count_turns, turn_gae
from ar_torchrl.utils.checks import AGGREGATION_MODES, AggregationMode

__all__ = [
    "CONFIDENCE_FEATURES",
    "sampled_log_prob_features",
    "AGGREGATION_MODES",
    "KL_ESTIMATORS",
    "LOG_RATIO_CLAMP",
    "ROLLOUT_IS_LEVELS",
    "ROLLOUT_MASK_MODES",
    "AggregationMode",
    "CeilingEstimate",
    "aggregate_loss",
    "check_finite_reward",
    "cispo_surrogate",
    "clipped_surrogate",
    "clipped_value_loss",
    "count_turns",
    "ev_ceiling",
    "ev_ceiling_within_groups",
    "explained_variance",
    "explained_variance_or_nan",
    "explained_variance_within_groups",
    "grpo_advantage",
    "gspo_surrogate",
    "reinforce_pp_advantage",
    "rloo_advantage",
    "k3_kl",
    "kl_penalty",
    "check_gae_inputs",
    "length_adaptive_lmbda",
    "loss_normalizer",
    "masked_log_ratio",
    "masked_mean",
    "monte_carlo_returns",
    "rollout_correction",
    "rollout_mismatch_metrics",
    "masked_whiten",
    "position_thirds",
    "prefix_state_ids",
    "token_gae",
    "turn_gae",
]
