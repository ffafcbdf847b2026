"""The one builder: samples -> the ``[B, L]`` token trajectory of docs/design.md section 1.

Row ``b`` holds sample ``b``'s prompt (the segments before its first trained segment) right-aligned
in the first ``P`` columns (``P`` = the batch's longest prompt) and the rest of the episode (every
trained segment, and any tool segment between them) from column ``P`` on, right-padded; ``L = P + R``
with ``R`` the longest rest. Every key is written by a handful of tensor operations over all rows at
once (the token ids are flattened once; nothing is padded twice), and "one batch, one weight
version" is checked here, once per batch (unless the batch holds partial rollouts, whose tokens
carry the version that sampled each of them).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict

from ar_torchrl.data.samples import Sample

__all__ = ["build_trajectory"]


def _as_ids(ids: Any) -> torch.Tensor:
    return torch.as_tensor(ids, dtype=torch.long).reshape(-1)


def _as_log_probs(segment: Any) -> torch.Tensor:
    lp = getattr(segment, "log_probs", None)
    if lp is None or not getattr(segment, "trained", False):
        return torch.zeros(len(segment), dtype=torch.float32)
    return torch.as_tensor(lp, dtype=torch.float32).reshape(-1)


def _flatten(segments: list) -> tuple[torch.Tensor, torch.Tensor]:
    """All token ids and log-probs (0 off trained segments) as two flat tensors: one conversion
    from Python lists (what a backend's protocol gives), or a concatenation of tensor segments."""
    if all(isinstance(x.token_ids, list) for x in segments):
        ids = torch.tensor(list(itertools.chain.from_iterable(x.token_ids for x in segments)))
        lps = itertools.chain.from_iterable(
            x.log_probs
            if getattr(x, "trained", False) and x.log_probs is not None
            else itertools.repeat(0.0, len(x))
            for x in segments
        )
        return ids.to(torch.long), torch.tensor(list(lps), dtype=torch.float32)
    return (
        torch.cat([_as_ids(x.token_ids) for x in segments]),
        torch.cat([_as_log_probs(x) for x in segments]),
    )


def _add_turn_rewards(reward, samples, loss_mask, rows, cols, segments, seg_len, turns) -> None:
    """Each sample's ``turn_rewards[u]`` onto the last trained token of its turn ``u``."""
    seg_row = rows.new_tensor([b for b, s in enumerate(samples) for _ in s.segments])
    seg_end = torch.cumsum(seg_len, 0) - 1  # flat index of each segment's last token
    last_of_turn: dict[tuple[int, int], int] = {}
    for i, (seg, t) in enumerate(zip(segments, turns)):
        if getattr(seg, "trained", False) and len(seg) and t is not None:
            last_of_turn[(int(seg_row[i]), int(t))] = int(seg_end[i])  # later segments win
    for b, s in enumerate(samples):
        for u, r in s.turn_rewards.items():
            if (b, int(u)) not in last_of_turn:
                raise ValueError(
                    f"build_trajectory: sample {b} has a reward for turn {u} but no trained segment "
                    f"of that turn (its turns: {sorted(t for (row, t) in last_of_turn if row == b)})"
                )
            flat = last_of_turn[(b, int(u))]
            reward[rows[flat], cols[flat], 0] += float(r)


def _versions(samples, segments, seg_len, trained, rows, cols, width) -> torch.Tensor:
    """``[B, L]`` int64: each trained token's version, the row's oldest version elsewhere."""
    oldest = torch.tensor([min(s.policy_versions) for s in samples], dtype=torch.long)
    out = oldest.unsqueeze(-1).expand(-1, width).clone()
    if not any(getattr(x, "token_versions", None) for x in segments) and all(
        len(s.policy_versions) == 1 for s in samples
    ):
        return out  # one version per row: broadcast (no per-token work)
    per_token = [
        torch.as_tensor(x.token_versions, dtype=torch.long).reshape(-1)
        if getattr(x, "token_versions", None)
        else torch.full((len(x),), int(getattr(x, "policy_version", None) or 0), dtype=torch.long)
        for x in segments
    ]
    flat = torch.cat(per_token) if per_token else torch.zeros(0, dtype=torch.long)
    keep = trained.repeat_interleave(seg_len)
    out[rows[keep], cols[keep]] = flat[keep]
    return out


def _check(samples: Sequence[Sample], rewards: Any, allow_mixed_versions: bool) -> None:
    if not samples:
        raise ValueError("build_trajectory: got no samples")
    if rewards is not None and len(rewards) != len(samples):
        raise ValueError(
            f"build_trajectory: {len(rewards)} rewards for {len(samples)} samples; pass one reward "
            "per sample (or none: each sample's own .reward)"
        )
    for b, s in enumerate(samples):
        if s.num_trained == 0:
            raise ValueError(
                f"build_trajectory: sample {b} (prompt {s.prompt_id}, finish {s.finish_reason!r}) "
                "has no trained token; there is no token to put its reward on"
            )
        for segment in s.segments:
            lp = getattr(segment, "log_probs", None)
            if getattr(segment, "trained", False) and lp is not None and len(lp) != len(segment):
                raise ValueError(
                    f"build_trajectory: sample {b} has a trained segment of {len(segment)} tokens "
                    f"with {len(lp)} log-probs"
                )
            versions = getattr(segment, "token_versions", None)
            if versions is not None and len(versions) != len(segment):
                raise ValueError(
                    f"build_trajectory: sample {b} has a segment of {len(segment)} tokens with "
                    f"{len(versions)} token versions"
                )
    versions = sorted(set().union(*(s.policy_versions for s in samples)))
    if len(versions) != 1 and not allow_mixed_versions:
        raise ValueError(
            f"build_trajectory: one batch mixes policy versions {versions} (a batch without "
            "partial rollouts has one: pass allow_mixed_versions=True for partial rollouts)"
        )


def build_trajectory(
    samples: Sequence[Sample],
    *,
    pad_token_id: int,
    rewards: Any = None,
    allow_mixed_versions: bool = False,
) -> TensorDict:
    """Build the token trajectory of ``samples``.

    Written keys (batch size ``[B, L]``):

    - ``"tokens"`` int64 (``pad_token_id`` where ``attention_mask`` is False),
      ``"attention_mask"`` bool (every real token), ``"loss_mask"`` bool (trained tokens only:
      never prompt, tool or padding tokens);
    - ``"rollout_log_prob"`` float32 (the engine's log-probs on trained tokens, 0 elsewhere);
    - ``("next", "reward")`` ``[B, L, 1]`` float32: the outcome reward on the last trained token;
    - ``("next", "done")`` on the last trained token; ``("next", "terminated")`` there when the
      episode ended by itself (``finish_reason == "stop"``), ``("next", "truncated")`` when it was cut;
      root ``"done"``/``"terminated"``/``"truncated"`` False (TorchRL: the current step's state);
    - ``"prompt_id"`` int64 (the sample's group, broadcast along ``L``) and ``"policy_version"``
      int64: the version that sampled each trained token; the row's oldest version elsewhere (a
      row of one version: that version, broadcast);
    - ``"turn_id"`` int64 when any segment has a ``turn``: the turn on trained tokens, -1 elsewhere.

    Args:
        samples: the rows (any order).
        pad_token_id: id written in padding (masks, not ids, say what is padding).
        rewards: ``[B]`` outcome rewards overriding each sample's ``.reward`` (e.g. after a TorchRL
            reward transform).
        allow_mixed_versions: accept samples of several weight versions (partial rollouts: a
            weight update interrupted generation, and every token keeps the version that sampled
            it); otherwise one batch holds one version.

    Raises:
        ValueError: no samples, a sample without trained tokens, mismatched log-probs or rewards,
            or samples of several weight versions without ``allow_mixed_versions``.

    Example:
        >>> from ar_torchrl.data.samples import Segment
        >>> s1 = Sample([Segment([4, 5]), Segment([7, 2], True, [-0.5, -0.1])], reward=1.0)
        >>> s2 = Sample([Segment([6]), Segment([9], True, [-1.0])], finish_reason="length", reward=-1.0)
        >>> td = build_trajectory([s1, s2], pad_token_id=0)
        >>> td.batch_size, td["tokens"].tolist()
        (torch.Size([2, 4]), [[4, 5, 7, 2], [0, 6, 9, 0]])
        >>> td["next", "reward"].squeeze(-1).tolist()
        [[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, -1.0, 0.0]]
        >>> td["next", "terminated"].squeeze(-1).any(-1).tolist()
        [True, False]
    """
    _check(samples, rewards, allow_mixed_versions)
    n = len(samples)
    heads = [s.first_trained for s in samples]
    seg_lists = [s.segments for s in samples]
    prompt_len = torch.tensor([sum(len(x) for x in segs[:k]) for segs, k in zip(seg_lists, heads)])
    total_len = torch.tensor([sum(len(x) for x in segs) for segs in seg_lists])
    width_p = int(prompt_len.max())
    width = width_p + int((total_len - prompt_len).max())
    segments = [x for segs in seg_lists for x in segs]
    seg_len = torch.tensor([len(x) for x in segments])
    trained = torch.tensor([bool(getattr(x, "trained", False)) for x in segments])
    flat_ids, flat_lp = _flatten(segments)
    flat_trained = trained.repeat_interleave(seg_len)
    # destination of every flat token: row b, columns [P - p_b, P - p_b + n_b)
    rows = torch.arange(n).repeat_interleave(total_len)
    starts = torch.cumsum(total_len, 0) - total_len
    offset = torch.arange(int(total_len.sum())) - starts.repeat_interleave(total_len)
    cols = (width_p - prompt_len).repeat_interleave(total_len) + offset
    tokens = torch.full((n, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.bool)
    loss_mask = torch.zeros((n, width), dtype=torch.bool)
    log_prob = torch.zeros((n, width), dtype=torch.float32)
    tokens[rows, cols] = flat_ids
    attention[rows, cols] = True
    loss_mask[rows, cols] = flat_trained
    log_prob[rows, cols] = torch.where(flat_trained, flat_lp, torch.zeros_like(flat_lp))
    last = width - 1 - loss_mask.flip(-1).int().argmax(-1)  # the last trained token of each row
    index = torch.arange(n)
    reward = torch.zeros((n, width, 1), dtype=torch.float32)
    outcome = [s.reward for s in samples] if rewards is None else rewards
    reward[index, last, 0] = torch.as_tensor(outcome, dtype=torch.float32).reshape(-1)
    done = torch.zeros((n, width, 1), dtype=torch.bool)
    done[index, last, 0] = True
    stop = torch.tensor([s.terminated for s in samples])
    terminated = done & stop.view(-1, 1, 1)
    false = torch.zeros((n, width, 1), dtype=torch.bool)
    data = {
        "tokens": tokens,
        "attention_mask": attention,
        "loss_mask": loss_mask,
        "rollout_log_prob": log_prob,
        "prompt_id": torch.tensor([int(s.prompt_id) for s in samples])
        .unsqueeze(-1)
        .expand(-1, width)
        .clone(),
        "policy_version": _versions(samples, segments, seg_len, trained, rows, cols, width),
        "done": false,
        "terminated": false.clone(),
        "truncated": false.clone(),
        "next": {
            "reward": reward,
            "done": done,
            "terminated": terminated,
            "truncated": done & ~terminated,
        },
    }
    turns = [getattr(x, "turn", None) for x in segments]
    if any(s.turn_rewards for s in samples):
        _add_turn_rewards(reward, samples, loss_mask, rows, cols, segments, seg_len, turns)
    if any(t is not None for t in turns):
        seg_turn = torch.tensor(
            [-1 if t is None or not tr else int(t) for t, tr in zip(turns, trained.tolist())]
        )
        turn_id = torch.full((n, width), -1, dtype=torch.long)
        turn_id[rows, cols] = seg_turn.repeat_interleave(seg_len)
        data["turn_id"] = turn_id
    return TensorDict(data, batch_size=[n, width])
