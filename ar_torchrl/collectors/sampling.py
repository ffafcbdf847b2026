"""One training batch from an ``LLMEnv``, with DAPO's dynamic sampling (over-sample and refill).

DAPO (arXiv:2503.14476, section 3.2) drops the prompts whose samples all got the same reward (zero
spread: no group-relative signal) and keeps sampling until the batch holds the wanted number of
prompts with a spread. :func:`gather_batch` does that over rounds of ``env.prompts_per_batch``
prompts, bounded by ``max_rounds`` (then it returns what it has, possibly nothing, and says so in
its stats). With ``dynamic=False`` it is one plain round (every group kept).

The stats describe **every generated sample**, before any drop, so the logged reward and accuracy
are unbiased; they also count the groups generated, with zero spread, kept and dropped.
"""

from __future__ import annotations

import logging

import torch
from tensordict import TensorDict, TensorDictBase

from ar_torchrl.envs.llm_env import LLMEnv
from ar_torchrl.functional import grpo_advantage

__all__ = ["batch_policy_version", "gather_batch"]

logger = logging.getLogger(__name__)


def batch_policy_version(batch: TensorDictBase) -> int:
    """The weight version of a token-trajectory batch (read, not checked: the trajectory builder,
    :func:`ar_torchrl.envs.layout.sequences_to_trajectory`, refused mixed versions when it built the
    batch).

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> batch_policy_version(TensorDict({"policy_version": torch.full((2, 3), 4)}, [2, 3]))
        4
    """
    return int(batch["policy_version"].reshape(-1)[0])


def _one_round(env: LLMEnv) -> tuple[TensorDictBase, TensorDictBase]:
    """A sequence-level round (raw, and with non-finite rows dropped); a row's group is its
    ``prompt_id`` (the dataset index of its prompt, as GRPO groups the trajectory)."""
    # whole episodes (one step for LLMEnv, one per turn for ToolEnv), through the env's transforms
    raw = env.episodes(env.rollout(env.max_turns))
    return raw, env.drop_non_finite(raw)


def _spread_groups(seq: TensorDictBase) -> tuple[list[int], int]:
    """Groups (in order) whose rewards differ, and how many groups have zero spread."""
    reward, group = seq["next", "reward"].reshape(-1), seq["prompt_id"]
    if seq.shape[0] == 0:
        return [], 0
    _, flat = grpo_advantage(reward, group)
    groups = list(dict.fromkeys(group.tolist()))
    spread = list(dict.fromkeys(group[~flat].tolist()))
    return spread, len(groups) - len(spread)


def _summary(rewards: list[torch.Tensor], samples: list, counts: dict[str, int]) -> dict:
    r = torch.cat(rewards) if rewards else torch.zeros(0)
    n = max(int(r.numel()), 1)
    out = {
        **{k: float(v) for k, v in counts.items()},
        "samples": float(r.numel()),
        "reward_mean": float(r.sum()) / n,
        "accuracy": sum(s.correct for s in samples) / n,  # what the reward called correct
        "truncated": sum(not s.terminated for s in samples) / n,  # cut by a cap
    }
    return out | episode_stats(samples)


def episode_stats(samples: list) -> dict[str, float]:
    """Means over multi-turn episodes (:class:`~ar_torchrl.envs.ToolEnv`'s samples): model turns,
    tool calls, failed calls, and the fraction of episodes that called a tool (empty otherwise)."""
    if not samples or "turns" not in samples[0].extra:
        return {}
    n = len(samples)
    return {
        "turns": sum(s.extra["turns"] for s in samples) / n,
        "tool_calls": sum(s.extra["tool_calls"] for s in samples) / n,
        "tool_errors": sum(s.extra["tool_errors"] for s in samples) / n,
        "tool_call_rate": sum(s.extra["tool_calls"] > 0 for s in samples) / n,
    }


def gather_batch(
    env: LLMEnv, *, dynamic: bool = False, max_rounds: int = 4, critic_flat_groups: bool = False
) -> tuple[TensorDict, dict[str, float]]:
    """A token-trajectory batch of ``env.prompts_per_batch`` groups, and stats over all samples.

    Args:
        env: the environment (its backend generates every round with one weight version).
        dynamic: keep only groups with reward spread, sampling more rounds to refill.
        max_rounds: most rounds when ``dynamic`` (>= 1).
        critic_flat_groups: with ``dynamic``, the zero-spread groups of every round stay in the
            batch for the critic only: the batch then has ``policy_mask`` (bool ``[B, L]``,
            ``loss_mask`` on the policy's rows, False on theirs) and ``stats["groups_critic_only"]``
            counts them (they still count as dropped for the policy).

    Returns:
        ``(batch, stats)``: ``batch`` is ``[B, L]`` with ``B = groups_kept * num_samples`` (fewer rows
        when non-finite rewards were dropped; ``B = 0`` when no group was kept) and ``stats`` has
        ``groups_generated``, ``groups_zero_spread``, ``groups_kept``, ``groups_dropped``,
        ``sampling_rounds``, ``non_finite_rewards_dropped``, ``samples``, and ``reward_mean`` /
        ``accuracy`` (fraction of samples the env's reward called correct) over every generated
        sample.
    """
    target, rounds = env.prompts_per_batch, max_rounds if dynamic else 1
    before = env.non_finite_rewards_dropped
    counts = dict.fromkeys(
        ("groups_generated", "groups_zero_spread", "groups_kept", "sampling_rounds"), 0
    )
    kept, flat_rows, rewards, scored, raw = [], [], [], [], None
    while counts["sampling_rounds"] < rounds and counts["groups_kept"] < target:
        raw, seq = _one_round(env)
        rewards.append(seq["next", "reward"].reshape(-1))
        scored += env.samples(seq)
        spread, flat = _spread_groups(seq)
        take = (spread if dynamic else list(dict.fromkeys(seq["prompt_id"].tolist())))[
            : target - counts["groups_kept"]
        ]
        kept.append(seq[torch.isin(seq["prompt_id"], torch.tensor(take, dtype=torch.long))])
        if dynamic and critic_flat_groups:
            flat_rows.append(
                seq[~torch.isin(seq["prompt_id"], torch.tensor(spread, dtype=torch.long))]
            )
        counts["groups_generated"] += target
        counts["groups_zero_spread"] += flat
        counts["groups_kept"] += len(take)
        counts["sampling_rounds"] += 1
    counts["groups_dropped"] = counts["groups_generated"] - counts["groups_kept"]
    counts["non_finite_rewards_dropped"] = env.non_finite_rewards_dropped - before
    if dynamic and counts["groups_kept"] < target:
        logger.warning(
            "dynamic sampling: only %d of %d groups have a reward spread after %d rounds; "
            "training on those",
            counts["groups_kept"],
            target,
            rounds,
        )
    rows = torch.cat(kept) if kept else raw[:0]
    n_policy = rows.shape[0]
    if flat_rows:
        critic = torch.cat(flat_rows)
        counts["groups_critic_only"] = len(dict.fromkeys(critic["prompt_id"].tolist()))
        rows = torch.cat([rows, critic]) if critic.shape[0] else rows
    batch = env.to_token_trajectory(rows) if rows.shape[0] else env.to_token_trajectory(raw)[:0]
    if dynamic and critic_flat_groups:
        policy_row = torch.arange(batch.shape[0]) < n_policy
        batch["policy_mask"] = batch["loss_mask"] & policy_row.unsqueeze(-1)
        counts.setdefault("groups_critic_only", 0)
    return batch, _summary(rewards, scored, counts)
